"""Fused draft-step update in Triton: one launch replaces the handful of torch ops of
``rocdraft.drafter.index_math.advance_draft_step`` (its reference, which this kernel equals).

Per request row, in place and without a host read (graph-safe)::

    positions += 1                                  # int64, unclamped
    exceeds = positions >= max_model_len            # padding rows stay here at every step
    clamped = 0 if exceeds else positions
    slot = block_table[row, min(clamped // block_size, max_blocks - 1)] * block_size
           + clamped % block_size,   PADDING_SLOT_ID (-1) if exceeds
    seq_lens = 1 if exceeds else seq_lens + 1       # int32

Example, block_size 4, max_model_len 10, block_table [[3, 7, 1], [2, 5, 6]]:
positions [4, 9], seq_lens [5, 10] -> positions [5, 10], clamped [5, 0], slots [29, -1],
seq_lens [6, 1].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 128


@triton.jit
def advance_draft_step_kernel(positions_ptr, seq_lens_ptr, block_table_ptr,
                              clamped_positions_ptr, slot_mapping_ptr,
                              batch_size, block_table_stride_row, block_table_stride_col,
                              max_blocks_per_seq, block_size, max_model_len,
                              BLOCK: tl.constexpr):
    """Grid (cdiv(batch_size, BLOCK),): each program updates BLOCK request rows."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_batch = rows < batch_size
    new_positions = tl.load(positions_ptr + rows, mask=in_batch, other=0) + 1  # int64
    exceeds = new_positions >= max_model_len
    clamped = tl.where(exceeds, 0, new_positions)
    block_col = tl.minimum(clamped // block_size, max_blocks_per_seq - 1)
    block_ids = tl.load(block_table_ptr + rows.to(tl.int64) * block_table_stride_row
                        + block_col * block_table_stride_col, mask=in_batch, other=0)
    slots = block_ids.to(tl.int64) * block_size + clamped % block_size
    slots = tl.where(exceeds, -1, slots)
    seq_lens = tl.load(seq_lens_ptr + rows, mask=in_batch, other=0)
    seq_lens = tl.where(exceeds, 1, seq_lens + 1)
    tl.store(positions_ptr + rows, new_positions, mask=in_batch)
    tl.store(clamped_positions_ptr + rows, clamped, mask=in_batch)
    tl.store(slot_mapping_ptr + rows, slots, mask=in_batch)
    tl.store(seq_lens_ptr + rows, seq_lens.to(tl.int32), mask=in_batch)


def _check_vector(name: str, t: torch.Tensor, dtype: torch.dtype, batch_size: int,
                  device: torch.device) -> None:
    if t.dtype != dtype or t.dim() != 1 or t.shape[0] != batch_size:
        raise ValueError(f"{name} must be a [{batch_size}] {dtype} tensor, got {t.dtype} "
                         f"of shape {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, positions on {device}")


def advance_draft_step_triton_(positions: torch.Tensor, seq_lens: torch.Tensor,
                               block_table: torch.Tensor, clamped_positions_out: torch.Tensor,
                               slot_mapping_out: torch.Tensor, block_size: int,
                               max_model_len: int) -> None:
    """Checked wrapper, in place: positions [batch_size] int64 (+= 1), seq_lens [batch_size]
    int32 (updated), block_table [>= batch_size, max_blocks_per_seq] int32 (read),
    clamped_positions_out [batch_size] int64 and slot_mapping_out [batch_size] int64 (written).
    """
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1-D, got shape {list(positions.shape)}")
    batch_size, device = positions.shape[0], positions.device
    _check_vector("positions", positions, torch.int64, batch_size, device)
    _check_vector("seq_lens", seq_lens, torch.int32, batch_size, device)
    _check_vector("clamped_positions_out", clamped_positions_out, torch.int64, batch_size, device)
    _check_vector("slot_mapping_out", slot_mapping_out, torch.int64, batch_size, device)
    if block_table.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] < batch_size or block_table.shape[1] < 1:
        raise ValueError(f"block_table must be [>= {batch_size}, >= 1] int32, got "
                         f"{block_table.dtype} of shape {list(block_table.shape)}")
    if block_table.device != device:
        raise ValueError(f"block_table is on {block_table.device}, positions on {device}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if max_model_len <= 0:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    if batch_size == 0:
        return
    grid = (triton.cdiv(batch_size, BLOCK_ROWS),)
    advance_draft_step_kernel[grid](
        positions, seq_lens, block_table, clamped_positions_out, slot_mapping_out,
        batch_size, block_table.stride(0), block_table.stride(1), block_table.shape[1],
        block_size, max_model_len, BLOCK=BLOCK_ROWS)
