"""The ASGI guard (rocdraft/serve/guard.py) around a tiny Starlette app: the body limit from
Content-Length and while the body streams in, the JSON catch-all with one log line."""
from __future__ import annotations

import logging

import pytest

pytest.importorskip("starlette")
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from rocdraft.serve.guard import RequestGuard  # noqa: E402

LIMIT = 1000


async def echo_length(request):
    body = await request.body()
    return JSONResponse({"bytes": len(body)})


async def broken(request):
    raise RuntimeError("the secret traceback\nsecond line")


def client() -> TestClient:
    app = Starlette(routes=[Route("/echo", echo_length, methods=["POST"]),
                            Route("/broken", broken, methods=["POST"])])
    app.add_middleware(RequestGuard, max_request_bytes=LIMIT)
    return TestClient(app, raise_server_exceptions=False)


def test_body_within_the_limit_passes():
    assert client().post("/echo", content=b"x" * LIMIT).json() == {"bytes": LIMIT}


def test_content_length_over_the_limit_is_413_json():
    r = client().post("/echo", content=b"x" * (LIMIT + 1))
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["code"] == "request_too_large"
    assert error["message"] == (f"the request body is {LIMIT + 1} bytes (Content-Length); the "
                                f"limit is {LIMIT} bytes (--max-request-bytes)")


def test_chunked_body_is_refused_while_it_streams_in():
    """No Content-Length: counted chunk by chunk; the generator is not read to its end."""
    sent = []

    def chunks():
        for i in range(100):
            sent.append(i)
            yield b"y" * 300

    r = client().post("/echo", content=chunks())
    assert r.status_code == 413
    assert "the limit is 1000 bytes" in r.json()["error"]["message"]


def test_unhandled_exception_is_a_json_500_and_one_log_line(caplog):
    with caplog.at_level(logging.ERROR, logger="rocdraft.serve.guard"):
        r = client().post("/broken", content=b"{}")
    assert r.status_code == 500
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    assert "secret" not in r.text and "Traceback" not in r.text
    records = [rec for rec in caplog.records if rec.name == "rocdraft.serve.guard"]
    assert len(records) == 1 and records[0].exc_info is None
    assert records[0].getMessage() == "POST /broken failed: RuntimeError: the secret traceback"


def test_max_request_bytes_must_be_positive():
    with pytest.raises(ValueError, match="max_request_bytes must be >= 1, got 0"):
        RequestGuard(None, 0)
