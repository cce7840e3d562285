"""The worker loop of ranks 1..N-1: receive a message, run the same module call on this rank's
shards and KV caches, repeat until SHUTDOWN.

A worker holds what rank 0 holds of the target: its shard (``load_tp_target``), the paged KV
cache of its own heads (``WorkerSpec.num_blocks`` blocks, the same block tables as rank 0) and
the attention backend's metadata builder. It holds no EAGLE head and no draft cache: the head
runs on rank 0 alone (distributed/head_tables.py). Per message (``distributed.messages``)::

    TARGET_FORWARD  target(input_ids, positions, kv_caches, build(common))   outputs dropped
    TARGET_LOGITS   target.compute_logits(hidden)                            (the gather)
    TARGET_COMPACT  compact_kv_layers(...)        (a tree step's accepted path, this rank's KV)
    NOP             nothing (rank 0's keep-alive while it is idle)

``spawned_worker`` and ``torchrun_worker`` are the entry points of a worker process (spawned
by rank 0's executor, or started by torchrun). Outputs are dropped: rank 0 samples alone.
The worker ignores SIGINT (Ctrl-C reaches the whole process group; rank 0 decides and sends
SHUTDOWN) and exits when rank 0 dies (its next collective fails as the sockets close).
"""
from __future__ import annotations

import os
import signal
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rocdraft.distributed import messages as msg
from rocdraft.distributed.group import ParallelGroup, make_group, open_store


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to mirror rank 0, sent once at start (never per step)."""

    target: str
    dtype: str  # "float32" | "bfloat16" | "float16"
    device: str  # "cpu" | "cuda"
    attention_backend: str
    block_size: int
    num_blocks: int
    num_threads: int


@dataclass
class WorkerState:
    target: torch.nn.Module
    kv_caches: list
    builder: object
    device: torch.device


def worker_device(spec: WorkerSpec, local_rank: int) -> torch.device:
    if spec.device == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def load_worker(spec: WorkerSpec, group: ParallelGroup, device: torch.device) -> WorkerState:
    """This rank's shards and KV cache (no collectives: loading is local)."""
    from rocdraft.backends.kv_cache import allocate_kv_cache
    from rocdraft.backends.registry import get_backend
    from rocdraft.distributed.tp_model import load_tp_target

    dtype = msg.DTYPES[("float32", "bfloat16", "float16").index(spec.dtype)]
    backend = get_backend(spec.attention_backend)
    target = load_tp_target(spec.target, group, dtype, device, backend)
    caches = allocate_kv_cache(*_cache_shape(target, spec), dtype, device)
    return WorkerState(target, caches, backend.builder_cls(device), device)


def _cache_shape(model, spec: WorkerSpec) -> tuple[int, int, int, int, int]:
    num_layers, num_kv_heads, head_dim = model.kv_cache_spec()
    return num_layers, spec.num_blocks, spec.block_size, num_kv_heads, head_dim


@torch.no_grad()
def serve_ops(state: WorkerState, group: ParallelGroup) -> int:
    """Run rank 0's module calls until SHUTDOWN -> the number of messages served."""
    header = torch.empty(msg.HEADER_SIZE, dtype=torch.int64, device=state.device)
    served = 0
    while True:
        _recv(header, group)
        fields = header.tolist()
        op = fields[msg.OP]
        if op == msg.SHUTDOWN:
            return served
        served += 1
        if op == msg.NOP:
            continue
        ints = None
        numel = msg.ints_numel(fields)
        if numel:
            ints = _recv(torch.empty(numel, dtype=torch.int64, device=state.device), group)
        hidden = None
        shape = msg.hidden_shape(fields)
        if shape is not None:
            hidden = _recv(torch.empty(shape[0], dtype=shape[1], device=state.device), group)
        _run(op, fields, ints, hidden, state)


def _run(op: int, fields: list[int], ints, hidden, state: WorkerState) -> None:
    if op == msg.TARGET_LOGITS:
        state.target.compute_logits(hidden)
    elif op == msg.TARGET_COMPACT:
        from rocdraft.backends.kv_compact_dispatch import compact_kv_layers

        compact_kv_layers(state.kv_caches, *msg.decode_compact(fields, ints),
                          state.kv_caches[0].block_size)
    elif op == msg.TARGET_FORWARD:
        input_ids, positions, common = msg.decode_tokens(fields, ints)
        state.target(input_ids, positions, state.kv_caches, state.builder.build(common))
    else:
        raise RuntimeError(f"tensor-parallel worker got unknown op code {op}")


def _recv(tensor: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    dist.broadcast(tensor, group=group.group, group_src=0)
    return tensor


def spawned_worker(rank: int, world_size: int, backend: str, port: int, timeout_s: float,
                    conn) -> None:
    """Entry point of a spawned rank (module level: spawn pickles it by name)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import rocdraft.backends  # noqa: F401  (registers every backend in this process)

    store = open_store(rank, world_size, port, timeout_s)
    conn.send(None)  # connected: rank 0 now builds the group with us
    group = make_group(store, rank, world_size, backend, timeout_s)
    spec = wait_spec(conn)
    if spec is None:
        return
    torch.set_num_threads(spec.num_threads)
    try:
        state = load_worker(spec, group, worker_device(spec, rank))
    except Exception as e:  # reported to rank 0 in one line, which raises it
        conn.send(f"{type(e).__name__}: {e}".splitlines()[0])
        raise SystemExit(1) from None
    conn.send(None)
    try:
        serve_ops(state, group)
    except RuntimeError:  # rank 0 died or killed a peer: its sockets closed
        traceback.print_exc()
        raise SystemExit(1) from None


def wait_spec(conn) -> WorkerSpec | None:
    """The spec from rank 0, or None when rank 0 went away first."""
    parent = os.getppid()
    while not conn.poll(0.5):
        if os.getppid() != parent:
            return None
    try:
        return conn.recv()
    except EOFError:
        return None


def torchrun_worker(group: ParallelGroup, device: str) -> None:
    import rocdraft.backends  # noqa: F401

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    box = [None]
    dist.broadcast_object_list(box, group=group.group, group_src=0)
    spec: WorkerSpec = box[0]
    local_rank = int(os.environ.get("LOCAL_RANK", group.rank))
    state = load_worker(spec, group, worker_device(spec, local_rank))
    dist.barrier(group=group.group)
    try:
        serve_ops(state, group)
        # SHUTDOWN: rank 0 waits here too, so neither side tears its gloo pairs down while
        # the other may still be reading (a SIGABRT at exit otherwise).
        dist.barrier(group=group.group)
    finally:
        dist.destroy_process_group()
