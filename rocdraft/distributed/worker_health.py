"""Whether the spawned tensor-parallel workers are alive, noticed the moment one dies.

A worker's death surfaces in a collective only when rank 0 next calls one; an idle server
would go on answering /health 200 with a dead worker behind it. ``WorkerWatch`` waits on
every worker's process sentinel (a file descriptor that turns readable when the process
exits, ``multiprocessing.connection.wait``) in a thread of its own, as vLLM's engine-core
monitor does, and calls ``on_death(reason)`` once, at once, also while nothing runs::

    worker rank 1 SIGKILLed --sentinel readable--> watch thread --on_death("tensor-parallel
    worker(s) died: rank 1 exit code -9 (SIGKILL)")--> executor marks itself failed

``stop()`` ends the watch without a call (a clean close, where the workers exit on purpose).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from multiprocessing.connection import wait

log = logging.getLogger(__name__)


def dead_ranks(procs: list) -> str:
    """The spawned workers (rank = index + 1) that exited, with their exit codes; "" if none.
    Example: "rank 1 exit code -9 (SIGKILL)"."""
    dead = [(rank, p.exitcode) for rank, p in enumerate(procs, 1) if p.exitcode is not None]
    return ", ".join(f"rank {rank} exit code {code}{signal_name(code)}" for rank, code in dead)


def signal_name(code: int | None) -> str:
    """" (SIGKILL)" for exit code -9 (killed by a signal); "" for a normal exit code."""
    if code is None or code >= 0:
        return ""
    try:
        return f" ({signal.Signals(-code).name})"
    except ValueError:
        return ""


def kill(procs: list) -> None:
    """SIGKILL the workers still running and reap them all."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)


class WorkerWatch:
    """A daemon thread that waits on ``procs``' sentinels and calls ``on_death(reason)`` once
    when any of them exits before ``stop()``."""

    def __init__(self, procs: list, on_death) -> None:
        self.procs = list(procs)
        self.on_death = on_death
        self._wake_r, self._wake_w = os.pipe()  # stop(): readable, the thread returns
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="rocdraft-tp-watch",
                                        daemon=True)

    def start(self) -> None:
        if self.procs:
            self._thread.start()

    def stop(self) -> None:
        """End the watch (idempotent); a worker exiting afterwards is not a death."""
        if self._stopped:
            return
        self._stopped = True
        os.write(self._wake_w, b"x")
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        ready = wait([p.sentinel for p in self.procs] + [self._wake_r])
        if self._wake_r in ready or self._stopped:
            return
        for p in self.procs:  # reap the dead one(s) so their exit codes are known
            if p.sentinel in ready:
                p.join(1)
        reason = f"tensor-parallel worker(s) died: {dead_ranks(self.procs)}"
        log.error("%s", reason)
        try:
            self.on_death(reason)
        except Exception:  # a failing callback must not pass silently either
            log.exception("the worker-death callback failed")
