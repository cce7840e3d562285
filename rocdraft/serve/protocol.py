"""The OpenAI wire format: request bodies -> validated requests, results -> response JSON, and
errors as ``{"error": {"message", "type", "param", "code"}}``.

Bodies are read as plain JSON and checked here (not by FastAPI's models) so that every bad
value gets a 400 in OpenAI's shape with a one-line message naming it; sampling values go
through ``SamplingParams``, whose checks are the engine's own.
"""
from __future__ import annotations

import numbers
import time
import uuid
from dataclasses import dataclass

from rocdraft.config import SamplingParams
from rocdraft.errors import RocdraftError
from rocdraft.serve.images import ImagePartError, image_part_bytes

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop_token_ids",
                   "ignore_eos")
# Fields OpenAI defines that this server cannot honour: refused unless left at their "off"
# value, so a client never silently gets something other than what it asked for.
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False),
               "suffix": (None, ""), "best_of": (None, 1), "presence_penalty": (None, 0),
               "frequency_penalty": (None, 0), "logit_bias": (None, {}),
               "tools": (None, []), "functions": (None, [])}
INT64_MAX = 2 ** 63 - 1


class ApiError(Exception):
    """An error answered as OpenAI JSON with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
             404: "invalid_request_error", 413: "invalid_request_error",
             503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # extra response headers (401: WWW-Authenticate)

    def body(self) -> dict:
        return error_body(self.message, self.TYPES.get(self.status, "invalid_request_error"),
                          self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass(frozen=True)
class GenerationRequest:
    """One validated /v1/completions or /v1/chat/completions body. ``prompts``: one entry per
    choice, each a string or token ids (chat: the rendered template)."""

    kind: str  # "completion" | "chat"
    prompts: tuple
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    model: str | None
    max_tokens_given: bool = False  # the client set max_tokens (else a default, capped)


def parse_completion(body) -> GenerationRequest:
    body = _object(body)
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required (a string, a list of strings, token ids or "
                            "a list of token-id lists)", "prompt")
    return _request("completion", body, _prompts(body["prompt"]), default_max_tokens=16)


def parse_chat(body, render) -> GenerationRequest:
    """``render(messages) -> str`` applies the model's chat template (raising ApiError)."""
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects",
                       "messages")
    images: list[bytes] = []  # image_url parts in message order (rocdraft/serve/images.py)
    checked = [_message(i, m, images) for i, m in enumerate(messages)]
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    prompt = render(checked)
    return _request("chat", body, ({"prompt": prompt, "images": images} if images else prompt,),
                    default_max_tokens=None)


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got "
                            f"{type(body).__name__}")
    return body


def _request(kind: str, body: dict, prompts: tuple, default_max_tokens) -> GenerationRequest:
    for name, allowed in UNSUPPORTED.items():
        if name in body and not any(_same(body[name], a) for a in allowed):
            raise ApiError(400, f"{name}={short(body[name])} is not supported by rocdraft serve "
                                f"(leave it unset)", name)
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or n != 1):
        raise ApiError(400, f"n must be 1 (one choice per prompt), got {short(n)}", "n")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"model must be a string, got {short(model)}", "model")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, f"stream_options must be an object, got {short(options)}",
                       "stream_options")
    include_usage = bool(options and _flag(options, "include_usage", "stream_options."))
    if options and not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true",
                       "stream_options")
    return GenerationRequest(kind, prompts, sampling_params(body, default_max_tokens),
                             _stop_strings(body.get("stop")), stream, include_usage,
                             _flag(body, "return_token_ids"), model,
                             max_tokens_given=body.get("max_tokens") is not None)


def sampling_params(body: dict, default_max_tokens: int | None) -> SamplingParams:
    """The body's sampling fields as SamplingParams (absent or null fields keep the defaults;
    max_tokens defaults to ``default_max_tokens``, None: as long as max_model_len allows)."""
    values = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    values.setdefault("max_tokens", default_max_tokens or 1 << 30)
    try:
        params = SamplingParams(**values)
    except RocdraftError as exc:
        message = str(exc)
        param = next((f for f in SAMPLING_FIELDS if message.startswith(f)), None)
        raise ApiError(400, clip(message), param) from None
    except TypeError as exc:  # e.g. stop_token_ids of the wrong kind reaching tuple()
        raise ApiError(400, clip(str(exc))) from None
    if params.top_k > INT64_MAX:  # the sampler holds top_k in an int64 tensor
        raise ApiError(400, f"top_k must be at most {INT64_MAX} (0 or -1: disabled), got "
                            f"{short(params.top_k)}", "top_k")
    return params


def _prompts(prompt) -> tuple:
    """A string, a list of strings, a list of ints or a list of int lists -> one per choice."""
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return tuple(prompt)
        if all(_is_int(t) for t in prompt):
            return (list(prompt),)
        if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
            return tuple(list(p) for p in prompt)
    raise ApiError(400, f"prompt must be a string, a list of strings, a list of token ids or a "
                        f"list of token-id lists, got {short(prompt)}", "prompt")


def _message(index: int, message, images: list[bytes]) -> dict:
    """A checked message: text parts joined into one string, or with image_url parts (their
    bytes appended to ``images``) the parts list the chat template renders, images as
    ``{"type": "image"}``."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(400, f"{where} must be an object with a string 'role'", "messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text, and images as base64 data: URLs
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                try:
                    images.append(image_part_bytes(part, f"{where}.content[{j}]"))
                except ImagePartError as exc:
                    raise ApiError(400, str(exc), "messages") from None
                parts.append({"type": "image"})
                continue
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}.content[{j}] must be {{'type': 'text', 'text': "
                                    f"...}} or an image_url part", "messages")
            parts.append({"type": "text", "text": part["text"]})
        has_image = any(p["type"] == "image" for p in parts)
        content = parts if has_image else "".join(p["text"] for p in parts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise ApiError(400, f"{where}.content must be a string or a list of text parts, got "
                            f"{short(content)}", "messages")
    return {**message, "content": content}


def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop must be a non-empty string or a list of them, got "
                            f"{short(stop)}", "stop")
    return tuple(stops)


def _flag(body: dict, name: str, prefix: str = "") -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{prefix}{name} must be true or false, got {short(value)}",
                       prefix + name)
    return value


def _same(value, allowed) -> bool:
    """``value`` is the "off" value ``allowed`` (0 and 0.0 alike; False is not 0)."""
    if allowed is None or isinstance(allowed, bool) or isinstance(value, bool):
        return value is allowed
    if isinstance(allowed, numbers.Number):
        return isinstance(value, numbers.Number) and value == allowed
    return value == allowed


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def clip(message: str, limit: int = 300) -> str:
    """A message quoting a client's value, cut to ``limit`` characters (a 3 MB string in a
    numeric field must not come back whole)."""
    return message if len(message) <= limit else message[:limit - 3] + "..."


def short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- responses ----------------------------------------------------------------------------------

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def acceptance(num_verify_steps: int, num_accepted_drafts: int) -> dict:
    """The rocdraft extension: accepted drafts + 1 per verification step (None: the request
    verified no drafts, e.g. without speculation)."""
    length = (num_accepted_drafts + num_verify_steps) / num_verify_steps \
        if num_verify_steps else None
    return {"acceptance_length": length, "num_verify_steps": num_verify_steps,
            "num_accepted_drafts": num_accepted_drafts}


def envelope(kind: str, request_id: str, model: str, created: int, stream: bool) -> dict:
    obj = {"completion": ("text_completion", "text_completion"),
           "chat": ("chat.completion", "chat.completion.chunk")}[kind][stream]
    return {"id": request_id, "object": obj, "created": created, "model": model}


def now() -> int:
    return int(time.time())
