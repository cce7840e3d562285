"""EngineLoop's hand-off to the event loop (the fake engine of test_serve_app.py; the routes
over it are tested there)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from rocdraft.config import SamplingParams
from rocdraft.serve.engine_loop import Accepted, Delta, EngineLoop

pytest.importorskip("fastapi")
from test_serve_app import REPLY, FakeEngine  # noqa: E402


def test_one_event_loop_callback_per_step_for_every_request():
    """Each call_soon_threadsafe wakes the event loop, which then takes the GIL from the
    engine thread mid-step: a step's events for all its requests go in one callback."""
    engine, n = FakeEngine(), 4
    loop = EngineLoop(engine)
    steps = len(REPLY.encode()) + 1  # REPLY's bytes then EOS, one token a step

    async def main():
        aio = asyncio.get_running_loop()
        calls = []
        original = aio.call_soon_threadsafe

        def counting(callback, *args):
            if threading.current_thread().name == "rocdraft-engine":  # a wake-up per call
                calls.append(callback)
            return original(callback, *args)

        aio.call_soon_threadsafe = counting
        queues = [asyncio.Queue() for _ in range(n)]
        for i, q in enumerate(queues):
            loop.submit(f"r{i}", i, "hi", SamplingParams(max_tokens=64), (), q)
        loop.start()  # after the submissions: every request joins the first step
        events = [[] for _ in queues]
        for got, q in zip(events, queues):
            while not (got and isinstance(got[-1], Delta) and got[-1].finish_reason):
                got.append(await q.get())
        await asyncio.to_thread(loop.stop, 10)
        return calls, events

    calls, events = asyncio.run(main())
    for got in events:
        assert isinstance(got[0], Accepted)
        assert "".join(e.text for e in got[1:]) == REPLY
        assert got[-1].finish_reason == "stop"
    assert len(calls) <= steps + 2  # one per step (+ the acceptances), not one per request
