"""Fused Triton draft-step update against ``index_math.advance_draft_step``: the docstring
example, a property test on random batches (padding rows past max_model_len included),
batches wider than one program, and the checked wrapper's errors."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rocdraft.backends.triton_kernels.draft_step import BLOCK_ROWS, advance_draft_step_triton_
from rocdraft.drafter.index_math import advance_draft_step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run_both(positions, seq_lens, block_table, block_size, max_model_len):
    """(reference outputs, kernel outputs) as 4-tuples (positions, clamped, slots, seq_lens)."""
    ref = advance_draft_step(positions, seq_lens, block_table, block_size, max_model_len)
    pos, lens = positions.clone(), seq_lens.clone()
    clamped = torch.full_like(positions, -7)
    slots = torch.full_like(positions, -7)
    advance_draft_step_triton_(pos, lens, block_table, clamped, slots, block_size, max_model_len)
    return ref, (pos, clamped, slots, lens)


def _assert_equal(ref, got):
    for name, r, g in zip(("positions", "clamped", "slots", "seq_lens"), ref, got):
        assert r.dtype == g.dtype, name
        assert torch.equal(r, g), f"{name}: reference {r.tolist()} kernel {g.tolist()}"


def test_docstring_example():
    block_table = torch.tensor([[3, 7, 1], [2, 5, 6]], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([4, 9], device=DEVICE)
    seq_lens = torch.tensor([5, 10], dtype=torch.int32, device=DEVICE)
    ref, got = _run_both(positions, seq_lens, block_table, 4, 10)
    _assert_equal(ref, got)
    assert got[2].tolist() == [29, -1] and got[3].tolist() == [6, 1]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_matches_reference_on_random_batches(data):
    batch_size = data.draw(st.integers(1, 12))
    max_blocks = data.draw(st.integers(1, 6))
    block_size = data.draw(st.integers(1, 16))
    max_model_len = data.draw(st.integers(1, 2 * max_blocks * block_size))
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    block_table = torch.randint(0, 1000, (batch_size, max_blocks), generator=g, dtype=torch.int32)
    # Positions up to a few past max_model_len: those rows are graph padding.
    positions = torch.randint(0, max_model_len + 4, (batch_size,), generator=g)
    seq_lens = torch.randint(1, max_model_len + 2, (batch_size,), generator=g, dtype=torch.int32)
    ref, got = _run_both(positions.to(DEVICE), seq_lens.to(DEVICE), block_table.to(DEVICE),
                         block_size, max_model_len)
    _assert_equal(ref, got)


def test_batch_wider_than_one_program_and_taller_block_table():
    batch_size = BLOCK_ROWS + 5
    g = torch.Generator().manual_seed(0)
    block_table = torch.randint(0, 50, (batch_size + 3, 4), generator=g,
                                dtype=torch.int32).to(DEVICE)
    positions = torch.randint(0, 20, (batch_size,), generator=g).to(DEVICE)
    seq_lens = torch.randint(1, 20, (batch_size,), generator=g, dtype=torch.int32).to(DEVICE)
    ref = advance_draft_step(positions, seq_lens, block_table[:batch_size], 4, 16)
    _, got = _run_both(positions, seq_lens, block_table, 4, 16)
    _assert_equal(ref, got)


@pytest.mark.parametrize("case", ["positions", "seq_lens", "block_table", "slot_mapping_out",
                                  "block_size"])
def test_checked_wrapper_rejects_bad_arguments(case):
    positions = torch.tensor([1, 2], device=DEVICE)
    seq_lens = torch.tensor([2, 3], dtype=torch.int32, device=DEVICE)
    block_table = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    clamped, slots, block_size = torch.empty_like(positions), torch.empty_like(positions), 4
    if case == "positions":
        positions = positions.int()
    elif case == "seq_lens":
        seq_lens = seq_lens[:1]
    elif case == "block_table":
        block_table = block_table.long()
    elif case == "slot_mapping_out":
        slots = slots.int()
    else:
        block_size = 0
    with pytest.raises(ValueError, match=case):
        advance_draft_step_triton_(positions, seq_lens, block_table, clamped, slots,
                                   block_size, 8)
