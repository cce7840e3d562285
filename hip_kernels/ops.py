"""The kernel ops as torch.library custom ops (namespace ``rocdraft``), with fake impls.

- ``rocdraft::write_kv``: paged KV write (mutates key_cache, value_cache);
- ``rocdraft::advance_draft_step``: in-place draft-step bookkeeping (mutates positions,
  seq_lens, clamped_positions, slot_mapping);
- ``rocdraft::prepare_padded_drafting``: fused next-token ids + padded inputs (pure).
- ``rocdraft::compact_kv``: KV compaction after tree verification (mutates key_cache,
  value_cache).

Each op validates its arguments (ValueError, see checks.py), then runs, by device:
GPU tensors -> the HIP/CUDA extension when it is built (build.load_gpu_extension());
CPU tensors -> the CPU shim extension once a caller loaded it (build.load_cpu_shim(), tests);
otherwise -> the torch references (backends.kv_cache.write_kv_reference, drafter.index_math,
backends.kv_compact.compact_kv_reference).
All paths give identical results; the fake impls only check and shape.

``write_kv_impl`` is ``rocdraft::write_kv``'s body as a plain function: eager callers
(dispatch.write_kv_hip, once per layer per step) call it directly, because the custom op's
own Python dispatch (ADInplaceOrView and autograd kernels, a dynamo-disable wrapper) cost
3.6x the body on the host (scripts/bench_write_kv_host.py).
"""
from typing import Optional

import torch
from torch import Tensor

from rocdraft.backends.kv_cache import FP8_DTYPES, NHD, SPLIT_K, LayerKVCache, write_kv_reference
from rocdraft.backends.kv_compact import compact_kv_reference
from rocdraft.drafter import index_math
from rocdraft.hip_kernels import build, checks

LAYOUT_CODES = {NHD: 0, SPLIT_K: 1}


def kernels_for(device: torch.device) -> object | None:
    """The extension ops namespace serving ``device``, or None for the torch reference path."""
    if device.type == "cuda":
        return build.load_gpu_extension()
    if device.type == "cpu":
        return build.loaded_cpu_shim()
    return None


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def write_kv_impl(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                  slot_mapping: Tensor, k_scale: Optional[Tensor], v_scale: Optional[Tensor],
                  layout: str) -> None:
    """The body of ``rocdraft::write_kv`` (checks, then the extension or the reference), as a
    plain function: eager callers (dispatch.write_kv_hip) call it directly. Through the custom
    op a call also runs torch.library's Python ADInplaceOrView and autograd kernels (version
    bumps after ``fill_defaults``, which rebuilds the schema's argument list once per
    argument) and a dynamo-disable wrapper: 140 of 195 µs per call on the CI CPU
    (scripts/bench_write_kv_host.py)."""
    checks.check_write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                          layout)
    kernels = kernels_for(key.device)
    if kernels is None:
        cache = LayerKVCache(key_cache, value_cache, layout, k_scale, v_scale)
        write_kv_reference(key, value, cache, slot_mapping)
        return
    if key_cache.dtype not in FP8_DTYPES:  # scales only apply to fp8 caches (as in the reference)
        k_scale = v_scale = None
    kernels.write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                     LAYOUT_CODES[layout], True, _stream(key.device))


@torch.library.custom_op("rocdraft::write_kv", mutates_args=("key_cache", "value_cache"))
def write_kv(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
             slot_mapping: Tensor, k_scale: Optional[Tensor], v_scale: Optional[Tensor],
             layout: str) -> None:
    """key/value [>= num_tokens, num_kv_heads, head_dim] -> cache slots ``slot_mapping``
    [num_tokens] int64 (slots < 0 skipped); fp8 caches store saturate(x / scale)."""
    write_kv_impl(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, layout)


@write_kv.register_fake
def _write_kv_fake(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                   layout) -> None:
    checks.check_write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                          layout)


@torch.library.custom_op("rocdraft::advance_draft_step",
                         mutates_args=("positions", "seq_lens", "clamped_positions",
                                       "slot_mapping"))
def advance_draft_step(positions: Tensor, seq_lens: Tensor, block_table: Tensor,
                       clamped_positions: Tensor, slot_mapping: Tensor, block_size: int,
                       max_model_len: int) -> None:
    """In place: positions += 1; seq_lens += 1; clamped_positions and slot_mapping written
    (past max_model_len: position 0, slot -1, seq_len 1). See index_math.advance_draft_step."""
    checks.check_advance_draft_step(positions, seq_lens, block_table, clamped_positions,
                                    slot_mapping, block_size, max_model_len)
    kernels = kernels_for(positions.device)
    if kernels is None:
        new_positions, clamped, slots, new_seq_lens = index_math.advance_draft_step(
            positions, seq_lens, block_table[:positions.shape[0]], block_size, max_model_len)
        positions.copy_(new_positions)
        seq_lens.copy_(new_seq_lens)
        clamped_positions.copy_(clamped)
        slot_mapping.copy_(slots)
        return
    kernels.advance_draft_step(positions, seq_lens, block_table, clamped_positions, slot_mapping,
                               block_size, max_model_len, _stream(positions.device))


@advance_draft_step.register_fake
def _advance_draft_step_fake(positions, seq_lens, block_table, clamped_positions, slot_mapping,
                             block_size, max_model_len) -> None:
    checks.check_advance_draft_step(positions, seq_lens, block_table, clamped_positions,
                                    slot_mapping, block_size, max_model_len)


@torch.library.custom_op("rocdraft::prepare_padded_drafting", mutates_args=())
def prepare_padded_drafting(sampled: Tensor, discard_request: Tensor,
                            backup_next_token_ids: Tensor, vocab_size: int,
                            query_start_loc: Tensor, num_draft_tokens: Tensor
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """index_math.prepare_next_token_ids_padded then prepare_inputs_padded, fused:
    -> (next_token_ids [batch_size] int64, valid_sampled_count [batch_size] int32,
        token_indices_to_sample [batch_size] int64, num_rejected [batch_size] int64)."""
    checks.check_prepare_padded_drafting(sampled, discard_request, backup_next_token_ids,
                                         vocab_size, query_start_loc, num_draft_tokens)
    kernels = kernels_for(sampled.device)
    if kernels is None:
        next_ids, count = index_math.prepare_next_token_ids_padded(
            sampled, discard_request, backup_next_token_ids, vocab_size)
        indices, rejected = index_math.prepare_inputs_padded(query_start_loc, num_draft_tokens,
                                                             count)
        return next_ids, count, indices, rejected
    outputs = _padded_drafting_outputs(sampled)
    kernels.prepare_padded_drafting(sampled, discard_request, backup_next_token_ids, vocab_size,
                                    query_start_loc, num_draft_tokens, *outputs,
                                    _stream(sampled.device))
    return outputs


def _padded_drafting_outputs(sampled: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    batch_size, device = sampled.shape[0], sampled.device
    return (torch.empty(batch_size, dtype=torch.int64, device=device),
            torch.empty(batch_size, dtype=torch.int32, device=device),
            torch.empty(batch_size, dtype=torch.int64, device=device),
            torch.empty(batch_size, dtype=torch.int64, device=device))


@prepare_padded_drafting.register_fake
def _prepare_padded_drafting_fake(sampled, discard_request, backup_next_token_ids, vocab_size,
                                  query_start_loc, num_draft_tokens):
    checks.check_prepare_padded_drafting(sampled, discard_request, backup_next_token_ids,
                                         vocab_size, query_start_loc, num_draft_tokens)
    return _padded_drafting_outputs(sampled)


@torch.library.custom_op("rocdraft::compact_kv", mutates_args=("key_cache", "value_cache"))
def compact_kv(key_cache: Tensor, value_cache: Tensor, block_table: Tensor, context_lens: Tensor,
               accepted_nodes: Tensor, num_accepted: Tensor, layout: str,
               block_size: int) -> None:
    """For d = 1 .. num_accepted[b]: move seq index L + 1 + accepted_nodes[b, d - 1] to L + d
    (L = context_lens[b]) in request b's blocks, raw bytes; backends.kv_compact has the
    contract. block_table [>= B, max_blocks] int32, accepted_nodes [B, D] int64."""
    checks.check_compact_kv(key_cache, value_cache, block_table, context_lens, accepted_nodes,
                            num_accepted, layout, block_size)
    kernels = kernels_for(key_cache.device)
    if kernels is None:
        compact_kv_reference(LayerKVCache(key_cache, value_cache, layout), block_table,
                             context_lens, accepted_nodes, num_accepted, block_size)
        return
    kernels.compact_kv(key_cache, value_cache, block_table, context_lens, accepted_nodes,
                       num_accepted, LAYOUT_CODES[layout], True, _stream(key_cache.device))


@compact_kv.register_fake
def _compact_kv_fake(key_cache, value_cache, block_table, context_lens, accepted_nodes,
                     num_accepted, layout, block_size) -> None:
    checks.check_compact_kv(key_cache, value_cache, block_table, context_lens, accepted_nodes,
                            num_accepted, layout, block_size)
