"""Where a KV compaction runs (the contract is backends/kv_compact.py's): the torch
reference on the CPU, moves planned once for all layers; on a GPU the HIP/CUDA extension when
it is built, else the Triton kernel, per layer. Kept apart from the reference so that the
kernels' own modules can import the reference's checks without a circle through this
dispatcher."""
from __future__ import annotations

import torch

from rocdraft.backends.kv_cache import LayerKVCache
from rocdraft.backends.kv_compact import (apply_kv_moves, check_compact_kv,
                                          compact_kv_reference, plan_kv_moves)

IMPLEMENTATIONS = ("hip", "triton", "reference")


def compact_kv_layers(caches: list[LayerKVCache], block_table: torch.Tensor,
                      context_lens: torch.Tensor, accepted_nodes: torch.Tensor,
                      num_accepted: torch.Tensor, block_size: int,
                      implementation: str | None = None) -> None:
    """``compact_kv`` over every layer of one cache group (same blocks and block size): the
    reference plans the moves once and applies them per layer; the kernels run per layer."""
    if not caches:
        return
    implementation = _pick(caches[0], implementation)
    if implementation != "reference":
        for cache in caches:
            compact_kv(cache, block_table, context_lens, accepted_nodes, num_accepted,
                       block_size, implementation)
        return
    for cache in caches:
        check_compact_kv(cache.key, cache.value, cache.layout, block_table, context_lens,
                         accepted_nodes, num_accepted, block_size)
    if accepted_nodes.numel() == 0:
        return
    plan = plan_kv_moves(block_table, context_lens, accepted_nodes, num_accepted, block_size,
                         caches[0].num_blocks)
    for cache in caches:
        apply_kv_moves(cache, plan, block_size)


def _pick(cache: LayerKVCache, implementation: str | None) -> str:
    """The implementation ``compact_kv`` runs (its docstring's rule)."""
    if implementation is None:
        implementation = "reference"
        if cache.key.is_cuda:
            from rocdraft.hip_kernels.dispatch import hip_available

            implementation = "hip" if hip_available() else "triton"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown compact_kv implementation {implementation!r}; valid: "
                         f"{IMPLEMENTATIONS}")
    return implementation


def compact_kv(cache: LayerKVCache, block_table: torch.Tensor, context_lens: torch.Tensor,
               accepted_nodes: torch.Tensor, num_accepted: torch.Tensor, block_size: int,
               implementation: str | None = None) -> None:
    """Compact ``cache`` in place (module docstring). ``implementation`` None picks: on a GPU
    the HIP/CUDA extension when it is built, else the Triton kernel; on the CPU the torch
    reference. "hip" (through the CPU shim on CPU tensors, once loaded), "triton" or
    "reference" force one. All give identical bytes."""
    implementation = _pick(cache, implementation)
    if implementation == "reference":
        compact_kv_reference(cache, block_table, context_lens, accepted_nodes, num_accepted,
                             block_size)
    elif implementation == "triton":
        from rocdraft.backends.triton_kernels.kv_compact import compact_kv_triton

        compact_kv_triton(cache, block_table, context_lens, accepted_nodes, num_accepted,
                          block_size)
    else:
        from rocdraft.hip_kernels.dispatch import compact_kv_hip

        compact_kv_hip(cache, block_table, context_lens, accepted_nodes, num_accepted,
                       block_size)
