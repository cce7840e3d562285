"""The FastAPI app (this module needs the serve extra): OpenAI's /v1/completions,
/v1/chat/completions and /v1/models, plus /health and /metrics, over one ``EngineLoop``.

Handlers read the body (guard.py bounds it), then parse, render the chat template and
tokenize in a worker thread (admission.py: never on the event loop, nor on the engine
thread), enqueue token ids on the engine loop and await their events (streams.py); they never
touch the engine. ``build_app(loop, settings)`` starts the loop in the app's lifespan, watches
it (``on_engine_dead(reason)`` once the engine cannot serve) and stops it at shutdown.

Every answer is OpenAI JSON. The body is parsed as JSON whatever its ``Content-Type`` (curl's
``-d`` sends ``application/x-www-form-urlencoded``); a body that is not JSON is a 400 saying
so. Without ``--api-key`` every route is open; with it, /v1/* need ``Authorization: Bearer``
(401 with ``WWW-Authenticate: Bearer`` otherwise) while /health (up or why not) and /metrics
(counts and latencies, no request content) stay open, as in vLLM.
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
from rocdraft.serve.admission import ContextLimits, admit, check_stop_token_ids
from rocdraft.serve.chat_template import chat_renderer
from rocdraft.serve.engine_loop import EngineLoop
from rocdraft.serve.guard import RequestGuard
from rocdraft.serve.protocol import ApiError, GenerationRequest
from rocdraft.serve.streams import Capacity, Run

log = logging.getLogger(__name__)
DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB: a 1M-character prompt fits, a runaway body not
HEALTH_POLL_S = 0.05  # how often the lifespan task looks for a dead engine


@dataclass(frozen=True)
class ServeSettings:
    model_name: str
    max_model_len: int
    max_num_seqs: int
    max_waiting_requests: int | None = None  # None: no limit
    api_key: str | None = None
    chat_template: str | None = None
    special_tokens: dict = field(default_factory=dict)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    vocab_size: int | None = None  # None: prompt and stop ids are checked by the engine only
    max_token_bytes: int | None = None  # None: no early refusal of long text (admission.py)

    def __post_init__(self) -> None:
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise RocdraftError(f"max_waiting_requests must be >= 0, got "
                                f"{self.max_waiting_requests}")
        if self.max_request_bytes < 1:
            raise RocdraftError(f"max_request_bytes must be >= 1, got "
                                f"{self.max_request_bytes}")

    @property
    def limits(self) -> ContextLimits:
        return ContextLimits(self.max_model_len, self.vocab_size, self.max_token_bytes)


def build_app(loop: EngineLoop, settings: ServeSettings, on_engine_dead=None):
    """The app over ``loop``. ``on_engine_dead(reason)`` is called once (on the event loop)
    when the engine can no longer serve; /health says 503 with the reason either way."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    render = chat_renderer(settings)
    capacity = Capacity(settings.max_num_seqs, settings.max_waiting_requests)
    tokenizer = loop.engine.tokenizer
    limits = settings.limits

    async def watch_engine():
        while not loop.dead.is_set():
            await asyncio.sleep(HEALTH_POLL_S)
        if on_engine_dead is not None:
            on_engine_dead(loop.health())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        watcher = asyncio.ensure_future(watch_engine())
        try:
            yield
        finally:
            watcher.cancel()
            await asyncio.to_thread(loop.stop)

    app = FastAPI(title="rocdraft", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(RequestGuard, max_request_bytes=settings.max_request_bytes)
    app.state.engine_loop, app.state.capacity = loop, capacity

    def error_response(error: ApiError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

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
        reason = loop.health()
        if reason is not None:
            return error_response(ApiError(503, reason, code="engine_unavailable"))
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
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/v1/models")
    async def models(request: Request):
        check_api_key(request)
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": protocol.now(),
            "owned_by": "rocdraft", "max_model_len": settings.max_model_len}]}

    def prepare(kind: str, raw: bytes) -> GenerationRequest:
        """In a worker thread: parse, render, check and tokenize."""
        body = parse_json(raw)
        req = protocol.parse_chat(body, render) if kind == "chat" \
            else protocol.parse_completion(body)
        check_model(req)
        check_stop_token_ids(req, limits)
        return admit(req, tokenizer, limits)

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_api_key(request)
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        check_api_key(request)
        return await generate(request, "chat")

    def check_model(req: GenerationRequest) -> None:
        if req.model is not None and req.model != settings.model_name:
            raise ApiError(404, f"model {protocol.short(req.model)} is not served here; the "
                                f"served model is {settings.model_name!r}", "model",
                           "model_not_found")

    async def generate(request: Request, kind: str):
        reason = loop.health()
        if reason is not None:
            raise ApiError(503, reason, code="engine_unavailable")
        raw = await request.body()
        req = await asyncio.to_thread(prepare, kind, raw)
        capacity.check(len(req.prompts))
        run = Run(loop, capacity, req, protocol.new_id(req.kind), settings.model_name)
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


def parse_json(raw: bytes):
    """The request body as JSON -> or a 400: not JSON, not UTF-8, nested too deep, or a
    number too long to convert."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply to parse") from None
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not UTF-8: {exc}") from None
    except ValueError as exc:  # JSONDecodeError, and int strings over Python's digit limit
        raise ApiError(400, f"the request body is not valid JSON: "
                            f"{protocol.clip(str(exc))} (send a JSON object; the Content-Type "
                            f"is not looked at)") from None


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
