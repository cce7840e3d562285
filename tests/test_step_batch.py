"""build_step_batch: token ids, positions, query_start_loc, seq_lens, block table, slot
mapping, sampling indices and backup tokens of one step, on hand-made scheduler output and
(property test) against a naive per-token loop."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rocdraft.config import SamplingParams
from rocdraft.request import Request, Status
from rocdraft.scheduler import ScheduledRequest
from rocdraft.step_batch import build_step_batch

BLOCK_SIZE = 4


def make_request(rid: int, prompt: list[int], output: list[int], num_computed: int,
                 block_ids: list[int], drafts: list[int] = ()) -> Request:
    req = Request(rid, list(prompt), SamplingParams(temperature=0.0), eos_token_ids=(2,))
    req.output_token_ids = list(output)
    req.num_computed_tokens = num_computed
    req.block_ids = list(block_ids)
    req.spec_token_ids = list(drafts)
    req.status = Status.RUNNING
    return req


def three_kinds() -> list[ScheduledRequest]:
    """Row 0: prefill chunk (prompt positions 2..4 of 7); row 1: decode verifying 2 drafts;
    row 2: decode without drafts."""
    prefill = make_request(0, [10, 11, 12, 13, 14, 15, 16], [], 2, [5, 2])
    decode2 = make_request(1, [20, 21, 22], [23], 3, [7, 0], drafts=[30, 31])
    decode0 = make_request(2, [40], [41, 42], 2, [9])
    return [ScheduledRequest(prefill, 3, 0), ScheduledRequest(decode2, 3, 2),
            ScheduledRequest(decode0, 1, 0)]


def test_three_kinds_of_rows():
    batch = build_step_batch(three_kinds(), max_blocks_per_seq=3, block_size=BLOCK_SIZE,
                             device="cpu")
    #            prefill chunk | last sampled + 2 drafts | last sampled
    assert batch.input_ids.tolist() == [12, 13, 14, 23, 30, 31, 42]
    assert batch.input_ids.dtype == torch.long
    assert batch.positions.tolist() == [2, 3, 4, 3, 4, 5, 2]
    assert batch.positions.dtype == torch.long
    common = batch.common
    assert common.query_start_loc.tolist() == [0, 3, 6, 7]
    assert common.query_start_loc_cpu.tolist() == [0, 3, 6, 7]
    assert common.seq_lens.tolist() == [5, 6, 3]
    assert common.num_reqs == 3 and common.num_actual_tokens == 7
    assert common.max_query_len == 3 and common.max_seq_len == 6
    # Unallocated entries are -1.
    assert common.block_table.tolist() == [[5, 2, -1], [7, 0, -1], [9, -1, -1]]
    assert common.block_table.dtype == torch.int32
    # slot = block_table[row, pos // 4] * 4 + pos % 4
    assert common.slot_mapping.tolist() == [22, 23, 8, 31, 0, 1, 38]
    assert common.slot_mapping.dtype == torch.int64
    # The last d + 1 tokens of each row, padded by repeating the last one.
    assert batch.sample_indices.tolist() == [[2, 2, 2], [3, 4, 5], [6, 6, 6]]
    assert batch.max_drafts == 2
    assert batch.draft_token_ids.tolist() == [[0, 0], [30, 31], [0, 0]]
    assert batch.num_draft_tokens.tolist() == [0, 2, 0]
    assert batch.num_draft_tokens_cpu == [0, 2, 0]
    # The prefill chunk stops short of the prompt's end: it samples nothing yet, and its
    # backup next token is the next prompt token (position 5 -> 15).
    assert batch.samples == [False, True, True]
    assert batch.backup_next_token_ids.tolist() == [15, 0, 0]


def test_no_drafts_gives_one_sample_column():
    rows = three_kinds()
    rows[1] = ScheduledRequest(make_request(1, [20, 21, 22], [23], 3, [7]), 1, 0)
    batch = build_step_batch(rows, max_blocks_per_seq=2, block_size=BLOCK_SIZE, device="cpu")
    assert batch.max_drafts == 0
    assert batch.draft_token_ids.shape == (3, 0)
    assert batch.sample_indices.tolist() == [[2], [3], [4]]
    assert batch.input_ids.tolist() == [12, 13, 14, 23, 42]
    assert batch.common.block_table.tolist() == [[5, 2], [7, -1], [9, -1]]


def test_prefill_that_reaches_the_prompt_end_samples():
    req = make_request(0, [10, 11, 12, 13, 14], [], 3, [1, 6])
    batch = build_step_batch([ScheduledRequest(req, 2, 0)], max_blocks_per_seq=4,
                             block_size=BLOCK_SIZE, device="cpu")
    assert batch.input_ids.tolist() == [13, 14]
    assert batch.positions.tolist() == [3, 4]
    assert batch.common.slot_mapping.tolist() == [7, 24]
    assert batch.samples == [True]
    assert batch.backup_next_token_ids.tolist() == [0]
    assert batch.sample_indices.tolist() == [[1]]


def test_drafts_beyond_num_draft_tokens_are_ignored():
    """Only the first ``num_draft_tokens`` drafts are scheduled (the token budget may cut)."""
    req = make_request(0, [20, 21], [22], 2, [3], drafts=[30, 31, 32])
    batch = build_step_batch([ScheduledRequest(req, 2, 1)], max_blocks_per_seq=2,
                             block_size=BLOCK_SIZE, device="cpu")
    assert batch.input_ids.tolist() == [22, 30]
    assert batch.draft_token_ids.tolist() == [[30]]
    assert batch.sample_indices.tolist() == [[0, 1]]
    assert batch.samples == [True]


def test_recomputed_request_after_preemption():
    """A preempted request recomputes prompt + generated tokens as one prefill."""
    req = make_request(0, [10, 11, 12], [13, 14], 0, [4, 8])
    batch = build_step_batch([ScheduledRequest(req, 5, 0)], max_blocks_per_seq=2,
                             block_size=BLOCK_SIZE, device="cpu")
    assert batch.input_ids.tolist() == [10, 11, 12, 13, 14]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4]
    assert batch.common.slot_mapping.tolist() == [16, 17, 18, 19, 32]
    assert batch.samples == [True]
    assert batch.sample_indices.tolist() == [[4]]


@st.composite
def scheduled_batches(draw):
    num_rows = draw(st.integers(1, 5))
    pool = list(range(64))
    pool = draw(st.permutations(pool))
    rows, next_block = [], 0
    for rid in range(num_rows):
        prompt = draw(st.lists(st.integers(3, 150), min_size=1, max_size=12))
        decode = draw(st.booleans())
        if decode:
            output = draw(st.lists(st.integers(3, 150), min_size=1, max_size=4))
            drafts = draw(st.lists(st.integers(3, 150), max_size=4))
            num_computed = len(prompt) + len(output) - 1
            d = draw(st.integers(0, len(drafts)))
            n = 1 + d
        else:
            output, drafts, d = [], [], 0
            num_computed = draw(st.integers(0, len(prompt) - 1))
            n = draw(st.integers(1, len(prompt) - num_computed))
        num_blocks = -(-(num_computed + n) // BLOCK_SIZE)
        blocks = pool[next_block:next_block + num_blocks]
        next_block += num_blocks
        req = make_request(rid, prompt, output, num_computed, blocks, drafts)
        rows.append(ScheduledRequest(req, n, d))
    return rows


@settings(max_examples=60, deadline=None)
@given(scheduled_batches())
def test_matches_naive_loop(rows):
    max_blocks = 6
    batch = build_step_batch(rows, max_blocks, BLOCK_SIZE, "cpu")
    max_drafts = max(r.num_draft_tokens for r in rows)
    ids, positions, slots, qsl, seq_lens, samples, backups, sample_rows = \
        [], [], [], [0], [], [], [], []
    for item in rows:
        req, n, d = item.request, item.num_new_tokens, item.num_draft_tokens
        start = req.num_computed_tokens
        for i in range(n):
            pos = start + i
            ids.append(req.all_token_ids[pos] if i < n - d else req.spec_token_ids[i - (n - d)])
            positions.append(pos)
            slots.append(req.block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        reaches_end = start + n - d == req.num_tokens
        samples.append(reaches_end)
        backups.append(0 if reaches_end else req.all_token_ids[start + n])
        last = qsl[-1] - 1
        verify = list(range(last - d, last + 1))
        sample_rows.append(verify + [last] * (max_drafts - d))
        table_row = req.block_ids + [-1] * (max_blocks - len(req.block_ids))
        assert batch.common.block_table[len(qsl) - 2].tolist() == table_row
    assert batch.input_ids.tolist() == ids
    assert batch.positions.tolist() == positions
    assert batch.common.slot_mapping.tolist() == slots
    assert batch.common.query_start_loc.tolist() == qsl
    assert batch.common.seq_lens.tolist() == seq_lens
    assert batch.samples == samples
    assert batch.backup_next_token_ids.tolist() == backups
    assert batch.sample_indices.tolist() == sample_rows
    assert batch.draft_token_ids.tolist() == [
        r.request.spec_token_ids[:r.num_draft_tokens] + [0] * (max_drafts - r.num_draft_tokens)
        for r in rows]
    # Every verified position's token id is the one the sample index points at.
    for row, item in enumerate(rows):
        d = item.num_draft_tokens
        verified = batch.input_ids[batch.sample_indices[row, 1:d + 1]].tolist()
        assert verified == item.request.spec_token_ids[:d]


def test_ops_per_step_do_not_grow_with_the_batch():
    """Block table and slots are built from host ints: the tensor ops of one step are the
    same for 1 and 16 decode requests (the old per-request block-table copies grew with B)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    def ops(batch_size):
        rows = [ScheduledRequest(make_request(i, [20, 21, 22], [23, 24], 4, [i, 20 + i],
                                              drafts=[30, 31]), 3, 2)
                for i in range(batch_size)]
        with Counter() as counter:
            build_step_batch(rows, max_blocks_per_seq=3, block_size=BLOCK_SIZE, device="cpu")
        return counter.n

    assert ops(1) == ops(16)
