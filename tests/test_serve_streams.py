"""How streams.py answers requests the engine ended early (the fake engine of
test_serve_app.py behind the real app): the shutdown's abort is a final chunk with
finish_reason "abort", an error event and [DONE] for a stream and a JSON 503 otherwise; the
waiting-queue capacity."""
from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")
from test_serve_app import FakeEngine, events, make_client  # noqa: E402

from rocdraft.serve.protocol import ApiError  # noqa: E402
from rocdraft.serve.streams import Capacity  # noqa: E402

REASON = "the server is shutting down: --shutdown-timeout 1 s ran out"


def abort_when_running(client, engine, n: int = 1) -> threading.Thread:
    """Hold the engine's steps; once ``n`` requests run, abort them all as the shutdown does."""
    engine.gate.clear()

    def abort():
        deadline = time.monotonic() + 10
        while len(engine.requests) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        client.app.state.engine_loop.abort_all(REASON)
        engine.gate.set()

    thread = threading.Thread(target=abort)
    thread.start()
    return thread


def test_a_stream_cut_at_shutdown_ends_with_abort_an_error_event_and_done():
    c, engine = make_client()
    with c:
        thread = abort_when_running(c, engine)
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 50, "stream": True})
        thread.join()
        got = events(r)
    assert got[-1] == "[DONE]"
    assert got[-2]["error"]["code"] == "server_shutting_down"
    assert got[-2]["error"]["message"] == REASON
    assert got[-3]["choices"][0]["finish_reason"] == "abort"
    assert engine.requests == {}


def test_a_non_streaming_request_cut_at_shutdown_is_a_json_503():
    c, engine = make_client()
    with c:
        thread = abort_when_running(c, engine)
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 50})
        thread.join()
    assert r.status_code == 503
    assert r.json()["error"] == {"message": REASON, "type": "server_error", "param": None,
                                 "code": "server_shutting_down"}


def test_capacity_counts_requests_in_flight():
    capacity = Capacity(max_num_seqs=2, max_waiting_requests=1)
    capacity.in_flight = 2
    capacity.check(1)
    with pytest.raises(ApiError, match="3 requests in flight, at most 3") as info:
        capacity.in_flight = 3
        capacity.check(1)
    assert info.value.status == 503
    Capacity(2, None).check(1000)  # no limit


def test_fake_engine_is_left_empty_after_normal_requests():
    c, engine = make_client(FakeEngine())
    with c:
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 3}).json()[
            "choices"][0]["finish_reason"] == "length"
    assert engine.requests == {}
