"""The one background loop that drives the engine, and how HTTP handlers talk to it.

Why a thread (not an asyncio task): ``LLMEngine.step`` is seconds of blocking torch work at
worst (a long prefill on the CPU); run on the event loop it would stall every connection, the
streams already running included, and /health. The engine is not thread-safe, so exactly one
thread, this loop's, calls ``add_request``/``abort_request``/``step``. Handlers run on the
event loop and never touch the engine:

    handler --submit/abort--> command queue (queue.SimpleQueue, thread-safe)
    engine thread: drain commands -> engine.step() -> detokenize, stop strings -> events
    one step's events --one loop.call_soon_threadsafe--> each request's asyncio.Queue --> handler

The events of one step (or one batch of commands) go to the event loop in one callback, not one
per request: every ``call_soon_threadsafe`` wakes the event loop, which then takes the GIL from
the engine thread in the middle of its step (on 2 CPU cores, 8 streams, the built-in target:
one wake-up per request made a decode step 10-14% slower than in ``LLM.generate``, one per step
3-13%).

Between steps the thread applies every queued command, so requests join and leave the batch
between any two steps; with nothing to run it blocks on the queue (no polling). Text is
decoded in this thread too (``TextStream``): a stop string then aborts the request before the
next step, so no tokens are generated past it.

Events, in order, for each submitted request: ``Accepted`` or ``Rejected`` (add_request
raised: a 400 naming the value; the engine is unchanged; or the loop is dead: a 503), then
``Delta``s, the last with ``finish_reason`` set. A request aborted by its handler (client
gone) gets no more events.

Health (``health()``, what /health answers): the loop is dead when its thread ended, or when
the engine cannot step any more: a tensor-parallel worker died (the executor's sentinel watch
tells this loop at once, also while it is idle) or a step failed that way. The loop then ends
every request with an error event, refuses new ones with 503 and sets ``dead``.
``abort_all(reason)`` (``--shutdown-timeout`` ran out) ends every request with
``finish_reason`` "abort" and ``reason``; the loop keeps running.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from rocdraft.serve.detokenize import TextStream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Accepted:
    index: int


@dataclass(frozen=True)
class Rejected:
    index: int
    message: str
    status: int = 400  # 503: the loop is dead


@dataclass(frozen=True)
class Delta:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # None while running
    prompt_tokens: int
    completion_tokens: int
    num_verify_steps: int
    num_accepted_drafts: int
    error: str | None = None


@dataclass(frozen=True)
class Snapshot:
    """Engine state published after every step (read by /metrics and the 503 check)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    generated_tokens: int = 0
    num_verify_steps: int = 0
    num_accepted_drafts: int = 0
    accepted_at_position: tuple[int, ...] = ()
    proposed_at_position: tuple[int, ...] = ()
    num_preemptions: int = 0


@dataclass(frozen=True)
class _Sink:
    """Where one request's events go: an asyncio.Queue on its event loop."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue


def _fan_out(batch: list[tuple[asyncio.Queue, object]]) -> None:
    """On the event loop: hand one step's events to their queues, in order."""
    for events, event in batch:
        events.put_nowait(event)


@dataclass
class _Tracked:
    """Engine-thread state of one request."""

    index: int
    sink: _Sink
    stream: TextStream | None  # None: the target has no tokenizer (token ids only)
    arrival: float
    prompt_tokens: int = 0
    first_token: float | None = None
    last_output: float | None = None
    tokens: list[int] = field(default_factory=list)


class EngineLoop:
    def __init__(self, engine, metrics=None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="rocdraft-engine", daemon=True)
        self.snapshot = self._take_snapshot()
        self.running = False
        self.error: str | None = None  # why the loop died, if it did
        self.dead = threading.Event()  # set when the loop ended with ``error``
        self._closed = False  # no command is taken any more (under _submit_lock)
        self._submit_lock = threading.Lock()
        executor = getattr(engine, "executor", None)
        if executor is not None:  # a dead worker ends the loop at once, idle or not
            executor.add_failure_listener(lambda reason: self._commands.put(("dead", reason)))

    # --- called from the event loop -----------------------------------------------------------

    def start(self) -> None:
        self.running = True
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Abort whatever is still in flight and end the thread."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)
        self.running = False

    @property
    def alive(self) -> bool:
        return self.running and self._thread.is_alive() and not self.dead.is_set()

    def health(self) -> str | None:
        """Why the engine cannot serve (its loop died, a tensor-parallel worker died), or
        None when it can. Cheap: /health calls it on the event loop."""
        if self.error is not None:
            return f"the engine is dead: {self.error}"
        failure = getattr(getattr(self.engine, "executor", None), "failure", None)
        if failure is not None:
            return f"the engine is dead: {failure}"
        if not self.alive:
            return "the engine loop is not running (the server is shutting down)"
        return None

    def submit(self, request_id: str, index: int, prompt, params, stop: tuple[str, ...],
               events: asyncio.Queue) -> None:
        """Queue a request; its events go to ``events`` (on the calling event loop). Once the
        loop has ended, a 503 ``Rejected`` comes back at once."""
        sink = _Sink(asyncio.get_running_loop(), events)
        with self._submit_lock:
            if not self._closed:
                self._commands.put(("add", request_id, index, prompt, params, stop, sink,
                                    time.perf_counter()))
                return
        events.put_nowait(Rejected(index, self.health() or "the engine loop is not running",
                                   503))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def abort_all(self, reason: str) -> None:
        """End every request in flight with finish_reason "abort" and ``reason``."""
        self._commands.put(("abort_all", reason))

    # --- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                more = self._apply_commands(block=idle)
                self._flush()
                if not more:
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                    self._flush()
                self.snapshot = self._take_snapshot()
        except _EngineDead as dead:
            self.error = str(dead)
            log.error("engine loop stopped: %s", self.error)
            self._fail_all(self.error)
        except BaseException as exc:  # the loop must never die silently
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("engine loop stopped")
            self._fail_all(self.error)
        finally:
            self._abort_all("the server is shutting down")
            self._refuse_queued()
            self._flush()
            self.running = False
            self.snapshot = self._take_snapshot()
            if self.error is not None:
                self.dead.set()

    def _refuse_queued(self) -> None:
        """Take no more commands; requests still queued get a 503."""
        with self._submit_lock:
            self._closed = True
        reason = self.health() or "the server is shutting down"
        while True:
            try:
                command = self._commands.get(block=False)
            except queue.Empty:
                return
            if command[0] == "add":
                self._emit(command[6], Rejected(command[2], reason, 503))

    def _emit(self, sink: _Sink, event) -> None:
        """Queue ``event`` for its handler; ``_flush`` sends it."""
        self._outbox.setdefault(sink.loop, []).append((sink.events, event))

    def _flush(self) -> None:
        """Send the queued events: one event-loop callback per event loop."""
        outbox, self._outbox = self._outbox, {}
        for loop, batch in outbox.items():
            try:
                loop.call_soon_threadsafe(_fan_out, batch)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                pass

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one when ``block``); False on "stop"."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "dead":
                raise _EngineDead(command[1])
            if kind == "abort_all":
                self._abort_all(command[1])
                continue
            if kind == "abort":
                if self._tracked.pop(command[1], None) is not None:
                    self.engine.abort_request(command[1])
                    self._count_finish("abort")
            else:
                self._add(*command[1:])

    def _add(self, request_id, index, prompt, params, stop, sink, arrival) -> None:
        try:
            self.engine.add_request(request_id, prompt, params)
        except ValueError as exc:  # RocdraftError and kin: the request is refused alone
            self._emit(sink, Rejected(index, str(exc)))
            return
        tokenizer = self.engine.tokenizer
        self._tracked[request_id] = _Tracked(
            index, sink, TextStream(tokenizer, stop) if tokenizer is not None else None, arrival)
        self._emit(sink, Accepted(index))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a failed step ends the requests in it, not the server
            failure = getattr(getattr(self.engine, "executor", None), "failure", None)
            if failure is not None:  # ... unless the engine cannot step any more
                raise _EngineDead(failure) from None
            log.exception("engine step failed")
            self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
            return
        now = time.perf_counter()
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is not None:
                self._deliver(out, tracked, now)

    def _deliver(self, out, tracked: _Tracked, now: float) -> None:
        new = list(out.new_token_ids)
        tracked.tokens.extend(new)
        tracked.prompt_tokens = tracked.prompt_tokens or len(out.prompt_token_ids)
        text = tracked.stream.push(new) if tracked.stream is not None else ""
        stopped = tracked.stream is not None and tracked.stream.stopped
        if stopped and not out.finished:
            self.engine.abort_request(out.request_id)
        reason = "stop" if stopped else out.finish_reason if out.finished else None
        if reason is not None and tracked.stream is not None:
            text += tracked.stream.finish()
        if self.metrics is not None and new:
            if tracked.first_token is None:
                self.metrics.observe_ttft(now - tracked.arrival)
            elif tracked.last_output is not None:
                self.metrics.observe_itl((now - tracked.last_output) / len(new))
        if new:
            tracked.first_token = tracked.first_token or now
            tracked.last_output = now
        if not new and reason is None:
            return
        self._emit(tracked.sink, Delta(tracked.index, text, new, reason, tracked.prompt_tokens,
                                       len(tracked.tokens), out.num_verify_steps,
                                       out.num_accepted_drafts, out.error))
        if reason is not None:
            self._tracked.pop(out.request_id, None)
            self._count_finish(reason, tracked, now, out)

    def _count_finish(self, reason: str, tracked: _Tracked | None = None,
                      now: float | None = None, out=None) -> None:
        if self.metrics is None:
            return
        self.metrics.count_finished(reason)
        if tracked is not None:
            self.metrics.observe_request(now - tracked.arrival, tracked.prompt_tokens,
                                         len(tracked.tokens), out.num_verify_steps,
                                         out.num_accepted_drafts)

    def _fail_all(self, message: str) -> None:
        for request_id, tracked in list(self._tracked.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception as exc:  # the engine is already broken; the client still hears
                log.error("abort of %s failed: %s: %s", request_id, type(exc).__name__, exc)
            self._emit(tracked.sink, Delta(tracked.index, "", [], "error",
                                           tracked.prompt_tokens, len(tracked.tokens), 0, 0,
                                           message))
            self._count_finish("error")
        self._tracked.clear()

    def _abort_all(self, reason: str) -> None:
        for request_id, tracked in list(self._tracked.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception as exc:
                log.error("abort of %s failed: %s: %s", request_id, type(exc).__name__, exc)
            log.warning("request %s aborted after %d tokens: %s", request_id,
                        len(tracked.tokens), reason)
            self._emit(tracked.sink, Delta(tracked.index, "", [], "abort",
                                           tracked.prompt_tokens, len(tracked.tokens), 0, 0,
                                           reason))
            self._count_finish("abort")
        self._tracked.clear()

    def _take_snapshot(self) -> Snapshot:
        engine = self.engine
        stats = engine.stats
        return Snapshot(engine.num_running, engine.num_waiting, engine.num_free_blocks,
                        engine.num_blocks, stats.generated_tokens, stats.num_verify_steps,
                        stats.num_accepted_drafts, tuple(stats.accepted_at_position),
                        tuple(stats.proposed_at_position), stats.num_preemptions)


class _EngineDead(Exception):
    """The engine cannot step any more (its message says why): the loop ends."""
