"""The worker watch (rocdraft/distributed/worker_health.py) over real spawned processes: a
SIGKILLed worker is reported at once, named with its exit code; a stopped watch reports
nothing. The watch inside a real TP engine and server: test_distributed_engine.py and
test_serve_live.py."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

from rocdraft.distributed.worker_health import WorkerWatch, dead_ranks, kill, signal_name


def _sleep_forever() -> None:
    time.sleep(600)


def spawn(n: int) -> list:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_sleep_forever, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    return procs


def test_a_killed_worker_is_reported_at_once_with_its_exit_code():
    procs = spawn(2)
    heard, done = [], threading.Event()
    watch = WorkerWatch(procs, lambda reason: (heard.append(reason), done.set()))
    watch.start()
    try:
        assert not done.wait(0.3)  # alive workers: nothing
        start = time.monotonic()
        os.kill(procs[1].pid, signal.SIGKILL)
        assert done.wait(5)
        assert time.monotonic() - start < 1.0
        assert heard == ["tensor-parallel worker(s) died: rank 2 exit code -9 (SIGKILL)"]
    finally:
        watch.stop()
        kill(procs)
    assert not any(p.is_alive() for p in procs)


def test_a_stopped_watch_reports_nothing():
    procs = spawn(1)
    heard = []
    watch = WorkerWatch(procs, heard.append)
    watch.start()
    watch.stop()
    watch.stop()  # idempotent
    kill(procs)
    time.sleep(0.2)
    assert heard == []


def test_dead_ranks_and_signal_names():
    class Proc:
        def __init__(self, exitcode):
            self.exitcode = exitcode

    assert dead_ranks([Proc(None), Proc(1), Proc(-15)]) == \
        "rank 2 exit code 1, rank 3 exit code -15 (SIGTERM)"
    assert dead_ranks([Proc(None)]) == ""
    assert (signal_name(0), signal_name(None), signal_name(-9)) == ("", "", " (SIGKILL)")
