"""rocdraft.distributed.group: argument refusals, a rendezvous port in use, a peer that never
joins (raises within the timeout), and a real 2-process gloo group that exits cleanly."""
from __future__ import annotations

import multiprocessing
import socket
import time

import pytest
import torch
import torch.distributed as dist

from distributed_helpers import run_ranks
from rocdraft.distributed.group import (ParallelGroup, default_backend, free_port,
                                        init_process_group)
from rocdraft.errors import RocdraftError


@pytest.mark.parametrize("kwargs,message", [
    (dict(rank=0, world_size=0), r"world_size must be an integer >= 1, got 0"),
    (dict(rank=2, world_size=2), r"rank must be in \[0, 2\), got 2"),
    (dict(rank=0, world_size=2, backend="mpi"), r"unknown distributed backend 'mpi'; valid: "
                                                r"gloo, nccl"),
    (dict(rank=0, world_size=2, backend="gloo", timeout_s=0), r"timeout_s must be positive"),
])
def test_bad_arguments_refused(kwargs, message):
    with pytest.raises(RocdraftError, match=message):
        init_process_group(init_method="tcp://127.0.0.1:1", **kwargs)
    assert not dist.is_initialized()


def test_parallel_group_is_validated():
    with pytest.raises(RocdraftError, match="world_size must be an integer >= 1"):
        ParallelGroup(0, 0)
    with pytest.raises(RocdraftError, match=r"rank must be in \[0, 4\), got -1"):
        ParallelGroup(-1, 4)
    assert not ParallelGroup.single().is_parallel and ParallelGroup(1, 2).is_parallel


def test_default_backend():
    assert default_backend("cpu") == "gloo" and default_backend("cuda") == "nccl"


def test_rendezvous_port_in_use_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RocdraftError, match=rf"rendezvous address tcp://127.0.0.1:{port} "
                                                rf"is already in use"):
            init_process_group(0, 2, "gloo", f"tcp://127.0.0.1:{port}", timeout_s=5)
    assert not dist.is_initialized()


def test_missing_peer_raises_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        init_process_group(0, 2, "gloo", f"tcp://127.0.0.1:{free_port()}", timeout_s=1)
    assert time.monotonic() - start < 20
    assert not dist.is_initialized()


def _sum_worker(group: ParallelGroup, out_dir: str) -> None:
    x = torch.tensor([float(group.rank + 1)])
    dist.all_reduce(x, group=group.group)
    torch.save((group.rank, group.world_size, float(x)), f"{out_dir}/rank{group.rank}.pt")


def test_two_ranks_join_reduce_and_exit_cleanly(tmp_path):
    run_ranks(_sum_worker, 2, str(tmp_path))
    assert multiprocessing.active_children() == []
    assert [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)] == [(0, 2, 3.0), (1, 2, 3.0)]
