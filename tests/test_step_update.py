"""Draft-step bookkeeping dispatch: the vectorised torch schedule equals iterating the
per-step reference; the fused kernels (Triton, HIP) are checked against the same reference
in their own test files and, on a GPU, through this dispatcher (tests/test_gpu_kernels.py)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rocdraft.drafter.index_math import (advance_draft_step, draft_step_offsets,
                                         draft_step_schedule)
from rocdraft.drafter.step_update import DraftStepIndexer


def test_schedule_docstring_example():
    clamped, slots, seq_lens = draft_step_schedule(
        torch.tensor([4, 8]), torch.tensor([5, 9], dtype=torch.int32),
        torch.tensor([[3, 7, 1], [2, 5, 6]], dtype=torch.int32), 2, 4, 10)
    assert clamped.tolist() == [[5, 9], [6, 0]]  # row i: draft step i + 1
    assert slots.tolist() == [[29, 25], [30, -1]]
    assert seq_lens.tolist() == [[6, 10], [7, 1]]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.sampled_from([1, 2, 4, 16]),
       st.integers(4, 40), st.integers(0, 2 ** 16))
def test_schedule_equals_iterated_reference(batch_size, num_steps, block_size, max_model_len,
                                            seed):
    g = torch.Generator().manual_seed(seed)
    width = -(-max_model_len // block_size)
    block_table = torch.randint(0, 50, (batch_size, width), generator=g, dtype=torch.int32)
    positions = torch.randint(0, max_model_len + 3, (batch_size,), generator=g)
    seq_lens = (positions + 1).to(torch.int32)
    clamped, slots, seq = draft_step_schedule(positions, seq_lens, block_table, num_steps,
                                              block_size, max_model_len)
    kept = draft_step_schedule(positions, seq_lens.long(), block_table, num_steps, block_size,
                               max_model_len, draft_step_offsets(num_steps))
    assert all(torch.equal(a, b) for a, b in zip(kept, (clamped, slots, seq)))
    assert (clamped.dtype, slots.dtype, seq.dtype) == (torch.int64, torch.int64, torch.int32)
    indexer = DraftStepIndexer(positions, seq_lens, block_table, num_steps, block_size,
                               max_model_len)
    p, s = positions, seq_lens
    for i in range(num_steps):
        p, c, sl, s = advance_draft_step(p, s, block_table, block_size, max_model_len)
        assert torch.equal(clamped[i], c)
        assert torch.equal(slots[i], sl)
        assert torch.equal(seq[i], s.to(torch.int32))
        step = indexer.step(i + 1)
        assert all(torch.equal(a, b) for a, b in zip(step, (c, sl, s.to(torch.int32))))


def test_schedule_mrope_rows_follow_row_zero():
    positions = torch.tensor([[7, 8], [7, 8], [5, 6]])
    clamped, slots, seq = draft_step_schedule(positions, torch.tensor([8, 9]),
                                              torch.zeros(2, 3, dtype=torch.int32), 2, 4, 10)
    assert clamped.tolist() == [[[8, 9], [8, 9], [6, 7]], [[9, 0], [9, 0], [7, 0]]]
    assert slots[:, 1].tolist() == [1, -1]
    assert seq.tolist() == [[9, 10], [10, 1]]


def test_cpu_and_mrope_positions_take_the_torch_schedule():
    """No fused kernel for CPU tensors (Triton would run in its slow interpreter) nor, on any
    device, for M-RoPE [3, B] positions (the kernels take [B])."""
    block_table = torch.zeros(2, 3, dtype=torch.int32)
    seq_lens = torch.tensor([8, 9], dtype=torch.int32)
    assert DraftStepIndexer(torch.tensor([7, 8]), seq_lens, block_table, 2, 4, 10).kernel is None
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        mrope = torch.tensor([[7, 8], [7, 8], [5, 6]], device=device)
        indexer = DraftStepIndexer(mrope, seq_lens.to(device), block_table.to(device), 2, 4, 10)
        assert indexer.kernel is None


def test_step_offsets_are_the_schedules_column():
    """draft_step_offsets: what the schedule builds when none is kept, [[1], ..., [S]]."""
    assert draft_step_offsets(3).tolist() == [[1], [2], [3]]
    assert draft_step_offsets(3).dtype == torch.int32
