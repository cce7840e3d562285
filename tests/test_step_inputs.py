"""rocdraft/core/step_inputs.py: the step's input sections laid out in one byte buffer
(aligned, disjoint, in order), typed views that round-trip every dtype, one upload per
call, the persistent buffer's fixed addresses, and a clear error when it is too small.
The pinned, non-blocking copy itself runs only on a GPU (tests/test_gpu_end_to_end.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rocdraft.core.step_inputs import ALIGN, Section, StepInputBuffers, section_offsets

DTYPES = (torch.int64, torch.int32, torch.bool, torch.float32)


def test_the_docstring_example():
    sections = [Section("ids", torch.int64, (3,)), Section("seq_lens", torch.int32, (2,)),
                Section("mask", torch.bool, (2, 2))]
    assert section_offsets(sections) == ([0, 32, 48], 52)


@given(st.lists(st.tuples(st.sampled_from(DTYPES),
                          st.lists(st.integers(0, 5), min_size=1, max_size=3)),
                min_size=1, max_size=8))
def test_sections_are_aligned_disjoint_and_in_order(specs):
    sections = [Section(f"s{i}", dtype, tuple(shape)) for i, (dtype, shape) in enumerate(specs)]
    offsets, used = section_offsets(sections)
    ends = [o + s.nbytes for o, s in zip(offsets, sections)]
    assert all(o % ALIGN == 0 for o in offsets)
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:]))
    assert used == ends[-1]


def test_upload_round_trips_every_dtype_and_counts():
    buffers = StepInputBuffers("cpu", persistent_bytes=256)
    values = {"ids": torch.tensor([5, -1, 7]), "lens": torch.tensor([3, 4], dtype=torch.int32),
              "mask": torch.tensor([[True, False], [True, True]]),
              "table": torch.arange(6, dtype=torch.int32).view(2, 3)}
    fresh = buffers.upload(values)
    for name, value in values.items():
        assert fresh[name].dtype == value.dtype and torch.equal(fresh[name], value)
    first = buffers.upload(values, persistent=True)
    again = buffers.upload({k: v + 1 if v.dtype != torch.bool else ~v
                            for k, v in values.items()}, persistent=True)
    # The same layout lands at the same addresses (a captured graph reads them there)...
    assert all(first[k].data_ptr() == again[k].data_ptr() for k in values)
    assert torch.equal(first["ids"], torch.tensor([6, 0, 8]))  # ...and was overwritten
    assert torch.equal(fresh["ids"], values["ids"])  # a fresh upload owns its memory
    assert buffers.num_uploads == 3


def test_a_persistent_upload_too_large_names_the_sizes():
    buffers = StepInputBuffers("cpu", persistent_bytes=16)
    with pytest.raises(ValueError, match="step inputs of 24 bytes exceed the persistent "
                                         "buffer of 16 bytes"):
        buffers.upload({"ids": torch.zeros(3, dtype=torch.long)}, persistent=True)
