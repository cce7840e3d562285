"""rocdraft.distributed.messages: encode -> decode gives back every input of a module call
(token ids, 1-D and M-RoPE positions, each CommonAttentionMetadata field, shared and per-request
tree masks, hidden states), and the header sizes the payloads exactly."""
from __future__ import annotations

import pytest
import torch

from rocdraft.backends.metadata import CommonAttentionMetadata
from rocdraft.distributed import messages as msg


def _common(spec_mask=None) -> CommonAttentionMetadata:
    # The docstring's example: a decode token at position 5, then a 3-token prefill.
    return CommonAttentionMetadata.from_cpu([0, 1, 4], [6, 3], torch.tensor([[0, 1], [2, -1]]),
                                            torch.tensor([5, 8, 9, 10]), "cpu") \
        .with_updates(spec_mask=spec_mask, seq_lens_cpu=torch.tensor([7, 3], dtype=torch.int32))


def test_worked_example_of_the_docstring():
    ids = torch.tensor([10, 11, 12, 13])
    header, ints, hidden = msg.encode(msg.TARGET_FORWARD, ids, torch.tensor([5, 0, 1, 2]),
                                      _common())
    assert header.tolist() == [msg.TARGET_FORWARD, 4, 2, 4, 3, 6, 1, 1, 2, 0, 0, 0, 0, 0, 0, 4]
    assert ints.tolist() == [10, 11, 12, 13, 5, 0, 1, 2, 0, 1, 4, 6, 3, 7, 3, 0, 1, 2, -1,
                             5, 8, 9, 10]
    assert hidden is None and msg.ints_numel(header.tolist()) == ints.numel()


@pytest.mark.parametrize("mask", [None, torch.tensor([[1, 0], [1, 1]], dtype=torch.bool),
                                  torch.rand(2, 3, 3) > 0.5])
@pytest.mark.parametrize("mrope", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip(mask, mrope, dtype):
    ids = torch.tensor([10, 11, 12, 13])
    positions = torch.tensor([5, 0, 1, 2])
    if mrope:
        positions = torch.stack([positions, positions + 1, positions + 2])
    common = _common(mask)
    features = torch.randn(4, 8).to(dtype)
    # Tokens and hidden rows in one message: the format carries both for any op.
    header, ints, hidden = msg.encode(msg.TARGET_FORWARD, ids, positions, common, features)
    fields = header.tolist()
    assert msg.ints_numel(fields) == ints.numel()
    assert msg.hidden_shape(fields) == ((4, 8), dtype)
    got_ids, got_positions, got = msg.decode_tokens(fields, ints)
    assert torch.equal(got_ids, ids) and torch.equal(got_positions, positions)
    assert torch.equal(hidden, features)
    for name in ("query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu",
                 "block_table", "slot_mapping"):
        a, b = getattr(got, name), getattr(common, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len", "causal"):
        assert getattr(got, name) == getattr(common, name), name
    if mask is None:
        assert got.spec_mask is None
    else:
        assert torch.equal(got.spec_mask, mask)


def test_logits_message_has_no_ints_and_refuses_other_dtypes():
    header, ints, hidden = msg.encode(msg.TARGET_LOGITS, hidden=torch.zeros(3, 8))
    assert ints is None and msg.ints_numel(header.tolist()) == 0
    assert msg.hidden_shape(header.tolist()) == ((3, 8), torch.float32)
    with pytest.raises(ValueError, match="dtype torch.float64"):
        msg.encode(msg.TARGET_LOGITS, hidden=torch.zeros(3, 8, dtype=torch.float64))


def test_compaction_message_round_trip():
    table = torch.tensor([[3, 4, -1], [5, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([7, 2], dtype=torch.int32)
    nodes = torch.tensor([[0, 2, -1], [-1, -1, -1]])
    accepted = torch.tensor([2, 0])
    header, ints, hidden = msg.encode(msg.TARGET_COMPACT, compact=(table, lens, nodes, accepted))
    fields = header.tolist()
    assert hidden is None and ints.numel() == msg.ints_numel(fields) == 6 + 2 + 6 + 2
    for got, expected in zip(msg.decode_compact(fields, ints), (table, lens, nodes, accepted)):
        assert torch.equal(got, expected) and got.dtype == expected.dtype
