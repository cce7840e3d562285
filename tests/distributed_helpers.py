"""Test utilities for rocdraft.distributed: real multi-process runs over gloo, and the
checkpoint variants tensor parallelism must read (Mistral-style config, sharded index).

``run_ranks(worker, world_size, *args)`` spawns ``world_size`` processes (torch.multiprocessing
spawn context), each joining a gloo group on a free port and calling
``worker(group, *args)``; it joins them with a timeout, kills them if they hang, and raises
unless every exit code is 0. Workers must be module-level functions (spawn pickles them by
name) and return results through files (e.g. ``torch.save`` under a tmp dir).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed
import torch.multiprocessing as mp

RANK_TIMEOUT_S = 90.0
COLLECTIVE_TIMEOUT_S = 60.0


def _entry(worker, rank: int, world_size: int, port: int, args: tuple) -> None:
    torch.set_num_threads(1)
    import rocdraft.backends  # noqa: F401  (registers every backend in the child)
    from rocdraft.distributed.group import destroy_process_group, init_process_group

    group = init_process_group(rank, world_size, "gloo", f"tcp://127.0.0.1:{port}",
                               COLLECTIVE_TIMEOUT_S)
    try:
        worker(group, *args)
        # Every rank reaches this point before any tears gloo down: destroying the group while
        # a peer still has a collective (or the store) in flight can abort the process
        # ("terminate called without an active exception", exit -6) after the work succeeded.
        torch.distributed.barrier()
    finally:
        destroy_process_group()
    # A clean end skips the interpreter's teardown, where gloo's C++ threads could still be
    # destroyed joinable and abort the finished rank (2 of 2,400 tests in one full run on
    # this 2-core VM; rocdraft/distributed/executor.py ends its torchrun workers so too).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(worker, world_size: int, *args, timeout_s: float = RANK_TIMEOUT_S) -> None:
    from rocdraft.distributed.group import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(worker, rank, world_size, port, args))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.0))
    finally:
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    if hung:
        raise AssertionError(f"ranks {hung} of {world_size} still ran after {timeout_s} s")
    codes = [p.exitcode for p in procs]
    if any(codes):
        raise AssertionError(f"rank exit codes {codes} (see the captured stderr)")


def make_mistral(directory: Path) -> Path:
    """A tiny llama checkpoint relabelled as MistralForCausalLM (same keys; sliding window)."""
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral",
                  sliding_window=4096)
    config_file.write_text(json.dumps(config, indent=2))
    return directory


def make_sharded(directory: Path, num_files: int = 3) -> Path:
    """Rewrite ``model.safetensors`` as ``num_files`` shards + ``model.safetensors.index.json``."""
    from safetensors.torch import load_file, save_file

    single = directory / "model.safetensors"
    state = load_file(str(single))
    names = sorted(state)
    weight_map = {}
    for i in range(num_files):
        file = f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
        part = {n: state[n].contiguous() for n in names[i::num_files]}
        save_file(part, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    single.unlink()
    return directory


def live_children(pid: int) -> list[int]:
    """Pids of the live (not zombie) processes whose parent is ``pid``, read from /proc
    (multiprocessing only knows its own children), except multiprocessing's resource tracker
    (started with the first spawn, kept)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines()
                          if ":\t" in line)
            cmdline = (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid) \
                and not fields.get("State", "").startswith("Z") \
                and b"resource_tracker" not in cmdline:
            found.append(int(status.parent.name))
    return found
