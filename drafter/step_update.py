"""Per-draft-step bookkeeping (positions +1, clamp, slot mapping, seq_lens +1), dispatched to
the fastest implementation present:

- HIP/CUDA extension (``rocdraft.hip_kernels``) when built: one fused kernel per step;
- else the Triton kernel on a GPU: one fused kernel per step;
- else (CPU, or M-RoPE positions) the torch reference, vectorised over all steps at once
  (``index_math.draft_step_schedule``, step-major): 12 ops per draft loop and one ``unbind``
  per output, whatever the number of steps (no per-step view).

All three equal iterating ``index_math.advance_draft_step`` (tests/test_step_update.py).
"""
from __future__ import annotations

import torch

from rocdraft.drafter.index_math import draft_step_schedule


def _fused_kernel(positions: torch.Tensor):
    """The in-place fused step kernel for this device, or None."""
    if not positions.is_cuda or positions.dim() != 1:
        return None
    from rocdraft.hip_kernels.dispatch import advance_draft_step_hip_, hip_available

    if hip_available():
        return advance_draft_step_hip_
    from rocdraft.backends.triton_kernels.draft_step import advance_draft_step_triton_

    return advance_draft_step_triton_


class DraftStepIndexer:
    """``step(i)`` -> (clamped_positions [B] (or [3, B]), slot_mapping [B] int64,
    seq_lens [B] int32) of draft step i (1-based), starting from the token at ``positions``
    with sequence length ``seq_lens``. Tensors returned by a fused kernel are reused buffers,
    overwritten by the next step; ``precomputed``: every step's tensors exist already
    (``schedule``: the step-major [num_steps, ...] tensors), so steps may be read ahead, in
    any order. offsets: a kept ``index_math.draft_step_offsets(num_steps)`` (optional)."""

    @property
    def precomputed(self) -> bool:
        """Every step's tensors exist already (no fused in-place kernel)."""
        return self.kernel is None

    def __init__(self, positions: torch.Tensor, seq_lens: torch.Tensor,
                 block_table: torch.Tensor, num_steps: int, block_size: int,
                 max_model_len: int, offsets: torch.Tensor | None = None) -> None:
        self.block_table, self.block_size, self.max_model_len = block_table, block_size, \
            max_model_len
        self.kernel = _fused_kernel(positions)
        if self.kernel is not None:
            self.positions = positions.clone()
            self.seq_lens = seq_lens.to(torch.int32, copy=True)
            self.clamped = torch.empty_like(self.positions)
            self.slots = torch.empty_like(self.positions)
        else:
            self.schedule = draft_step_schedule(positions, seq_lens, block_table, num_steps,
                                                block_size, max_model_len, offsets)
            # [(clamped, slots, seq_lens) of step i + 1]: three unbinds, no per-step view
            self.rows = tuple(zip(*(t.unbind(0) for t in self.schedule)))

    def step(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.kernel is not None:
            self.kernel(self.positions, self.seq_lens, self.block_table, self.clamped,
                        self.slots, self.block_size, self.max_model_len)
            return self.clamped, self.slots, self.seq_lens
        return self.rows[index - 1]
