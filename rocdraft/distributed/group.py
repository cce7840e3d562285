"""The process group one rank runs in, passed explicitly (no global parallel state).

``init_process_group`` wraps ``torch.distributed.init_process_group`` with the checks users
need in one line: ``world_size`` < 1, a rank outside ``[0, world_size)``, an unknown backend,
and a rendezvous port that is already in use (torch reports ``EADDRINUSE`` from rank 0's
TCP store; other ranks would only time out). Backend by default: ``nccl`` where a GPU is
visible (RCCL on ROCm answers to the same name), ``gloo`` on the CPU.

A ``ParallelGroup`` of world size 1 needs no ``torch.distributed`` at all
(``ParallelGroup.single()``): collectives on it are no-ops, so the sharded model of TP 1 is the
plain model.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rocdraft.errors import RocdraftError

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 60.0
HOST = "127.0.0.1"  # private groups rendezvous on the loopback interface


@dataclass(frozen=True)
class ParallelGroup:
    """This rank's place in a tensor-parallel group; ``group`` None means the default group
    (or no torch.distributed at all when ``world_size`` is 1)."""

    rank: int
    world_size: int
    group: Any = None  # a torch.distributed ProcessGroup, or None

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise RocdraftError(f"world_size must be an integer >= 1, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise RocdraftError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")

    @staticmethod
    def single() -> "ParallelGroup":
        return ParallelGroup(0, 1)

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1


def default_backend(device_type: str | None = None) -> str:
    """``nccl`` for a cuda device (ROCm included), else ``gloo``; None: whether a GPU is visible."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return "nccl" if device_type == "cuda" else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it; another process may still
    take it before the rendezvous binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_process_group(rank: int, world_size: int, backend: str | None = None,
                       init_method: str | None = None,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelGroup:
    """Join the default process group (``init_method`` e.g. ``tcp://127.0.0.1:29500``; None:
    torch's ``env://``, as ``torchrun`` sets it) and return this rank's ``ParallelGroup``.
    ``timeout_s`` bounds the rendezvous and every later collective, so a dead peer raises
    instead of hanging."""
    if not isinstance(world_size, int) or world_size < 1:
        raise RocdraftError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise RocdraftError(f"rank must be in [0, {world_size}), got {rank!r}")
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise RocdraftError(f"unknown distributed backend {backend!r}; valid: "
                            f"{', '.join(BACKENDS)} (nccl is RCCL on ROCm)")
    if not timeout_s > 0:
        raise RocdraftError(f"timeout_s must be positive, got {timeout_s!r}")
    try:
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:  # DistNetworkError (a RuntimeError) from the TCP store
        if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
            raise RocdraftError(f"rendezvous address {init_method or 'env://'} is already in "
                                f"use (rank {rank} could not listen on it); pick a free port "
                                f"(MASTER_PORT or the port in init_method)") from None
        raise
    return ParallelGroup(rank, world_size, dist.group.WORLD)


def destroy_process_group() -> None:
    """Leave the default process group if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def open_store(rank: int, world_size: int, port: int, timeout_s: float):
    """The rendezvous store of a private group: rank 0 listens on 127.0.0.1:port (without
    waiting for the others), the others connect."""
    try:
        return dist.TCPStore(HOST, port, world_size, is_master=rank == 0,
                             timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except RuntimeError as e:
        if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
            raise RocdraftError(f"rendezvous port {HOST}:{port} is already in use; try again "
                                f"(the port is picked free but was taken)") from None
        raise


def make_group(store, rank: int, world_size: int, backend: str, timeout_s: float
               ) -> ParallelGroup:
    """A process group of its own over ``store`` (not torch's default group, so two engines
    in one process each have theirs)."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
    return ParallelGroup(rank, world_size, pg)
