"""Tree-step index math (drafter/tree_index.py): every docstring example, property tests against
naive per-node loops (verification mask, accepted-path-first order, drafting levels and the
max_model_len LIVE/DEAD rule), and sync-freedom on meta tensors."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rocdraft.backends.kv_cache import PADDING_SLOT_ID
from rocdraft.drafter.tree_index import (accepted_first_order, host_depths, level_inputs,
                                         level_schedule, verify_tree_mask)

FAST = settings(max_examples=60, deadline=None)


def random_parents(data, num_nodes):
    return [data.draw(st.integers(-1, i - 1)) for i in range(num_nodes)]


def naive_ancestors(parents, i):
    """Node i and its ancestors (root excluded), leaf first."""
    chain = []
    while i >= 0:
        chain.append(i)
        i = parents[i]
    return chain


# --- host_depths ------------------------------------------------------------------------------

def test_host_depths_docstring_example():
    assert host_depths([-1, -1, 0, 0, 1, 2]) == [1, 1, 2, 2, 2, 3]
    assert host_depths([]) == []


@FAST
@given(st.data())
def test_host_depths_match_naive_loop(data):
    parents = random_parents(data, data.draw(st.integers(1, 20)))
    assert host_depths(parents) == [len(naive_ancestors(parents, i))
                                    for i in range(len(parents))]


# --- verify_tree_mask -------------------------------------------------------------------------

def test_verify_tree_mask_docstring_example():
    mask = verify_tree_mask([[-1, 0], []], 3)
    assert mask.dtype == torch.bool and mask.shape == (2, 3, 3)
    assert mask[0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert bool(mask[1].all())


def naive_verify_mask(parents, width):
    """One request: the S x S rows, walking each node's parents."""
    n = len(parents)
    offset = width - n - 1
    rows = [[True] * width for _ in range(width)]
    if not parents:
        return rows
    for a in range(n + 1):  # 0 = root, i + 1 = node i
        seen = {0} | ({j + 1 for j in naive_ancestors(parents, a - 1)} if a else set())
        for b in range(n + 1):
            rows[offset + a][offset + b] = b in seen
    return rows


@FAST
@given(st.data())
def test_verify_tree_mask_matches_naive_per_node_loop(data):
    batch = data.draw(st.integers(1, 4))
    trees = [random_parents(data, data.draw(st.integers(0, 9))) for _ in range(batch)]
    width = max(len(p) for p in trees) + 1 + data.draw(st.integers(0, 3))
    mask = verify_tree_mask(trees, width)
    assert mask.shape == (batch, width, width) and mask.dtype == torch.bool
    for b, parents in enumerate(trees):
        assert mask[b].tolist() == naive_verify_mask(parents, width)


# --- accepted_first_order ---------------------------------------------------------------------

def test_accepted_first_order_docstring_example():
    perm = accepted_first_order(torch.tensor([0, 4, 6]), torch.tensor([[1, -1], [-1, -1]]),
                                torch.tensor([1, 0]), 6)
    assert perm.tolist() == [0, 2, 1, 3, 4, 5] and perm.dtype == torch.int64


def random_path(data, parents):
    """A root-to-node path of the tree (node indices by depth), possibly empty."""
    if not parents or data.draw(st.integers(0, 3)) == 0:
        return []
    leaf = data.draw(st.integers(0, len(parents) - 1))
    return naive_ancestors(parents, leaf)[::-1]


@FAST
@given(st.data())
def test_accepted_first_order_matches_naive_loop(data):
    batch = data.draw(st.integers(1, 4))
    depth = data.draw(st.integers(1, 5))
    qsl, paths, is_tree = [0], [], []
    for _ in range(batch):
        tree = data.draw(st.booleans())
        if tree:  # a tree request's segment: the root then its nodes
            parents = random_parents(data, data.draw(st.integers(0, 7)))
            path = random_path(data, parents)[:depth]
            size = 1 + len(parents)
        else:  # a prefill chunk or a chain request: nothing accepted, order kept
            path, size = [], data.draw(st.integers(1, 6))
        qsl.append(qsl[-1] + size)
        paths.append(path)
        is_tree.append(tree)
    pad = data.draw(st.integers(0, 3))  # graph-padding tokens after the last request
    num_tokens = qsl[-1] + pad
    accepted = torch.tensor([p + [-1] * (depth - len(p)) for p in paths])
    num_accepted = torch.tensor([len(p) for p in paths])
    perm = accepted_first_order(torch.tensor(qsl, dtype=torch.int32), accepted, num_accepted,
                                num_tokens)
    assert perm.dtype == torch.int64 and sorted(perm.tolist()) == list(range(num_tokens))
    want = []
    for b in range(batch):
        segment = list(range(qsl[b], qsl[b + 1]))
        first = [segment[0]] + [segment[1 + n] for n in paths[b]]
        want += first + [t for t in segment if t not in first]
        if not paths[b]:  # nothing accepted (every non-tree segment): unchanged
            assert perm[qsl[b]:qsl[b + 1]].tolist() == segment
    want += list(range(qsl[-1], num_tokens))
    assert perm.tolist() == want


# --- level_inputs / level_schedule --------------------------------------------------------------

DOC_TABLE = torch.tensor([[5, 6, 7], [1, 2, 3]], dtype=torch.int32)


def test_level_inputs_docstring_example():
    positions, slots, seq_lens = level_inputs(torch.tensor([3, 8]), 2, 4, 2, DOC_TABLE, 4, 12)
    assert positions.tolist() == [[5, 5], [0, 0]] and positions.dtype == torch.int64
    assert slots.tolist() == [[26, 27], [-1, -1]] and slots.dtype == torch.int64
    assert seq_lens.tolist() == [8, 4] and seq_lens.dtype == torch.int32


def test_level_schedule_docstring_example():
    positions, slots, seq_lens = level_schedule(torch.tensor([3, 8]), (2, 4), DOC_TABLE, 4, 12)
    assert positions.tolist() == [[4, 4, 5, 5], [9, 9, 0, 0]]
    assert slots.tolist() == [[24, 25, 26, 27], [13, 14, -1, -1]]
    assert seq_lens.tolist() == [[6, 8], [11, 4]] and seq_lens.dtype == torch.int32


def naive_level(p, start, end, depth, table_row, block_size, max_model_len):
    """One request, one level: the per-node rule (module docstring)."""
    live = p + 1 + end <= max_model_len
    positions, slots = [], []
    for f in range(start, end):
        index = p + 1 + f
        positions.append(p + depth if live else 0)
        block = table_row[index // block_size] if live and index // block_size < len(table_row) \
            else -1
        slots.append(block * block_size + index % block_size if live and block >= 0
                     else PADDING_SLOT_ID)
    return positions, slots, (p + 1 + end if live else end)


@FAST
@given(st.data())
def test_level_schedule_equals_level_inputs_and_the_naive_per_node_rule(data):
    batch = data.draw(st.integers(1, 4))
    block_size = data.draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = data.draw(st.integers(4, 48))
    num_levels = data.draw(st.integers(1, 4))
    widths = [data.draw(st.integers(1, 4)) for _ in range(num_levels)]
    level_ends = tuple(sum(widths[:d + 1]) for d in range(num_levels))
    # P near the end of the model: some levels live, some dead, some requests all dead.
    roots = [data.draw(st.integers(max(0, max_model_len - level_ends[-1] - 3),
                                   max_model_len - 1)) for _ in range(batch)]
    max_blocks = -(-max_model_len // block_size)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    table = torch.randperm(batch * max_blocks + 3, generator=g)[:batch * max_blocks]
    table = table.view(batch, max_blocks).to(torch.int32)
    for b in range(batch):  # unallocated tail entries (-1)
        cut = data.draw(st.integers(0, max_blocks))
        table[b, cut:] = -1
    p = torch.tensor(roots, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))
    positions, slots, seq_lens = level_schedule(p, level_ends, table, block_size, max_model_len)
    assert positions.shape == slots.shape == (batch, level_ends[-1])
    assert seq_lens.shape == (batch, num_levels) and seq_lens.dtype == torch.int32
    for d in range(1, num_levels + 1):
        start, end = ((0,) + level_ends)[d - 1], level_ends[d - 1]
        lp, ls, lq = level_inputs(p, start, end, d, table, block_size, max_model_len)
        assert torch.equal(lp, positions[:, start:end])
        assert torch.equal(ls, slots[:, start:end])
        assert torch.equal(lq, seq_lens[:, d - 1])
        for b in range(batch):
            want_pos, want_slots, want_len = naive_level(roots[b], start, end, d,
                                                         table[b].tolist(), block_size,
                                                         max_model_len)
            assert lp[b].tolist() == want_pos
            assert ls[b].tolist() == want_slots
            assert int(lq[b]) == want_len
            # A written slot is one of the request's own blocks.
            own = {int(k) for k in table[b] if k >= 0}
            assert all(s == PADDING_SLOT_ID or s // block_size in own for s in want_slots)


# --- sync-free ----------------------------------------------------------------------------------

def test_device_functions_run_on_meta_tensors_so_none_reads_a_value():
    """Meta tensors have no data: a host read (.item(), .tolist(), nonzero, a data-dependent
    shape) would raise, so running on them proves sync-freedom."""
    meta = dict(device="meta")
    qsl = torch.empty(4, dtype=torch.int32, **meta)
    accepted = torch.empty(3, 5, dtype=torch.int64, **meta)
    perm = accepted_first_order(qsl, accepted, torch.empty(3, dtype=torch.int64, **meta), 17)
    assert perm.shape == (17,) and perm.dtype == torch.int64
    roots = torch.empty(3, dtype=torch.int64, **meta)
    table = torch.empty(3, 6, dtype=torch.int32, **meta)
    shapes = [t.shape for t in level_inputs(roots, 2, 6, 2, table, 4, 24)]
    assert shapes == [(3, 4), (3, 4), (3,)]
    shapes = [t.shape for t in level_schedule(roots, (2, 6, 7), table, 4, 24)]
    assert shapes == [(3, 7), (3, 7), (3, 3)]


@pytest.mark.parametrize("level_ends", [(1,), (4, 8, 12)])
def test_level_schedule_has_no_host_reads(level_ends):
    """The same on real tensors: Tensor.tolist / item are refused inside the call."""
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "item")}

    def refuse(*_args, **_kwargs):
        raise AssertionError("host read inside a sync-free function")

    table = torch.arange(12, dtype=torch.int32).view(2, 6)
    try:
        for name in saved:
            setattr(torch.Tensor, name, refuse)
        level_schedule(torch.tensor([3, 20]), level_ends, table, 4, 24)
        accepted_first_order(torch.tensor([0, 3, 5]), torch.tensor([[0, 1], [-1, -1]]),
                             torch.tensor([2, 0]), 6)
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
