"""The engine's side of a tree step, between the target forward and the next tree's drafting:

    target logits [B, N+1, V] --tree_verify--> accepted path, sampled (chain format)
    compact_target_kv: the accepted nodes' K/V move to L+1 .. L+a in every target layer
    head_inputs_after_tree: the step's tokens reordered root + accepted path first, so the
        head's first forward (chain code, padded or unpadded) sees exactly the accepted text

The draft head's cache needs no compaction: its first forward rewrites positions L .. L+a from
the target's hidden states every step (the tree's fed nodes sit past them and are overwritten
later). Sync-free; the only host read of a step stays the engine's ``sampled.tolist()``.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from rocdraft.backends.kv_compact_dispatch import compact_kv_layers
from rocdraft.backends.kv_cache import LayerKVCache
from rocdraft.drafter.tree_index import accepted_first_order
from rocdraft.sample.sampler import SamplingTensors
from rocdraft.core.step_batch import StepBatch
from rocdraft.sample.tree_sampler import TreeVerifyResult, tree_verify


def verify_tree_step(logits: torch.Tensor, batch: StepBatch, sampling: SamplingTensors,
                     max_depth: int) -> TreeVerifyResult:
    """logits [B, N + 1, V] (row 0 at the root, row i + 1 at node i), the step's batch (with
    ``draft_parents``), max_depth (the tree's depth) -> TreeVerifyResult."""
    return tree_verify(logits, batch.draft_token_ids, batch.draft_parents,
                       batch.num_draft_tokens, sampling, max_depth)


def context_lens(batch: StepBatch) -> torch.Tensor:
    """[B] int32: tokens each request had cached before this step (L)."""
    common = batch.common
    query_lens = common.query_start_loc[1:] - common.query_start_loc[:-1]
    return (common.seq_lens - query_lens).to(torch.int32)


def compact_target_kv(kv_caches: list[LayerKVCache], batch: StepBatch,
                      result: TreeVerifyResult, block_size: int, executor=None) -> None:
    """Move each request's accepted nodes from L + 1 + node to L + depth in every layer
    (backends/kv_compact.py: the torch reference on the CPU, moves planned once for all
    layers; HIP or Triton per layer on a GPU). With a tensor-parallel ``executor`` every
    rank compacts its own KV heads the same way (one TARGET_COMPACT message)."""
    args = (batch.common.block_table, context_lens(batch), result.accepted_nodes,
            result.num_accepted)
    if executor is None:
        compact_kv_layers(kv_caches, *args, block_size)
        return
    from rocdraft.distributed.messages import TARGET_COMPACT

    executor.call(TARGET_COMPACT, lambda: compact_kv_layers(kv_caches, *args, block_size),
                  compact=args)


def head_inputs_after_tree(batch: StepBatch, hidden, result: TreeVerifyResult
                           ) -> tuple[StepBatch, object]:
    """The step's batch and target hidden states reordered for the head's first forward:
    in each request, the root, then the accepted nodes by depth, then the rejected ones
    (``accepted_first_order``). Slots stay in sequence order, so the accepted path is written
    to L .. L + a of the head's cache, and the tree mask is dropped (the path is a chain).
    hidden: [T, H] or a tuple of aux [T, H] -> (batch, hidden) in the new order."""
    num_tokens = batch.input_ids.shape[0]
    order = accepted_first_order(batch.common.query_start_loc, result.accepted_nodes,
                                 result.num_accepted, num_tokens)
    reordered = replace(batch, input_ids=batch.input_ids[order],
                        positions=batch.positions[..., order],
                        common=batch.common.with_updates(spec_mask=None))
    if isinstance(hidden, tuple):
        return reordered, tuple(h[order] for h in hidden)
    return reordered, hidden[order]
