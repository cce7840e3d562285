"""The FastAPI app (this module needs the serve extra): OpenAI's /v1/completions,
/v1/chat/completions and /v1/models, plus /health and /metrics, over one ``EngineLoop``.

Handlers validate (protocol.py), enqueue on the engine loop and await their events; they never
touch the engine. ``build_app(loop, settings)`` starts the loop in the app's lifespan and stops
it (aborting whatever is left) at shutdown.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from dataclasses import dataclass, field

from fastapi import Request

from rocdraft.errors import RocdraftError
from rocdraft.serve import protocol
from rocdraft.serve.engine_loop import Accepted, Delta, EngineLoop, Rejected
from rocdraft.serve.protocol import ApiError, GenerationRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeSettings:
    model_name: str
    max_model_len: int
    max_num_seqs: int
    max_waiting_requests: int | None = None  # None: no limit
    api_key: str | None = None
    chat_template: str | None = None
    special_tokens: dict = field(default_factory=dict)


class _Capacity:
    """Engine requests submitted and not yet finished (event-loop side: no lock needed)."""

    def __init__(self, settings: ServeSettings) -> None:
        self.in_flight = 0
        self.limit = None if settings.max_waiting_requests is None \
            else settings.max_num_seqs + settings.max_waiting_requests

    def check(self, n: int) -> None:
        """A 503 when ``n`` more requests would overfill the waiting queue: they would wait
        behind ``max_num_seqs`` running ones and ``max_waiting_requests`` waiting ones."""
        if self.limit is not None and self.in_flight + n > self.limit:
            raise ApiError(503, f"the server is busy: {self.in_flight} requests in flight, at "
                                f"most {self.limit} (--max-num-seqs + --max-waiting-requests); "
                                f"retry later", code="server_busy")


def build_app(loop: EngineLoop, settings: ServeSettings):
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    render = chat_renderer(settings)
    capacity = _Capacity(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop)

    app = FastAPI(title="rocdraft", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine_loop, app.state.capacity = loop, capacity

    def error_response(error: ApiError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        message = f"no route {request.method} {request.url.path}" if exc.status_code == 404 \
            else str(exc.detail)
        return error_response(ApiError(exc.status_code, message,
                                       code="not_found" if exc.status_code == 404 else None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        return error_response(ApiError(400, f"invalid request: {exc.errors()[:1]}"))

    @app.get("/health")
    async def health():
        if not loop.alive:
            return error_response(ApiError(503, f"the engine loop is not running"
                                                f"{': ' + loop.error if loop.error else ''}"))
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        if loop.metrics is None:
            raise ApiError(404, "metrics are off")
        body, content_type = loop.metrics.render()
        return Response(body, media_type=content_type)

    def check_api_key(request: Request) -> None:
        if settings.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), settings.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    @app.get("/v1/models")
    async def models(request: Request):
        check_api_key(request)
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": protocol.now(),
            "owned_by": "rocdraft", "max_model_len": settings.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_api_key(request)
        return await generate(request, protocol.parse_completion(await _json(request)))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        check_api_key(request)
        return await generate(request, protocol.parse_chat(await _json(request), render))

    async def generate(request: Request, req: GenerationRequest):
        if req.model is not None and req.model != settings.model_name:
            raise ApiError(404, f"model {req.model!r} is not served here; the served model is "
                                f"{settings.model_name!r}", "model", "model_not_found")
        if not loop.alive:
            raise ApiError(503, "the server is shutting down")
        capacity.check(len(req.prompts))
        run = _Run(loop, capacity, req, protocol.new_id(req.kind), settings.model_name)
        await run.start()
        if req.stream:
            return StreamingResponse(run.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            body = await _unless_disconnected(request, run.collect())
        finally:
            run.close()
        if body is None:  # the client left: its requests were aborted
            return Response(status_code=499)
        return JSONResponse(body, status_code=body.pop("_status", 200))

    return app


async def _json(request):
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


async def _unless_disconnected(request, work):
    """``await work``, or None (``work`` cancelled) when the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


class _Run:
    """One HTTP request's engine requests (one per prompt) and the events they produce."""

    def __init__(self, loop: EngineLoop, capacity: _Capacity, req: GenerationRequest,
                 request_id: str, model: str) -> None:
        self.loop, self.capacity, self.req, self.id, self.model = loop, capacity, req, \
            request_id, model
        self.events: asyncio.Queue = asyncio.Queue()
        self.created = protocol.now()
        self.unfinished = set(range(len(req.prompts)))
        self.pending: list = []  # events that came while acceptance was awaited
        self.closed = False

    def engine_id(self, index: int) -> str:
        return f"{self.id}-{index}"

    async def start(self) -> None:
        """Submit every prompt; a 400 (all of them withdrawn) if the engine refuses one."""
        self.capacity.in_flight += len(self.unfinished)
        for index, prompt in enumerate(self.req.prompts):
            self.loop.submit(self.engine_id(index), index, prompt, self.req.params,
                             self.req.stop, self.events)
        waiting, rejected = set(self.unfinished), None
        try:
            while waiting:
                event = await self.events.get()
                if isinstance(event, (Accepted, Rejected)):
                    waiting.discard(event.index)
                    if isinstance(event, Rejected):
                        self._finished(event.index)
                        rejected = rejected or event
                else:
                    self.pending.append(event)
        except BaseException:
            self.close()
            raise
        if rejected is not None:
            self.close()
            param = "messages" if self.req.kind == "chat" else "prompt"
            where = f"prompt {rejected.index}: " if len(self.req.prompts) > 1 else ""
            message = rejected.message.removeprefix(f"request {self.engine_id(rejected.index)!r}: ")
            raise ApiError(400, where + message, param)

    async def next_event(self) -> Delta:
        event = self.pending.pop(0) if self.pending else await self.events.get()
        if event.finish_reason is not None:
            self._finished(event.index)
        return event

    def _finished(self, index: int) -> None:
        if index in self.unfinished:
            self.unfinished.discard(index)
            self.capacity.in_flight -= 1

    def close(self) -> None:
        """Abort what has not finished (the client left, or an error) and free the slots."""
        for index in list(self.unfinished):
            self.loop.abort(self.engine_id(index))
            self._finished(index)
        self.closed = True

    # --- non-streaming -----------------------------------------------------------------------

    async def collect(self) -> dict:
        n = len(self.req.prompts)
        texts, ids = [[] for _ in range(n)], [[] for _ in range(n)]
        last: list[Delta | None] = [None] * n
        while self.unfinished:
            event = await self.next_event()
            texts[event.index].append(event.text)
            ids[event.index].extend(event.token_ids)
            last[event.index] = event
        errors = [e.error for e in last if e is not None and e.finish_reason == "error"]
        if errors:
            body = ApiError(500, errors[0]).body()
            body["_status"] = 500
            return body
        choices = [self._choice(i, "".join(texts[i]), ids[i], last[i]) for i in range(n)]
        body = protocol.envelope(self.req.kind, self.id, self.model, self.created, False)
        body["choices"] = choices
        body.update(self._totals(last))
        return body

    def _choice(self, index: int, text: str, ids: list[int], last: Delta) -> dict:
        choice = {"index": index, "finish_reason": last.finish_reason, "logprobs": None}
        if self.req.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if self.req.return_token_ids:
            choice["token_ids"] = ids
        choice["rocdraft"] = protocol.acceptance(last.num_verify_steps,
                                                 last.num_accepted_drafts)
        return choice

    @staticmethod
    def _totals(last: list[Delta]) -> dict:
        done = [e for e in last if e is not None]
        return {"usage": protocol.usage(sum(e.prompt_tokens for e in done),
                                        sum(e.completion_tokens for e in done)),
                "rocdraft": protocol.acceptance(sum(e.num_verify_steps for e in done),
                                                sum(e.num_accepted_drafts for e in done))}

    # --- streaming ---------------------------------------------------------------------------

    async def sse(self):
        """Server-Sent Events: one chunk per engine output (several tokens with speculation),
        the usage chunk when asked for, then ``data: [DONE]``. Leaving early (the client
        disconnected) aborts the unfinished requests."""
        n = len(self.req.prompts)
        last: list[Delta | None] = [None] * n
        try:
            if self.req.kind == "chat":
                for index in range(n):
                    yield self._sse(self._chunk([{"index": index, "logprobs": None,
                                                  "finish_reason": None, "delta": {
                                                      "role": "assistant", "content": ""}}]))
            while self.unfinished:
                event = await self.next_event()
                last[event.index] = event
                if event.finish_reason == "error":
                    yield self._sse(ApiError(500, event.error or "generation failed").body())
                    continue
                yield self._sse(self._chunk([self._stream_choice(event)]))
            if self.req.include_usage:
                chunk = self._chunk([])
                chunk.update(self._totals(last))
                yield self._sse(chunk)
            yield "data: [DONE]\n\n"
        finally:
            self.close()

    def _chunk(self, choices: list) -> dict:
        chunk = protocol.envelope(self.req.kind, self.id, self.model, self.created, True)
        chunk["choices"] = choices
        return chunk

    def _stream_choice(self, event: Delta) -> dict:
        choice = {"index": event.index, "finish_reason": event.finish_reason, "logprobs": None}
        if self.req.kind == "chat":
            choice["delta"] = {"content": event.text} if event.text or not event.finish_reason \
                else {}
        else:
            choice["text"] = event.text
        if self.req.return_token_ids:
            choice["token_ids"] = event.token_ids
        ext = {"num_tokens": len(event.token_ids)}
        if event.finish_reason is not None:
            ext.update(protocol.acceptance(event.num_verify_steps, event.num_accepted_drafts))
        choice["rocdraft"] = ext
        return choice

    @staticmethod
    def _sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def chat_renderer(settings: ServeSettings):
    """``render(messages) -> prompt text`` with the model's Jinja2 chat template, as Hugging Face
    renders it (sandboxed, trim_blocks/lstrip_blocks, add_generation_prompt, the special-token
    strings); without a template, a 400 saying so."""
    if settings.chat_template is None:
        def refuse(messages):
            raise ApiError(400, f"model {settings.model_name!r} has no chat template "
                                f"(tokenizer_config.json has no chat_template); use "
                                f"/v1/completions", "messages", "no_chat_template")
        return refuse
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        template = env.from_string(settings.chat_template)
    except TemplateError as exc:
        raise RocdraftError(f"the model's chat template does not compile: {exc}") from None

    def render(messages):
        try:
            return template.render(messages=messages, add_generation_prompt=True,
                                   **settings.special_tokens)
        except TemplateError as exc:
            raise ApiError(400, f"the chat template refused the messages: {exc}",
                           "messages") from None

    return render
