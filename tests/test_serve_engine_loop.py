"""EngineLoop's hand-off to the event loop (the fake engine of test_serve_app.py; the routes
over it are tested there)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from rocdraft.config import SamplingParams
from rocdraft.serve.engine_loop import Accepted, Delta, EngineLoop, Rejected

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


class FakeExecutor:
    """What the loop reads of a tensor-parallel executor: ``failure`` and its listeners."""

    def __init__(self) -> None:
        self.failure = None
        self.listeners = []

    def add_failure_listener(self, listener) -> None:
        self.listeners.append(listener)

    def die(self, reason: str) -> None:
        self.failure = reason
        for listener in self.listeners:
            listener(reason)


def test_a_dead_worker_ends_the_idle_loop_fails_its_requests_and_refuses_new_ones():
    engine = FakeEngine()
    engine.executor = FakeExecutor()
    engine.gate.clear()  # the request stays in flight
    loop = EngineLoop(engine)

    async def main():
        first = asyncio.Queue()
        loop.start()
        loop.submit("r0", 0, "hi", SamplingParams(max_tokens=64), (), first)
        assert isinstance(await first.get(), Accepted)
        assert loop.health() is None
        engine.executor.die("tensor-parallel worker(s) died: rank 1 exit code -9 (SIGKILL)")
        engine.gate.set()  # the step held at the gate finishes, then the loop ends
        failed = await first.get()
        while failed.finish_reason is None:
            failed = await first.get()
        await asyncio.to_thread(loop.dead.wait, 5)
        late = asyncio.Queue()
        loop.submit("r1", 0, "hi", SamplingParams(max_tokens=4), (), late)
        return failed, await late.get()

    failed, refused = asyncio.run(main())
    reason = "tensor-parallel worker(s) died: rank 1 exit code -9 (SIGKILL)"
    assert failed.finish_reason == "error" and failed.error == reason
    assert loop.dead.is_set() and not loop.alive
    assert loop.health() == f"the engine is dead: {reason}"
    assert isinstance(refused, Rejected) and refused.status == 503 and reason in refused.message
    assert engine.requests == {}


def test_abort_all_ends_every_request_with_its_reason_and_keeps_running():
    engine = FakeEngine()
    engine.gate.clear()
    loop = EngineLoop(engine)

    async def main():
        queues = [asyncio.Queue() for _ in range(2)]
        loop.start()
        for i, q in enumerate(queues):  # in order before the abort (one command queue)
            loop.submit(f"r{i}", i, "hi", SamplingParams(max_tokens=64), (), q)
        loop.abort_all("the server is shutting down: --shutdown-timeout 1 s ran out")
        engine.gate.set()  # a step held at the gate ends first, then the abort comes
        ended = []
        for q in queues:
            assert isinstance(await q.get(), Accepted)
            event = await q.get()
            while event.finish_reason is None:
                event = await q.get()
            ended.append(event)
        after = asyncio.Queue()
        loop.submit("r9", 0, "hi", SamplingParams(max_tokens=2), (), after)
        events = [await after.get()]
        while not (isinstance(events[-1], Delta) and events[-1].finish_reason):
            events.append(await after.get())
        await asyncio.to_thread(loop.stop, 10)
        return ended, events

    ended, events = asyncio.run(main())
    assert [e.finish_reason for e in ended] == ["abort", "abort"]
    assert all("--shutdown-timeout 1 s" in e.error for e in ended)
    assert events[-1].finish_reason == "length"  # still serving
    assert engine.requests == {}
