"""Drafter index math: every function's docstring example and a property test against a
naive per-request loop, plus consistency of the padded and unpadded drafting paths."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rocdraft.backends.kv_cache import PADDING_SLOT_ID
from rocdraft.drafter.index_math import (advance_draft_step, prepare_inputs_cpu,
                                         prepare_inputs_padded, prepare_next_token_ids_padded,
                                         shift_input_ids)

FAST = settings(max_examples=60, deadline=None)


def prefix_sum(lens):
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    return qsl


# --- shift_input_ids ------------------------------------------------------------------------

def test_shift_input_ids_docstring_example():
    a1, b1, b2, c1, c2, c3, a2, b3, c4 = range(10, 19)
    out = shift_input_ids(torch.tensor([a1, b1, b2, c1, c2, c3]), torch.tensor([a2, b3, c4]),
                          torch.tensor([0, 2, 5]))
    assert out.tolist() == [a2, b2, b3, c2, c3, c4]


@FAST
@given(st.data())
def test_shift_input_ids_matches_naive_loop(data):
    query_lens = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    padded = data.draw(st.booleans())  # padded drafting: last index before the rejected tokens
    rejected = [data.draw(st.integers(0, q - 1)) if padded else 0 for q in query_lens]
    qsl = prefix_sum(query_lens)
    ids = torch.randint(0, 1000, (qsl[-1],))
    next_ids = torch.randint(1000, 2000, (len(query_lens),))
    last = torch.tensor([qsl[i + 1] - 1 - r for i, r in enumerate(rejected)])
    out = shift_input_ids(ids, next_ids, last)
    assert out.shape == ids.shape and out.dtype == ids.dtype
    for i in range(len(query_lens)):
        start, stop = qsl[i], int(last[i])
        # [x1, x2, ..., xn] -> [x2, ..., xn, next]
        assert out[start:stop].tolist() == ids[start + 1:stop + 1].tolist()
        assert int(out[stop]) == int(next_ids[i])


def test_shift_input_ids_does_not_modify_its_input():
    ids = torch.tensor([1, 2, 3])
    shift_input_ids(ids, torch.tensor([9]), torch.tensor([2]))
    assert ids.tolist() == [1, 2, 3]


# --- advance_draft_step ---------------------------------------------------------------------

def test_advance_draft_step_docstring_example():
    new_pos, clamped, slots, seq_lens = advance_draft_step(
        torch.tensor([4, 9]), torch.tensor([5, 10], dtype=torch.int32),
        torch.tensor([[3, 7, 1], [2, 5, 6]], dtype=torch.int32), 4, 10)
    assert new_pos.tolist() == [5, 10]
    assert clamped.tolist() == [5, 0]
    assert slots.tolist() == [29, -1]
    assert seq_lens.tolist() == [6, 1]
    assert seq_lens.dtype == torch.int32 and slots.dtype == torch.int64


def naive_advance(positions, seq_lens, block_table, block_size, max_model_len):
    out = ([], [], [], [])
    for i, (p, s) in enumerate(zip(positions, seq_lens)):
        new = p + 1
        if new >= max_model_len:
            row = (new, 0, PADDING_SLOT_ID, 1)
        else:
            slot = int(block_table[i, new // block_size]) * block_size + new % block_size
            row = (new, new, slot, s + 1)
        for lst, v in zip(out, row):
            lst.append(v)
    return out


@FAST
@given(st.data())
def test_advance_draft_step_matches_naive_loop(data):
    batch_size = data.draw(st.integers(1, 6))
    block_size = data.draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = data.draw(st.integers(1, 40))
    num_steps = data.draw(st.integers(1, 4))
    max_blocks = -(-max_model_len // block_size)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    block_table = torch.randint(0, 50, (batch_size, max_blocks), generator=g, dtype=torch.int32)
    # Real rows sit below max_model_len; some run past it during the steps; padding rows of
    # a graph bucket start at or beyond it.
    positions = [data.draw(st.one_of(st.integers(0, max_model_len - 1),
                                     st.integers(max_model_len - 1, max_model_len + 5)))
                 for _ in range(batch_size)]
    seq_lens = [data.draw(st.integers(1, 50)) for _ in range(batch_size)]
    pos_t = torch.tensor(positions)
    sl_t = torch.tensor(seq_lens, dtype=torch.int32)
    for _ in range(num_steps):
        got = advance_draft_step(pos_t, sl_t, block_table, block_size, max_model_len)
        want = naive_advance(positions, seq_lens, block_table, block_size, max_model_len)
        assert [t.tolist() for t in got] == [list(w) for w in want]
        positions, seq_lens = want[0], want[3]
        pos_t, sl_t = got[0], got[3]
    # A row that has run past max_model_len never writes again.
    final = advance_draft_step(pos_t, sl_t, block_table, block_size, max_model_len)
    past = pos_t >= max_model_len - 1
    assert bool((final[2][past] == PADDING_SLOT_ID).all())


# --- prepare_next_token_ids_padded ----------------------------------------------------------

def test_prepare_next_token_ids_padded_docstring_example():
    next_ids, count = prepare_next_token_ids_padded(
        torch.tensor([[5, 7, -1], [-1, -1, -1], [4, 2, 9]]),
        torch.tensor([False, False, True]), torch.tensor([1, 2, 3]), vocab_size=100)
    assert next_ids.tolist() == [7, 2, 3]
    assert count.tolist() == [2, 0, 0]
    assert next_ids.dtype == torch.int64 and count.dtype == torch.int32


def sampled_rows(data, batch_size, k, vocab_size):
    """Rejection-sampler outputs: a prefix of valid tokens, then rejected markers (-1, or
    out-of-vocab placeholders); some rows sampled nothing at all."""
    rows = []
    for _ in range(batch_size):
        n_valid = data.draw(st.integers(0, k + 1))
        valid = [data.draw(st.integers(0, vocab_size - 1)) for _ in range(n_valid)]
        tail = [data.draw(st.sampled_from([-1, vocab_size, vocab_size + 7]))
                for _ in range(k + 1 - n_valid)]
        rows.append(valid + tail)
    return rows


@FAST
@given(st.data())
def test_prepare_next_token_ids_padded_matches_naive_loop(data):
    batch_size = data.draw(st.integers(1, 6))
    k = data.draw(st.integers(0, 4))
    vocab_size = data.draw(st.integers(1, 50))
    rows = sampled_rows(data, batch_size, k, vocab_size)
    discard = [data.draw(st.booleans()) for _ in range(batch_size)]
    backup = [data.draw(st.integers(0, vocab_size - 1)) for _ in range(batch_size)]
    next_ids, count = prepare_next_token_ids_padded(
        torch.tensor(rows), torch.tensor(discard), torch.tensor(backup), vocab_size)
    for i, row in enumerate(rows):
        valid = [t for t in row if 0 <= t < vocab_size]
        if discard[i] or not valid:
            assert (int(next_ids[i]), int(count[i])) == (backup[i], 0)
        else:
            assert (int(next_ids[i]), int(count[i])) == (valid[-1], len(valid))


# --- prepare_inputs_padded ------------------------------------------------------------------

def test_prepare_inputs_padded_docstring_example():
    indices, rejected = prepare_inputs_padded(torch.tensor([0, 3, 4, 8], dtype=torch.int32),
                                              torch.tensor([2, 0, 3]), torch.tensor([1, 1, 4]))
    assert rejected.tolist() == [2, 0, 0]
    assert indices.tolist() == [0, 3, 7]


@FAST
@given(st.data())
def test_prepare_inputs_padded_matches_naive_loop(data):
    batch_size = data.draw(st.integers(1, 6))
    num_drafts, query_lens, valid = [], [], []
    for _ in range(batch_size):
        d = data.draw(st.integers(0, 4))
        num_drafts.append(d)
        # Decodes verify 1 + d tokens; prefill chunks (d = 0) have any length.
        query_lens.append(d + 1 if d else data.draw(st.integers(1, 6)))
        valid.append(data.draw(st.integers(1, d + 1)) if d else data.draw(st.integers(0, 1)))
    qsl = prefix_sum(query_lens)
    indices, rejected = prepare_inputs_padded(torch.tensor(qsl, dtype=torch.int32),
                                              torch.tensor(num_drafts),
                                              torch.tensor(valid, dtype=torch.int32))
    for i in range(batch_size):
        r = num_drafts[i] + 1 - valid[i] if num_drafts[i] else 0
        assert int(rejected[i]) == r
        assert int(indices[i]) == qsl[i + 1] - 1 - r
        assert qsl[i] <= int(indices[i]) < qsl[i + 1]


# --- prepare_inputs_cpu ---------------------------------------------------------------------

def test_prepare_inputs_cpu_docstring_example():
    new_qsl, token_indices = prepare_inputs_cpu(torch.tensor([0, 3, 4, 8], dtype=torch.int32),
                                                torch.tensor([2, 0, 1]))
    assert new_qsl.tolist() == [0, 1, 2, 5]
    assert token_indices.tolist() == [0, 3, 4, 5, 6]


@FAST
@given(st.data())
def test_prepare_inputs_cpu_matches_naive_loop(data):
    query_lens = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=6))
    rejected = [data.draw(st.integers(0, q - 1)) for q in query_lens]
    qsl = prefix_sum(query_lens)
    new_qsl, token_indices = prepare_inputs_cpu(torch.tensor(qsl, dtype=torch.int32),
                                                torch.tensor(rejected))
    kept = []
    for i, (q, r) in enumerate(zip(query_lens, rejected)):
        kept += range(qsl[i], qsl[i] + q - r)
    assert new_qsl.tolist() == prefix_sum([q - r for q, r in zip(query_lens, rejected)])
    assert token_indices.tolist() == kept


def test_prepare_inputs_cpu_rejects_emptying_a_request():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        prepare_inputs_cpu(torch.tensor([0, 2, 3]), torch.tensor([0, 1]))


# --- padded vs unpadded ---------------------------------------------------------------------

@settings(max_examples=80, deadline=None)
@given(st.data())
def test_padded_and_unpadded_paths_pick_the_same_token(data):
    """From one rejection-sampler output, the padded path's sampled index and the unpadded
    path's last kept token are the same token, and the shifted draft inputs agree on every
    kept token."""
    batch_size = data.draw(st.integers(1, 6))
    k = data.draw(st.integers(1, 4))
    vocab_size = 50
    num_drafts, query_lens, rows, discard = [], [], [], []
    for _ in range(batch_size):
        kind = data.draw(st.sampled_from(["decode", "prefill_done", "partial_prefill"]))
        d = data.draw(st.integers(1, k)) if kind == "decode" else 0
        num_drafts.append(d)
        query_lens.append(d + 1 if d else data.draw(st.integers(1, 6)))
        discard.append(kind == "partial_prefill")
        accepted = data.draw(st.integers(0, d))  # drafts accepted, then one emitted token
        n_valid = 0 if kind == "partial_prefill" else accepted + 1
        rows.append([data.draw(st.integers(0, vocab_size - 1)) for _ in range(n_valid)]
                    + [-1] * (k + 1 - n_valid))
    qsl = prefix_sum(query_lens)
    sampled = torch.tensor(rows)
    backup = torch.randint(0, vocab_size, (batch_size,))
    next_ids, valid = prepare_next_token_ids_padded(sampled, torch.tensor(discard), backup,
                                                    vocab_size)
    indices, num_rejected = prepare_inputs_padded(torch.tensor(qsl, dtype=torch.int32),
                                                  torch.tensor(num_drafts), valid)
    # The unpadded path computes the rejections on the host, as the engine does.
    rejected_cpu = torch.tensor([d + 1 - sum(t >= 0 for t in row) if d else 0
                                 for d, row in zip(num_drafts, rows)])
    assert num_rejected.tolist() == rejected_cpu.tolist()
    new_qsl, kept = prepare_inputs_cpu(torch.tensor(qsl, dtype=torch.int32), rejected_cpu)
    token_ids = torch.randint(0, vocab_size, (qsl[-1],))
    last_kept = kept[new_qsl[1:].long() - 1]
    assert indices.tolist() == last_kept.tolist()
    assert torch.equal(token_ids[indices], token_ids[kept][new_qsl[1:].long() - 1])

    padded_ids = shift_input_ids(token_ids, next_ids, indices)
    unpadded_ids = shift_input_ids(token_ids[kept], next_ids, new_qsl[1:].long() - 1)
    assert torch.equal(padded_ids[kept], unpadded_ids)
