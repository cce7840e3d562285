"""Admission: a parsed request -> token-id prompts that fit the context, or a 400 naming why.

Runs in a worker thread (``asyncio.to_thread``), never on the event loop nor the engine
thread: tokenizing a long prompt is CPU work that would stall every stream and /health.
Text that cannot fit is refused before it is tokenized at all, from a lower bound on its
token count::

    min_tokens(text) = ceil(len(text) / max_token_bytes)

(``len(text)`` characters <= its UTF-8 bytes; one token stands for at most
``max_token_bytes`` bytes, ``models/tokenizer.py``). A 5 MB prompt on a 2,048-token model
with 16-byte tokens needs at least 327,680 tokens: refused in microseconds.

What is refused (each a 400 naming the numbers):
- a prompt of P tokens (or at least P) when P >= max_model_len (one token must be generated);
- P + max_tokens > max_model_len when the client set max_tokens (a default max_tokens is
  capped at the context instead: chat's "as long as the context allows");
- prompt token ids outside the vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from rocdraft.errors import RocdraftError
from rocdraft.core.prompts import prompt_error
from rocdraft.serve.protocol import ApiError, GenerationRequest


@dataclass(frozen=True)
class ContextLimits:
    """What a prompt is checked against. ``max_token_bytes`` None: no early refusal (a
    tokenizer that cannot bound its tokens); ``vocab_size`` None: ids are not checked here."""

    max_model_len: int
    vocab_size: int | None = None
    max_token_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise RocdraftError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_token_bytes is not None and self.max_token_bytes < 1:
            raise RocdraftError(f"max_token_bytes must be >= 1, got {self.max_token_bytes}")


def min_tokens(text: str, max_token_bytes: int) -> int:
    """A lower bound on the token count of ``text``: ceil(characters / max_token_bytes).
    Example: ``min_tokens("x = 1\\n" * 874000, 16)`` -> 327750."""
    return -(-len(text) // max_token_bytes)


def admit(req: GenerationRequest, tokenizer, limits: ContextLimits) -> GenerationRequest:
    """``req`` with every prompt as token ids that fit ``limits`` -> or ApiError(400)."""
    param = "messages" if req.kind == "chat" else "prompt"
    many = len(req.prompts) > 1
    prompts = []
    for index, prompt in enumerate(req.prompts):
        where = f"prompt {index}: " if many else ""
        images = None
        if isinstance(prompt, dict):  # a chat with images: {"prompt": text, "images": [...]}
            prompt, images = prompt["prompt"], prompt["images"]
        if isinstance(prompt, str):
            _refuse_early(prompt, req, limits, where, param)
            prompt = _tokenize(prompt, tokenizer, where, param)
        # (with images, the engine checks the length again once each image-pad token is
        # expanded to its grid: rocdraft/core/multimodal.py)
        _check_fits(list(prompt), req, limits, where, param)
        prompts.append(list(prompt) if images is None
                       else {"prompt_token_ids": list(prompt), "images": images})
    return replace(req, prompts=tuple(prompts))


def check_stop_token_ids(req: GenerationRequest, limits: ContextLimits) -> None:
    """Stop token ids outside the vocabulary could never match: a 400, as for prompt ids."""
    if limits.vocab_size is None:
        return
    bad = [t for t in req.params.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise ApiError(400, f"stop_token_ids {bad[:5]} outside the vocabulary "
                            f"[0, {limits.vocab_size})", "stop_token_ids")


def _refuse_early(text: str, req: GenerationRequest, limits: ContextLimits, where: str,
                  param: str) -> None:
    if limits.max_token_bytes is None:
        return
    at_least = min_tokens(text, limits.max_token_bytes)
    _check_lengths(at_least, "at least ", req, limits, where, param)


def _tokenize(text: str, tokenizer, where: str, param: str) -> list[int]:
    if tokenizer is None:
        raise ApiError(400, f"{where}text prompt given but the model has no tokenizer.json; "
                            f"send token ids", param)
    try:
        return tokenizer.encode(text)
    except RocdraftError as exc:
        raise ApiError(400, f"{where}{exc}", param) from None


def _check_fits(ids: list[int], req: GenerationRequest, limits: ContextLimits, where: str,
                param: str) -> None:
    if limits.vocab_size is not None:
        error = prompt_error(ids, limits.vocab_size, 1 << 62)  # lengths: checked below
        if error:
            raise ApiError(400, where + error, param)
    _check_lengths(len(ids), "", req, limits, where, param)


def _check_lengths(num_tokens: int, qualifier: str, req: GenerationRequest,
                   limits: ContextLimits, where: str, param: str) -> None:
    max_len = limits.max_model_len
    if num_tokens >= max_len:
        raise ApiError(400, f"{where}prompt of {qualifier}{num_tokens} tokens does not fit "
                            f"max_model_len {max_len} (at least one token must be generated)",
                       param, "context_length_exceeded")
    if req.max_tokens_given and num_tokens + req.params.max_tokens > max_len:
        raise ApiError(400, f"{where}prompt of {qualifier}{num_tokens} tokens + max_tokens "
                            f"{req.params.max_tokens} exceeds max_model_len {max_len}; ask for "
                            f"at most max_tokens {max_len - num_tokens}", "max_tokens",
                       "context_length_exceeded")
