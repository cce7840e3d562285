"""What the drafter and the backends call: the kernel ops behind a small, typed API.

Every function works on any device: on a GPU with the extension built it runs the HIP (or
CUDA) kernel, elsewhere the torch reference (see ops.py); results are identical. All are
sync-free and allocate nothing except ``prepare_padded_drafting_hip``'s four outputs, so they
are safe inside graph capture once the extension is loaded (call ``hip_available()`` before
capturing: the first call may build the extension).

A launch that finds no kernel binary for the GPU (an extension built for other archs: "invalid
device function" / "no kernel image") does not raise: the extension is dropped for the rest of
the process with a logged reason (``hip_unavailable_reason()``), the call is redone by the
torch reference, and ``hip_available()`` is False from then on, so callers take their Triton or
torch paths.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from rocdraft.backends.kv_cache import LayerKVCache
from rocdraft.hip_kernels import build, ops

log = logging.getLogger(__name__)
NO_BINARY_MARKERS = ("invalid device function", "no kernel image")
Result = TypeVar("Result")


def hip_available() -> bool:
    """True when the GPU extension is loaded (building it on first call; False on CPU torch,
    with ``ROCDRAFT_HIP_KERNELS=0``, or when the build failed)."""
    return build.load_gpu_extension() is not None


def hip_unavailable_reason() -> str | None:
    """Why ``hip_available()`` is False, or None when it is True (or not yet tried)."""
    return build.gpu_unavailable_reason()


def is_missing_binary(error: BaseException) -> bool:
    """True when ``error`` says the GPU has no code object in the extension."""
    message = str(error).lower()
    return any(marker in message for marker in NO_BINARY_MARKERS)


def _falling_back(launch: Callable[[], Result]) -> Result:
    """``launch()``; on a missing-binary error, disable the extension (logged once) and redo
    it, which then runs the torch reference (a launch that failed wrote nothing)."""
    try:
        return launch()
    except RuntimeError as error:
        if not is_missing_binary(error):
            raise
        first_line = str(error).strip().splitlines()[0]
        reason = (f"the GPU extension (built for {', '.join(build.gpu_archs()) or '?'}) has no "
                  f"kernel for this GPU: {first_line}; set PYTORCH_ROCM_ARCH to its arch")
        build.disable_gpu_extension(reason)
        log.warning("rocdraft: %s; using the Triton/torch paths from now on", reason)
        return launch()


def write_kv_hip(key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache,
                 slot_mapping: torch.Tensor) -> None:
    """Write key/value [>= num_tokens, num_kv_heads, head_dim] to ``cache`` at slot_mapping
    [num_tokens] int64 (slots < 0 skipped), quantising for fp8 caches with the cache's scales.
    Same contract as backends.kv_cache.write_kv_reference.

    Eager calls run the op's body (``ops.write_kv_impl``: the same checks and kernel) without
    the custom-op wrapper, whose Python dispatch cost 3.6x the body (host µs per call:
    scripts/bench_write_kv_host.py); under torch.compile the registered op is traced."""
    op = ops.write_kv if torch.compiler.is_compiling() else ops.write_kv_impl
    _falling_back(lambda: op(key, value, cache.key, cache.value, slot_mapping, cache.k_scale,
                             cache.v_scale, cache.layout))


def compact_kv_hip(cache: LayerKVCache, block_table: torch.Tensor, context_lens: torch.Tensor,
                   accepted_nodes: torch.Tensor, num_accepted: torch.Tensor,
                   block_size: int) -> None:
    """Compact ``cache`` in place after tree verification: block_table [>= B, max_blocks]
    int32, context_lens [B] int32, accepted_nodes [B, D] int64 (-1 after the path),
    num_accepted [B] int64. Same contract as backends.kv_compact.compact_kv_reference."""
    _falling_back(lambda: ops.compact_kv(cache.key, cache.value, block_table, context_lens,
                                         accepted_nodes, num_accepted, cache.layout,
                                         block_size))


def advance_draft_step_hip_(positions: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, clamped_positions_out: torch.Tensor,
                            slot_mapping_out: torch.Tensor, block_size: int,
                            max_model_len: int) -> None:
    """In place: positions [batch_size] int64 += 1, seq_lens [batch_size] int32 += 1 (1 where
    clamped); writes clamped_positions_out / slot_mapping_out [batch_size] int64.
    block_table [>= batch_size, max_blocks_per_seq] int32. Equals index_math.advance_draft_step
    (its new_positions, clamped, slots, new_seq_lens land in positions, clamped_positions_out,
    slot_mapping_out, seq_lens)."""
    _falling_back(lambda: ops.advance_draft_step(positions, seq_lens, block_table,
                                                 clamped_positions_out, slot_mapping_out,
                                                 block_size, max_model_len))


def prepare_padded_drafting_hip(sampled: torch.Tensor, discard_request: torch.Tensor,
                                backup_next_token_ids: torch.Tensor, vocab_size: int,
                                query_start_loc: torch.Tensor, num_draft_tokens: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                           torch.Tensor]:
    """sampled [batch_size, k + 1] int64 (-1 rejected), discard_request [batch_size] bool,
    backup_next_token_ids [batch_size] int64, query_start_loc [batch_size + 1] int32,
    num_draft_tokens [batch_size] int32
    -> (next_token_ids [batch_size] int64, valid_sampled_count [batch_size] int32,
        token_indices_to_sample [batch_size] int64, num_rejected [batch_size] int64):
    index_math.prepare_next_token_ids_padded then prepare_inputs_padded, in one kernel."""
    return _falling_back(lambda: ops.prepare_padded_drafting(
        sampled, discard_request, backup_next_token_ids, vocab_size, query_start_loc,
        num_draft_tokens))
