"""The per-draft-step update, dispatched to the fastest implementation present.

HIP kernel when the extension is built (GPU), else the Triton kernel on a GPU, else the
torch reference ``index_math.advance_draft_step``. All three have the same semantics and are
tested against each other.
"""
from __future__ import annotations

import torch

from rocdraft.drafter.index_math import advance_draft_step


def advance_draft_step_(positions: torch.Tensor, seq_lens: torch.Tensor,
                        block_table: torch.Tensor, block_size: int, max_model_len: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``index_math.advance_draft_step`` (returns new tensors)."""
    if positions.dim() == 2:  # M-RoPE [3, batch_size]: row 0 drives clamping and slots
        new_pos0, clamped0, slots, new_seq_lens = advance_draft_step(
            positions[0], seq_lens, block_table, block_size, max_model_len)
        exceeds = new_pos0 >= max_model_len
        new_positions = positions + 1
        clamped = new_positions.masked_fill(exceeds.unsqueeze(0), 0)
        return new_positions, clamped, slots, new_seq_lens
    return advance_draft_step(positions, seq_lens, block_table, block_size, max_model_len)
