"""The ASGI middleware around every route: whatever happens, the answer is OpenAI JSON.

- Body limit: a ``Content-Length`` over ``max_request_bytes`` gets a 413 before any of the
  body is read; a body without one (chunked) is counted as it streams in and refused with a
  413 the moment it passes the limit. Nothing over the limit is ever buffered.
- Catch-all: an exception no route handled becomes a JSON 500 (no traceback in the body) and
  one log line naming the request and the error, not a 50-line traceback.
- Cancellation (uvicorn's last resort at shutdown, after ``--shutdown-timeout``) is logged
  in one line per request.

It sits between Starlette's outermost error middleware and the app's exception handlers, so
an ``ApiError`` raised while the body streams in (the 413) reaches those handlers as any
route's ApiError does.
"""
from __future__ import annotations

import asyncio
import json
import logging

from rocdraft.serve.protocol import ApiError

log = logging.getLogger(__name__)


def too_large(max_request_bytes: int, what: str) -> ApiError:
    return ApiError(413, f"the request body is {what}; the limit is {max_request_bytes} bytes "
                         f"(--max-request-bytes)", code="request_too_large")


class RequestGuard:
    """ASGI middleware: the body limit, the JSON catch-all and one-line cancellation logs."""

    def __init__(self, app, max_request_bytes: int) -> None:
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        self.app = app
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_request_bytes
        refusal = self._check_length(dict(scope["headers"]).get(b"content-length"))
        if refusal is not None:
            await send_error(send, refusal)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large(limit, f"at least {received} bytes (counted as it came)")
            return message

        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        where = f"{scope.get('method')} {scope.get('path')}"
        try:
            await self.app(scope, limited_receive, tracking_send)
        except ApiError as exc:  # the 413 of a body that streamed past the limit, where the
            if not started:       # app has no handler of its own (a plain Starlette app)
                await send_error(send, exc)
        except asyncio.CancelledError:
            log.warning("%s: cancelled (the server is shutting down)", where)
            raise
        except Exception as exc:  # the catch-all: one line, a JSON 500
            log.error("%s failed: %s", where, one_line(exc))
            if not started:
                await send_error(send, ApiError(500, f"internal server error "
                                                     f"({type(exc).__name__}); the server "
                                                     f"logged it", code="internal_error"))

    def _check_length(self, header: bytes | None) -> ApiError | None:
        if header is None:
            return None
        try:
            length = int(header)
        except ValueError:
            return ApiError(400, f"Content-Length {header[:40]!r} is not a number")
        if length > self.max_request_bytes:
            return too_large(self.max_request_bytes, f"{length} bytes (Content-Length)")
        return None


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


async def send_error(send, error: ApiError) -> None:
    """An ApiError as a complete JSON response on a raw ASGI ``send``."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
