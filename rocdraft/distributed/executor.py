"""The executor of a tensor-parallel engine: starts ranks 1..N-1, sends them rank 0's module
calls, and shuts them down.

Two ways to start (``start_executor``):

- **spawn** (the default): rank 0 (the engine's process) starts N-1 processes with
  ``torch.multiprocessing``'s spawn context. They join a process group private to this
  engine (its own ``TCPStore`` on a free port of 127.0.0.1; two engines in one process, as
  ``rocdraft bench`` builds, never share one), wait for the ``WorkerSpec`` on a pipe while
  rank 0 loads its own shards and sizes the KV cache, load theirs, report ready (or the one
  line of their load error) on the pipe, then serve (``worker.serve_ops``).
- **torchrun**: every rank runs the same command (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR``
  / ``MASTER_PORT`` set); rank 0 runs the engine, the other ranks turn into workers inside
  the engine's constructor and exit (status 0) when rank 0 shuts down. The spec is sent once
  with ``broadcast_object_list``; rank 0's load must finish within ``timeout_s``.

Only the target's calls are sent (its forward, its logits, tree KV compaction): the EAGLE
head runs on rank 0 alone (distributed/head_tables.py), so its draft loop holds no collective
and is graph-captured as on one GPU.

Per call (``TensorParallelExecutor.call``): under one lock, broadcast the message
(``distributed.messages``), then run the local call; the workers run the same call, so every
collective inside it matches. Any failure inside a call leaves the ranks out of step: the
workers are killed and the engine refuses further calls. A dead worker is named with its exit
code (gloo notices a closed socket at once; a hung one surfaces after ``timeout_s``).
A spawned worker that dies between calls (the engine idle) is noticed at once by its process
sentinel (distributed/worker_health.py): ``failure`` names it and the failure listeners
(``add_failure_listener``; the server's engine loop) hear it without waiting for a call.

While the engine is idle a keep-alive thread sends a NOP every ``timeout_s / 4`` so the
workers' wait for the next header never reaches the collective timeout (a server may idle
for hours). ``close()`` (also at interpreter exit and when the engine is garbage collected)
sends SHUTDOWN, joins the workers for ``JOIN_TIMEOUT_S`` and kills what is left.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist

from rocdraft.distributed import messages as msg
from rocdraft.distributed.group import (BACKENDS, DEFAULT_TIMEOUT_S, HOST, ParallelGroup,
                                        default_backend, free_port, init_process_group,
                                        make_group, open_store)
from rocdraft.distributed.launch_env import torchrun_rank
from rocdraft.distributed.layers import CommCounter
from rocdraft.distributed.worker import WorkerSpec, spawned_worker, torchrun_worker
from rocdraft.distributed.worker_health import WorkerWatch, dead_ranks, kill
from rocdraft.errors import RocdraftError

log = logging.getLogger(__name__)
JOIN_TIMEOUT_S = 10.0
LOAD_TIMEOUT_S = 1800.0  # spawned workers loading their shards (no collective is waiting)


def check_backend(backend: str | None, device: str) -> str:
    """The collective backend for ``device`` (``backend`` None: nccl on a GPU, gloo on the CPU)."""
    device_type = "cpu" if device == "cpu" else "cuda"
    backend = backend or default_backend(device_type)
    if backend not in BACKENDS:
        raise RocdraftError(f"unknown distributed backend {backend!r}; valid: "
                            f"{', '.join(BACKENDS)} (nccl is RCCL on ROCm)")
    if backend == "nccl" and device_type == "cpu":
        raise RocdraftError("distributed backend nccl needs GPUs; on the CPU use gloo")
    return backend


def start_executor(tp_size: int, backend: str | None, device: str,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> "TensorParallelExecutor":
    """Start the other ranks (spawn) or join torchrun's group. On a torchrun rank > 0 this
    serves rank 0 until it shuts down and then exits the process (status 0)."""
    backend = check_backend(backend, device)
    if not timeout_s > 0:
        raise RocdraftError(f"distributed_timeout_s must be positive, got {timeout_s!r}")
    launched = torchrun_rank()
    if launched is None:
        return TensorParallelExecutor(_Ranks.spawn(tp_size, backend, device, timeout_s))
    rank, world_size = launched
    if world_size != tp_size:
        raise RocdraftError(f"tensor_parallel_size {tp_size} but torchrun started WORLD_SIZE "
                            f"{world_size} processes; pass --nproc-per-node {tp_size}")
    group = init_process_group(rank, world_size, backend, None, timeout_s)
    if rank != 0:
        torchrun_worker(group, device)
        # A clean end: skip the interpreter's teardown, where gloo's C++ threads could still
        # be destroyed joinable ("terminate called without an active exception", about 1
        # run in 16 under load) and turn a finished run into a SIGABRT.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return TensorParallelExecutor(_Ranks(group, backend, device, timeout_s, [], []))


class TensorParallelExecutor:
    """Rank 0's handle on the other ranks (see the module docstring)."""

    def __init__(self, ranks: "_Ranks") -> None:
        self._ranks = ranks
        self.group: ParallelGroup = ranks.group
        self.backend = ranks.backend
        self.counter = CommCounter()  # rank 0's all-reduce / all-gather payload bytes
        self._finalizer = weakref.finalize(self, ranks.close)

    @property
    def tp_size(self) -> int:
        return self.group.world_size

    @property
    def broadcast_bytes(self) -> int:
        """Bytes of every message rank 0 broadcast (header + ints + hidden)."""
        return self._ranks.broadcast_bytes

    @property
    def num_messages(self) -> int:
        return self._ranks.num_messages

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._ranks.procs]

    @property
    def worker_exit_codes(self) -> list[int | None]:
        """Exit code per spawned worker (None: still running); 0 after a clean close()."""
        return [p.exitcode for p in self._ranks.procs]

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer run a step (a worker died, a collective failed), or
        None while it can."""
        return self._ranks.failure

    def add_failure_listener(self, listener) -> None:
        """``listener(reason)`` is called once, from a background thread, when the ranks fail
        (at once if they already have)."""
        self._ranks.add_failure_listener(listener)

    def wrap_target(self, model: torch.nn.Module):
        from rocdraft.distributed.proxy import TargetProxy

        return TargetProxy(model, self)

    def start_workers(self, spec: WorkerSpec) -> None:
        """Send the spec; return once every worker loaded its shards (RocdraftError if one
        could not, naming the rank and its error)."""
        self._ranks.start_workers(spec)

    def call(self, op: int, local, input_ids=None, positions=None, common=None, hidden=None,
             compact=None):
        """Broadcast ``op`` with its inputs, then run ``local()`` -> its result."""
        return self._ranks.call(op, local, input_ids, positions, common, hidden, compact)

    def close(self) -> None:
        self._finalizer()


class _Ranks:
    """The state the finalizer closes (it must not hold the executor)."""

    def __init__(self, group: ParallelGroup, backend: str, device: str, timeout_s: float,
                 procs: list, conns: list, store=None) -> None:
        self.group, self.backend, self.timeout_s = group, backend, timeout_s
        self.device = torch.device("cpu") if device == "cpu" else torch.device(
            "cuda", torch.cuda.current_device())
        self.procs, self.conns, self.store = procs, conns, store
        self.lock = threading.Lock()
        self.broadcast_bytes = self.num_messages = 0
        self.failure: str | None = None  # set once the ranks are out of step
        self.closed = False  # no call runs any more (closed, or aborted after a failure)
        self.started = False  # the workers got their spec and serve messages
        self.last_call = time.monotonic()
        self.stop = threading.Event()
        self.keepalive: threading.Thread | None = None
        self.watch = WorkerWatch(procs, self._worker_died)
        self.listeners: list = []

    @staticmethod
    def spawn(tp_size: int, backend: str, device: str, timeout_s: float) -> "_Ranks":
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        port = free_port(HOST)
        procs, conns = [], []
        try:
            for rank in range(1, tp_size):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=spawned_worker, name=f"rocdraft-tp-rank{rank}",
                                args=(rank, tp_size, backend, port, timeout_s, child),
                                daemon=True)
                p.start()
                child.close()
                procs.append(p)
                conns.append(parent)
            store = open_store(0, tp_size, port, timeout_s)
            ranks = _Ranks(None, backend, device, timeout_s, procs, conns, store)
        except BaseException:
            kill(procs)
            raise
        ranks.wait_all("connect to the rendezvous", timeout_s)
        try:
            ranks.group = make_group(store, 0, tp_size, backend, timeout_s)
        except BaseException:
            ranks._abort()
            raise
        return ranks

    def start_workers(self, spec: WorkerSpec) -> None:
        if not self.procs:  # torchrun: the workers wait in a collective
            self._guarded(lambda: dist.broadcast_object_list([spec], group=self.group.group,
                                                             group_src=0))
            self._guarded(lambda: dist.barrier(group=self.group.group))
        else:
            for conn in self.conns:
                conn.send(spec)
            self.wait_all("load", LOAD_TIMEOUT_S)
        self.started = True
        self.watch.start()
        self.keepalive = threading.Thread(target=self._keep_alive, name="rocdraft-tp-keepalive",
                                          daemon=True)
        self.keepalive.start()

    def wait_all(self, stage: str, timeout_s: float) -> None:
        """Wait until every spawned worker reports ``stage`` done on its pipe (None) -> or
        abort them and raise, naming the rank and its error, death or lateness."""
        pending = dict(enumerate(self.conns, 1))
        deadline = time.monotonic() + timeout_s
        while pending:
            for rank, conn in list(pending.items()):
                if conn.poll(0.1):
                    try:
                        error = conn.recv()
                    except EOFError:
                        error = "exited before reporting"
                    if error is not None:
                        self._abort()
                        raise RocdraftError(f"tensor-parallel worker rank {rank} could not "
                                            f"{stage}: {error}")
                    del pending[rank]
            dead = dead_ranks(self.procs)
            if dead:
                self._abort()
                raise RocdraftError(f"tensor-parallel worker(s) died before they could "
                                    f"{stage}: {dead}")
            if time.monotonic() > deadline:
                self._abort()
                raise RocdraftError(f"tensor-parallel workers {sorted(pending)} did not "
                                    f"{stage} within {timeout_s:.0f} s")

    def call(self, op, local, input_ids, positions, common, hidden, compact=None):
        with self.lock:
            if self.closed or self.failure:
                if not self.closed:  # the watch saw a death while a call held the lock
                    self._abort()
                raise RocdraftError(f"the tensor-parallel engine is shut down"
                                    f"{': ' + self.failure if self.failure else ''}; build a "
                                    f"new LLM")
            try:
                self._send(op, input_ids, positions, common, hidden, compact)
                result = local()
            except RuntimeError as e:  # torch.distributed errors (DistBackendError, ...)
                raise self._failed(e) from None
            except BaseException:  # Ctrl-C or a bug mid-call: the ranks are out of step
                self.failure = "interrupted during a tensor-parallel call"
                self._abort()
                raise
            self.last_call = time.monotonic()
            return result

    def _guarded(self, fn) -> None:
        try:
            fn()
        except RuntimeError as e:
            raise self._failed(e) from None

    def _send(self, op, input_ids=None, positions=None, common=None, hidden=None,
              compact=None) -> None:
        header, ints, hidden = msg.encode(op, input_ids, positions, common, hidden, compact)
        for tensor in (header.to(self.device), ints, hidden):
            if tensor is not None:
                dist.broadcast(tensor, group=self.group.group, group_src=0)
                self.broadcast_bytes += tensor.numel() * tensor.element_size()
        self.num_messages += 1

    def _failed(self, error: RuntimeError) -> RocdraftError:
        """Kill the ranks; -> the error naming the dead ones (exit codes) or the failure."""
        deadline = time.monotonic() + 2.0  # a killed peer is reaped within moments
        dead = dead_ranks(self.procs)
        while not dead and self.procs and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = dead_ranks(self.procs)
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        self.failure = (f"tensor-parallel worker(s) died: {dead}" if dead else
                        f"a collective failed ({first_line})")
        self._abort()
        self._notify()
        return RocdraftError(f"{self.failure}; the workers are shut down "
                             f"(collective timeout {self.timeout_s:.0f} s)")

    def add_failure_listener(self, listener) -> None:
        with self.lock:
            failed = self.failure is not None
            if not failed:
                self.listeners.append(listener)
        if failed:
            listener(self.failure)

    def _notify(self) -> None:
        listeners, self.listeners = self.listeners, []
        for listener in listeners:
            listener(self.failure)

    def _worker_died(self, reason: str) -> None:
        """The watch thread: a worker exited unasked. Mark the ranks failed at once (a call
        in flight fails by itself: gloo sees the closed socket), stop the other workers."""
        if self.failure is None:
            self.failure = reason
        if self.lock.acquire(blocking=False):  # else the call in flight aborts by itself
            try:
                if not self.closed:
                    self._abort()
            finally:
                self.lock.release()
        self._notify()

    def _keep_alive(self) -> None:
        interval = self.timeout_s / 4
        while not self.stop.wait(interval / 2):
            if time.monotonic() - self.last_call < interval or not self.lock.acquire(False):
                continue
            try:
                if not (self.closed or self.failure):
                    self._send(msg.NOP)
                    self.last_call = time.monotonic()
            except RuntimeError as e:
                self.failure = f"keep-alive failed ({str(e).splitlines()[0][:200]})"
            finally:
                self.lock.release()

    def close(self) -> None:
        """SHUTDOWN, join, kill leftovers; idempotent."""
        self.stop.set()
        if self.keepalive is not None and self.keepalive is not threading.current_thread():
            self.keepalive.join(5)
        with self.lock:
            if self.closed:
                return
            told = False
            if self.started and not self.failure:
                try:
                    self._send(msg.SHUTDOWN)
                    told = True
                except RuntimeError:
                    pass
            self._abort(join_first=told)

    def _abort(self, join_first: bool = False) -> None:
        """Stop every worker (joined for JOIN_TIMEOUT_S when they were told to stop), free the
        pipes and the group."""
        self.closed = True
        self.watch.stop()
        if join_first:
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            for p in self.procs:
                p.join(max(deadline - time.monotonic(), 0.0))
        kill(self.procs)
        for conn in self.conns:
            conn.close()
        self.conns = []
        if not self.procs and dist.is_initialized():  # torchrun: the default group
            if join_first:  # the workers got SHUTDOWN: meet them before tearing gloo down
                try:
                    dist.barrier(group=self.group.group)
                except RuntimeError:
                    pass
            dist.destroy_process_group()
        self.store = None
