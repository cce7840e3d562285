"""build_step_batch: token ids, positions, query_start_loc, seq_lens, block table, slot
mapping, sampling indices and backup tokens of one step, on hand-made scheduler output and
(property test) against a naive per-token loop."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rocdraft.config import SamplingParams
from rocdraft.core.request import Request, Status
from rocdraft.core.scheduler import ScheduledRequest
from rocdraft.core.step_batch import UniformShape, build_step_batch, padding_only_batch
from rocdraft.core.step_inputs import StepInputBuffers

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


# --- tree verification rows ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from checkpoints import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("tree_rows") / "target", kind="llama"))


def _logits(model, builder, scheduled, caches, max_blocks):
    batch = build_step_batch(scheduled, max_blocks, BLOCK_SIZE, "cpu")
    out = model(batch.input_ids, batch.positions, caches, builder.build(batch.common))
    return batch, model.compute_logits(out.hidden_states)  # [num_tokens, vocab]


def test_tree_rows_get_depth_positions_sequential_slots_and_a_per_request_mask():
    req = make_request(0, [1, 2, 3], [4], 3, [6, 7], drafts=[50, 51, 52])
    req.spec_parents = [-1, -1, 0]
    chunk = make_request(1, [9, 9], [], 0, [8])  # a prompt chunk beside the tree
    batch = build_step_batch([ScheduledRequest(req, 4, 3), ScheduledRequest(chunk, 2, 0)],
                             max_blocks_per_seq=2, block_size=BLOCK_SIZE, device="cpu")
    assert batch.input_ids.tolist() == [4, 50, 51, 52, 9, 9]
    assert batch.positions.tolist() == [3, 4, 4, 5, 0, 1]  # root L, nodes L + depth
    assert batch.common.slot_mapping.tolist() == [27, 28, 29, 30, 32, 33]  # sequence order
    assert batch.draft_parents.tolist() == [[-1, -1, 0], [-1, -1, -1]]
    mask = batch.common.spec_mask  # [2, 4, 4]: root + 3 nodes; the chunk sees all
    assert mask[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert mask[1].all()


def test_a_chain_beside_a_tree_gets_one_child_per_level():
    """Tree mode may draft a chain for some requests (rocdraft/spec_decode/draft_shape.py) while another
    still holds a tree from an earlier step: the chain rides along as parents -1, 0, 1."""
    tree = make_request(0, [1, 2, 3], [4], 3, [6, 7], drafts=[50, 51, 52])
    tree.spec_parents = [-1, -1, 0]
    chain = make_request(1, [5, 6], [7], 2, [8], drafts=[60, 61])
    batch = build_step_batch([ScheduledRequest(tree, 4, 3), ScheduledRequest(chain, 3, 2)],
                             max_blocks_per_seq=2, block_size=BLOCK_SIZE, device="cpu")
    assert batch.positions.tolist() == [3, 4, 4, 5, 2, 3, 4]  # the chain: L, L + 1, L + 2
    assert batch.draft_parents.tolist() == [[-1, -1, 0], [-1, 0, -1]]
    # Its 3 queries use the last 3 mask rows over the last 4 keys: causal.
    assert batch.common.spec_mask[1, 1:].int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 0],
                                                             [1, 1, 1, 1]]


def test_tree_verification_logits_equal_each_path_run_alone(tiny_target, attention_backend):
    """A verify step with two trees (different context lengths, one non-uniform) and a
    3-token prompt chunk (shorter than the mask) in one target forward: each node's logits
    equal those of its root-to-node path run alone as an ordinary causal prefill, so the
    mask, the RoPE positions (L + depth) and the slots are right on this backend."""
    from rocdraft.backends.kv_cache import allocate_kv_cache
    from rocdraft.backends.registry import get_backend
    from rocdraft.models.llama import load_target

    backend = get_backend(attention_backend)
    model = load_target(tiny_target, torch.float32, "cpu", backend)
    builder = backend.builder_cls("cpu")
    layers, heads, head_dim = model.kv_cache_spec()
    max_blocks = 6
    caches = allocate_kv_cache(layers, 64, BLOCK_SIZE, heads, head_dim, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    trees = [([-1, -1, 0, 1, 2], 5), ([-1, 0, 0], 9)]  # (parents, context length)
    requests, blocks = [], iter(range(64))
    for rid, (parents, length) in enumerate(trees):
        ctx = torch.randint(3, vocab, (length + 1,), generator=gen).tolist()
        req = make_request(rid, ctx[:-1], ctx[-1:], 0, [next(blocks) for _ in range(4)])
        requests.append(req)
    _logits(model, builder, [ScheduledRequest(r, len(r.prompt_token_ids), 0) for r in requests],
            caches, max_blocks)  # cache the contexts
    scheduled = []
    for req, (parents, _) in zip(requests, trees):
        req.num_computed_tokens = len(req.prompt_token_ids)
        req.spec_token_ids = torch.randint(3, vocab, (len(parents),), generator=gen).tolist()
        req.spec_parents = list(parents)
        scheduled.append(ScheduledRequest(req, 1 + len(parents), len(parents)))
    chunk = make_request(9, [5, 6, 7, 8, 9], [], 0, [next(blocks) for _ in range(2)])
    scheduled.append(ScheduledRequest(chunk, 3, 0))
    batch, logits = _logits(model, builder, scheduled, caches, max_blocks)

    def alone(tokens: list[int]) -> torch.Tensor:
        fresh = make_request(99, tokens, [], 0, [next(blocks) for _ in range(4)])
        _, rows = _logits(model, builder, [ScheduledRequest(fresh, len(tokens), 0)], caches,
                          max_blocks)
        return rows[-1]

    tol = dict(atol=1e-4, rtol=1e-4)
    for row, (req, (parents, _)) in enumerate(zip(requests, trees)):
        root_seq = req.prompt_token_ids + req.output_token_ids
        rows = logits[batch.sample_indices[row, :len(parents) + 1]]
        torch.testing.assert_close(rows[0], alone(root_seq), **tol)
        for node in range(len(parents)):
            path, at = [], node
            while at >= 0:
                path.insert(0, req.spec_token_ids[at])
                at = parents[at]
            torch.testing.assert_close(rows[node + 1], alone(root_seq + path), **tol)
    torch.testing.assert_close(logits[batch.sample_indices[2, 0]], alone([5, 6, 7]), **tol)


def _padded_views(batch) -> dict:
    """(data_ptr, shape) of every padded input a captured target forward reads."""
    padded, common = batch.padded, batch.padded.common
    tensors = {"input_ids": padded.input_ids, "positions": padded.positions,
               "sample_indices": padded.sample_indices,
               "query_start_loc": common.query_start_loc, "seq_lens": common.seq_lens,
               "block_table": common.block_table, "slot_mapping": common.slot_mapping,
               "spec_mask": common.spec_mask}
    return {name: None if t is None else (t.data_ptr(), tuple(t.shape))
            for name, t in tensors.items()}


@pytest.mark.parametrize("kind", ["decode", "chain", "tree"])
def test_padding_only_batch_lays_out_like_a_real_batch_of_its_key(kind):
    """A target forward captured at start-up on padding rows only replays real batches:
    the padding-only batch of a (bucket, shape) puts every input at the address and shape
    a real batch of that key does, writes no slot, and keeps the key's host integers."""
    uploader = StepInputBuffers("cpu", 1 << 16)
    rows = []
    for rid in range(3):
        drafts = {"decode": [], "chain": [50, 51], "tree": [50, 51, 52]}[kind]
        req = make_request(rid, [1, 2, 3], [4], 3, [6 + rid, 9], drafts=drafts)
        if kind == "tree":
            req.spec_parents = [-1, -1, 0]
        rows.append(ScheduledRequest(req, 1 + len(drafts), len(drafts)))
    shape = {"decode": UniformShape(1, 0), "chain": UniformShape(3, 2),
             "tree": UniformShape(4, 3, tree_mask=True)}[kind]
    real = build_step_batch(rows, 3, BLOCK_SIZE, "cpu", uploader, pad_to=4)
    real_views = _padded_views(real)
    empty = padding_only_batch(shape, 4, 3, "cpu", uploader)
    assert _padded_views(empty) == real_views
    assert (empty.padded.common.max_query_len, empty.max_drafts) == \
        (real.padded.common.max_query_len, real.max_drafts)
    assert empty.padded.common.num_reqs == 4 and empty.common.num_reqs == 0
    assert (empty.padded.common.slot_mapping == -1).all()
    assert (empty.padded.common.block_table == -1).all()


def test_uniform_shape_and_padding_only_batch_refuse_bad_input():
    with pytest.raises(ValueError, match="num_drafts 1, query_len 1"):
        UniformShape(1, 1)
    with pytest.raises(ValueError, match="branching tree"):
        UniformShape(2, 1, tree_mask=True)
    with pytest.raises(ValueError, match="empty_shape goes with an empty padded batch"):
        build_step_batch(three_kinds(), 3, BLOCK_SIZE, "cpu", pad_to=4,
                         empty_shape=UniformShape(1, 0))
    with pytest.raises(ValueError, match="empty_shape goes with"):
        build_step_batch([], 3, BLOCK_SIZE, "cpu", StepInputBuffers("cpu", 4096), pad_to=4)
