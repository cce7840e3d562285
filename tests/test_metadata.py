"""CommonAttentionMetadata construction and ``token_layout`` against a naive loop."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rocdraft.backends.metadata import CommonAttentionMetadata, block_run, token_layout


def naive_token_layout(query_lens, seq_lens, num_tokens):
    req, index, position = [], [], []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        for j in range(q):
            req.append(i)
            index.append(j)
            position.append(s - q + j)
    pad = num_tokens - len(req)
    return req + [len(query_lens)] * pad, index + [0] * pad, position + [0] * pad


def test_token_layout_docstring_example():
    req, index, pos = token_layout(torch.tensor([0, 1, 4], dtype=torch.int32),
                                   torch.tensor([6, 3], dtype=torch.int32), 5)
    assert req.tolist() == [0, 1, 1, 1, 2]
    assert index.tolist() == [0, 0, 1, 2, 0]
    assert pos.tolist() == [5, 0, 1, 2, 0]
    assert req.dtype == index.dtype == pos.dtype == torch.int64


@settings(max_examples=80, deadline=None)
@given(query_lens=st.lists(st.integers(0, 6), min_size=1, max_size=6),
       cached=st.data(), padding=st.integers(0, 5))
def test_token_layout_matches_naive_loop(query_lens, cached, padding):
    # Zero-length queries (a request with nothing new this step) are allowed in the middle.
    seq_lens = [q + cached.draw(st.integers(0, 20)) for q in query_lens]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    num_tokens = qsl[-1] + padding
    req, index, pos = token_layout(torch.tensor(qsl, dtype=torch.int32),
                                   torch.tensor(seq_lens, dtype=torch.int32), num_tokens)
    want = naive_token_layout(query_lens, seq_lens, num_tokens)
    assert (req.tolist(), index.tolist(), pos.tolist()) == want


def test_token_layout_padding_only_batch():
    # A graph bucket with no real request: every token is padding, routed to row 0 == batch_size.
    req, index, pos = token_layout(torch.tensor([0], dtype=torch.int32),
                                   torch.zeros(0, dtype=torch.int32), 3)
    assert (req.tolist(), index.tolist(), pos.tolist()) == ([0] * 3, [0] * 3, [0] * 3)


def worked_example(device="cpu"):
    block_table = torch.tensor([[0, 1, -1], [2, -1, -1], [3, 4, 5]])
    slot_mapping = torch.tensor([5, 8, 9, 10, 18, 19, 20])
    return CommonAttentionMetadata.from_cpu([0, 1, 4, 7], [6, 3, 9], block_table, slot_mapping,
                                            device)


def test_from_cpu_worked_example():
    m = worked_example()
    assert m.query_start_loc.tolist() == [0, 1, 4, 7]
    assert m.query_start_loc_cpu.tolist() == [0, 1, 4, 7]
    assert m.seq_lens.tolist() == m.seq_lens_cpu.tolist() == [6, 3, 9]
    assert (m.num_reqs, m.num_actual_tokens, m.max_query_len, m.max_seq_len) == (3, 7, 3, 9)
    assert m.query_start_loc.dtype == m.seq_lens.dtype == m.block_table.dtype == torch.int32
    assert m.slot_mapping.dtype == torch.int64
    assert m.query_start_loc_cpu.device.type == "cpu"
    assert m.block_table.tolist() == [[0, 1, -1], [2, -1, -1], [3, 4, 5]]
    assert m.slot_mapping.tolist() == [5, 8, 9, 10, 18, 19, 20]
    assert m.causal and m.spec_mask is None
    # The worked example's positions: decode at 5, prefill 0..2, verify 6..8.
    _, _, pos = token_layout(m.query_start_loc, m.seq_lens, m.num_actual_tokens)
    assert pos.tolist() == [5, 0, 1, 2, 6, 7, 8]


def test_from_cpu_copies_host_lists():
    qsl, seq_lens = [0, 2], [2]
    m = CommonAttentionMetadata.from_cpu(qsl, seq_lens, torch.zeros(1, 1), torch.zeros(2),
                                         "cpu", causal=False)
    qsl[1], seq_lens[0] = 99, 99
    assert m.query_start_loc_cpu.tolist() == [0, 2] and m.seq_lens_cpu.tolist() == [2]
    assert not m.causal


def test_from_cpu_empty_batch():
    m = CommonAttentionMetadata.from_cpu([0], [], torch.zeros(0, 4), torch.zeros(0), "cpu")
    assert (m.num_reqs, m.num_actual_tokens, m.max_query_len, m.max_seq_len) == (0, 0, 0, 0)


def test_with_updates_returns_a_new_object():
    m = worked_example()
    m2 = m.with_updates(max_seq_len=10, causal=False)
    assert (m2.max_seq_len, m2.causal) == (10, False)
    assert (m.max_seq_len, m.causal) == (9, True)
    with pytest.raises(Exception):
        m.max_seq_len = 3  # frozen


def test_post_init_checks_query_start_loc_length():
    m = worked_example()
    with pytest.raises(ValueError, match=r"query_start_loc has 3 entries.*4"):
        m.with_updates(query_start_loc=m.query_start_loc[:3])


def test_post_init_checks_seq_lens_length():
    m = worked_example()
    with pytest.raises(ValueError, match=r"seq_lens has 2 entries.*3"):
        m.with_updates(seq_lens=m.seq_lens[:2])


def test_post_init_checks_num_reqs():
    m = worked_example()
    with pytest.raises(ValueError, match="num_reqs"):
        m.with_updates(num_reqs=2)


# --- spec_mask (tree masks): shared [S, S] or per request [num_reqs, S, S] ----------------

def test_spec_mask_shared_and_per_request_forms_are_accepted():
    m = worked_example()  # seq_lens [6, 3, 9]: S up to 3
    shared = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    assert m.with_updates(spec_mask=shared).spec_mask is shared
    per_request = shared.expand(3, 3, 3)  # a view with batch stride 0 is fine
    assert m.with_updates(spec_mask=per_request).spec_mask.shape == (3, 3, 3)


@pytest.mark.parametrize("mask, match", [
    (torch.ones(2, 2, dtype=torch.uint8), r"bool.*torch.uint8 of shape \[2, 2\]"),
    (torch.ones(3, dtype=torch.bool), r"\[S, S\] or \[num_reqs, S, S\].*shape \[3\]"),
    (torch.ones(3, 1, 2, 2, dtype=torch.bool), r"shape \[3, 1, 2, 2\]"),
    (torch.ones(2, 3, dtype=torch.bool), r"shape \[2, 3\]"),
    (torch.ones(3, 2, 3, dtype=torch.bool), r"shape \[3, 2, 3\]"),
    (torch.ones(0, 0, dtype=torch.bool), r"S >= 1.*shape \[0, 0\]"),
    (torch.ones(2, 2, 2, dtype=torch.bool), r"shape \[2, 2, 2\] has batch dim 2.*num_reqs = 3"),
], ids=["not-bool", "1-D", "4-D", "not-square", "not-square-3d", "empty", "batch-dim"])
def test_bad_spec_mask_is_refused_in_one_line_naming_the_shape(mask, match):
    m = worked_example()
    with pytest.raises(ValueError, match=match) as info:
        m.with_updates(spec_mask=mask)
    assert "\n" not in str(info.value)


def test_spec_mask_check_reads_no_device_tensor():
    # Device tensors on "meta": any host read would raise; seq_lens_cpu is the host copy.
    m = worked_example()
    meta = m.with_updates(seq_lens=m.seq_lens.to("meta"),
                          spec_mask=torch.ones(3, 2, 2, dtype=torch.bool, device="meta"))
    assert meta.spec_mask.device.type == "meta"
    with pytest.raises(ValueError, match="batch dim 2"):
        m.with_updates(seq_lens=m.seq_lens.to("meta"),
                       spec_mask=torch.ones(2, 4, 4, dtype=torch.bool, device="meta"))


def test_a_mask_longer_than_a_request_is_accepted():
    # A tree step may batch a 16-node tree with a 3-token prompt chunk: S = 17 > seq_len 3.
    m = worked_example()  # seq_lens [6, 3, 9]
    assert m.with_updates(spec_mask=torch.ones(3, 17, 17, dtype=torch.bool)).num_reqs == 3


def test_spec_mask_with_an_empty_batch_checks_only_the_shape():
    m = CommonAttentionMetadata.from_cpu([0], [], torch.zeros(0, 4), torch.zeros(0), "cpu")
    assert m.with_updates(spec_mask=torch.ones(0, 2, 2, dtype=torch.bool)).num_reqs == 0
    with pytest.raises(ValueError, match="batch dim 1"):
        m.with_updates(spec_mask=torch.ones(1, 2, 2, dtype=torch.bool))


def test_a_new_slot_mapping_drops_the_no_padding_promise():
    common = CommonAttentionMetadata.from_cpu([0, 2], [5], torch.zeros(1, 2, dtype=torch.int32),
                                              torch.tensor([3, 4]), "cpu", no_padding_slots=True)
    assert common.no_padding_slots
    assert common.with_updates(causal=False).no_padding_slots  # slots unchanged: kept
    assert not common.with_updates(slot_mapping=torch.tensor([3, -1])).no_padding_slots
    assert common.with_updates(slot_mapping=torch.tensor([3, 5]),
                               no_padding_slots=True).no_padding_slots


def test_block_run_examples():
    assert block_run([7, 8, 9, -1]) == (7, 3) and block_run([3]) == (3, 1)
    assert block_run([0, 1]) == (0, 2)
    for other in ([7, 9, 10], [9, 8, 7], [7, 7, 8], [4, 5, 0, 0], [-1, -1], [], [-1, 2]):
        assert block_run(other) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(0, 4))
def test_block_run_is_exactly_the_consecutive_rows(blocks, padding):
    """A table row (its blocks, then -1 padding) is a run exactly when its blocks are
    consecutive ascending ids: (the first, how many)."""
    consecutive = all(b == a + 1 for a, b in zip(blocks, blocks[1:]))
    want = (blocks[0], len(blocks)) if consecutive else None
    assert block_run(blocks + [-1] * padding) == want


def test_from_cpu_flags_a_lone_requests_run_and_a_new_table_drops_it():
    table = torch.tensor([[4, 5, 6, -1]], dtype=torch.int32)
    lone = CommonAttentionMetadata.from_cpu([0, 1], [9], table, torch.tensor([24]), "cpu")
    assert lone.block_run == (4, 3)
    assert lone.with_updates(causal=False).block_run == (4, 3)  # the table kept: kept
    assert lone.with_updates(block_table=table.flip(1)).block_run is None
    two = CommonAttentionMetadata.from_cpu([0, 1, 2], [5, 5],
                                           torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                                           torch.tensor([4, 12]), "cpu")
    assert two.block_run is None  # a batch: never one slice
    shuffled = CommonAttentionMetadata.from_cpu([0, 1], [9], table[:, [1, 0, 2, 3]],
                                                torch.tensor([24]), "cpu")
    assert shuffled.block_run is None
