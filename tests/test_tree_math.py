"""Tree index math: every function's docstring example, a property test against a naive
per-node loop, the connectivity of dynamic-tree selections, and the refusals."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rocdraft.backends.kv_cache import PADDING_SLOT_ID
from rocdraft.drafter.tree_math import (ancestor_mask, dynamic_tree_num_candidates,
                                        expand_frontier, extend_ancestor_mask, leaf_mask,
                                        node_depths, node_paths, select_frontier, select_tree,
                                        select_tree_batch_budget, tree_positions,
                                        tree_slot_mapping)
from rocdraft.errors import RocdraftError

FAST = settings(max_examples=60, deadline=None)
SEED_PARENTS = [-1, -1, 0, 0, 1]  # (0,), (1,), (0, 0), (0, 1), (1, 0)


def random_parents(data, batch, num_nodes):
    return [[data.draw(st.integers(-1, i - 1)) for i in range(num_nodes)] for _ in range(batch)]


def naive_chain(parents, i):
    """Node i and its ancestors, root excluded, leaf first."""
    chain = []
    while i >= 0:
        chain.append(i)
        i = parents[i]
    return chain


# --- ancestor_mask, node_depths, node_paths, leaf_mask ---------------------------------------

def test_tree_structure_docstring_examples():
    mask = ancestor_mask(torch.tensor(SEED_PARENTS))
    assert mask.dtype == torch.bool
    assert mask.int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                                   [1, 1, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 1]]
    depths = node_depths(torch.tensor([-1, -1, 0, 0, 1, 2]))
    assert depths.tolist() == [1, 1, 2, 2, 2, 3] and depths.dtype == torch.int64
    assert node_paths(torch.tensor(SEED_PARENTS), 2).tolist() == [[0, -1], [1, -1], [0, 2],
                                                                  [0, 3], [1, 4]]
    assert leaf_mask(torch.tensor(SEED_PARENTS)).tolist() == [False, False, True, True, True]


def test_a_chain_is_a_tree_of_one_path():
    chain = torch.arange(-1, 7)  # node i's parent is i - 1
    assert torch.equal(ancestor_mask(chain), torch.ones(9, 9, dtype=torch.bool).tril())
    assert node_depths(chain).tolist() == list(range(1, 9))


@FAST
@given(st.data())
def test_tree_structure_matches_naive_per_node_loop(data):
    batch = data.draw(st.integers(1, 3))
    num_nodes = data.draw(st.integers(1, 20))
    rows = random_parents(data, batch, num_nodes)
    parents = torch.tensor(rows, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))
    mask, depths, leaves = ancestor_mask(parents), node_depths(parents), leaf_mask(parents)
    max_depth = int(depths.max()) + data.draw(st.integers(0, 2))
    paths = node_paths(parents, max_depth)
    assert mask.shape == (batch, num_nodes + 1, num_nodes + 1)
    for b, par in enumerate(rows):
        for i in range(num_nodes):
            chain = naive_chain(par, i)
            want_row = [True] + [j in chain for j in range(num_nodes)]
            assert mask[b, i + 1].tolist() == want_row
            assert int(depths[b, i]) == len(chain)
            assert paths[b, i].tolist() == chain[::-1] + [-1] * (max_depth - len(chain))
            assert bool(leaves[b, i]) == (i not in par)
        assert mask[b, 0].tolist() == [True] + [False] * num_nodes


# --- extend_ancestor_mask ---------------------------------------------------------------------

def test_extend_ancestor_mask_docstring_example():
    mask = extend_ancestor_mask(torch.ones(1, 1, 1, dtype=torch.bool), torch.tensor([[0, -1]]))
    assert mask.dtype == torch.bool
    assert mask.int().tolist() == [[[1, 0, 0], [1, 1, 0], [0, 0, 1]]]


@FAST
@given(st.data())
def test_extend_ancestor_mask_level_by_level_equals_ancestor_mask(data):
    """Growing a tree level by level (each level's parents among the earlier nodes, in any
    order: a dynamic tree's frontier is not sorted by parent) rebuilds the node-only part of
    ancestor_mask of the whole tree."""
    batch = data.draw(st.integers(1, 3))
    widths = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    bfs = data.draw(st.booleans())  # parents in the previous level only (BFS levels)
    rows = [[] for _ in range(batch)]
    mask = torch.zeros(batch, 0, 0, dtype=torch.bool)
    start = prev = 0
    for width in widths:
        level = []
        low = prev if bfs else -1  # the previous level only, or any earlier node or the root
        for b in range(batch):
            level.append([data.draw(st.integers(low, start - 1)) if start else -1
                          for _ in range(width)])
            rows[b] += level[b]
        mask = extend_ancestor_mask(mask, torch.tensor(level))
        prev, start = start, start + width
        assert mask.shape == (batch, start, start)
        assert torch.equal(mask, ancestor_mask(torch.tensor(rows))[:, 1:, 1:])


# --- tree_positions ---------------------------------------------------------------------------

def test_tree_positions_docstring_example():
    context_len, depths = torch.tensor([7, 3]), torch.tensor([[1, 1, 2]])
    assert tree_positions(context_len, depths).tolist() == [[7, 8, 8, 9], [3, 4, 4, 5]]
    assert tree_positions(context_len, depths, 9).tolist() == [[7, 8, 8, 0], [3, 4, 4, 5]]


@FAST
@given(st.data())
def test_tree_positions_match_naive_loop(data):
    batch = data.draw(st.integers(1, 4))
    num_nodes = data.draw(st.integers(1, 8))
    shared = data.draw(st.booleans())
    depths = [[data.draw(st.integers(1, 5)) for _ in range(num_nodes)]
              for _ in range(1 if shared else batch)]
    context = [data.draw(st.integers(0, 30)) for _ in range(batch)]
    max_model_len = data.draw(st.one_of(st.none(), st.integers(1, 40)))
    got = tree_positions(torch.tensor(context, dtype=torch.int32), torch.tensor(depths),
                         max_model_len)
    assert got.dtype == torch.int64
    for b in range(batch):
        row = [context[b]] + [context[b] + d for d in depths[0 if shared else b]]
        if max_model_len is not None:
            row = [p if p < max_model_len else 0 for p in row]
        assert got[b].tolist() == row


# --- tree_slot_mapping ------------------------------------------------------------------------

def test_tree_slot_mapping_docstring_example():
    table = torch.tensor([[3, 7, 1], [2, 5, 6]], dtype=torch.int32)
    context = torch.tensor([6, 8])
    slots = tree_slot_mapping(table, context, 3, 4, 10)
    assert slots.tolist() == [[30, 31, 4], [24, 25, -1]] and slots.dtype == torch.int64
    assert tree_slot_mapping(table, context, torch.tensor([2, 3]), 4, 10,
                             width=3).tolist() == [[30, 31, -1], [24, 25, -1]]


def test_tree_slot_mapping_needs_a_width_for_per_request_counts():
    with pytest.raises(RocdraftError, match=r"width is required when num_new is a tensor "
                                            r"\(got num_new of shape \(1,\)\)"):
        tree_slot_mapping(torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0]),
                          torch.tensor([2]), 4, 8)


@FAST
@given(st.data())
def test_tree_slot_mapping_matches_naive_loop_and_stays_in_its_blocks(data):
    batch = data.draw(st.integers(1, 4))
    block_size = data.draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = data.draw(st.integers(1, 40))
    # Tables usually cover max_model_len; some are narrower (the request's own blocks only).
    max_blocks = max(1, -(-max_model_len // block_size) - data.draw(st.integers(0, 1)))
    width = data.draw(st.integers(1, 10))
    per_request = data.draw(st.booleans())
    num_new = [data.draw(st.integers(0, width)) for _ in range(batch)]
    context = [data.draw(st.integers(0, max_model_len + 3)) for _ in range(batch)]
    # Distinct block ids per request, some negative (unallocated) entries.
    ids = torch.randperm(batch * max_blocks,
                         generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    table = ids.view(batch, max_blocks).to(torch.int32)
    if data.draw(st.booleans()):
        table[:, -1] = -1
    got = tree_slot_mapping(table, torch.tensor(context),
                            torch.tensor(num_new) if per_request else width, block_size,
                            max_model_len, width=width if per_request else None)
    assert got.shape == (batch, width)
    for b in range(batch):
        own = {int(blk) * block_size + o for blk in table[b] if blk >= 0
               for o in range(block_size)}
        for j in range(width):
            idx = context[b] + j
            limit = num_new[b] if per_request else width
            want = PADDING_SLOT_ID
            if j < limit and idx < max_model_len and idx // block_size < max_blocks \
                    and table[b, idx // block_size] >= 0:
                want = int(table[b, idx // block_size]) * block_size + idx % block_size
            assert int(got[b, j]) == want
            assert want == PADDING_SLOT_ID or want in own


# --- dynamic trees: expand_frontier, select_frontier ------------------------------------------

def test_dynamic_tree_num_candidates_docstring_example():
    assert dynamic_tree_num_candidates(5, 4) == 68
    assert dynamic_tree_num_candidates(1, 3) == 3


def test_expand_frontier_docstring_example():
    scores, tokens, slots = expand_frontier(
        torch.tensor([[0.0, -1.0]]), torch.tensor([[[-0.1, -3.0, -0.5], [-2.0, -0.2, -0.7]]]), 2)
    assert torch.allclose(scores, torch.tensor([[-0.1, -0.5, -1.2, -1.7]]))
    assert tokens.tolist() == [[0, 2, 1, 2]] and slots.tolist() == [[0, 0, 1, 1]]
    assert scores.dtype == torch.float32 and tokens.dtype == slots.dtype == torch.int64


def test_select_frontier_docstring_example():
    scores, tokens, index = select_frontier(torch.tensor([[-0.1, -0.5, -1.2, -0.5]]),
                                            torch.tensor([[4, 9, 7, 3]]), 2)
    assert torch.allclose(scores, torch.tensor([[-0.1, -0.5]]))
    assert tokens.tolist() == [[4, 9]] and index.tolist() == [[0, 1]]


@FAST
@given(st.data())
def test_expand_and_select_frontier_match_naive_loop(data):
    batch = data.draw(st.integers(1, 3))
    width = data.draw(st.integers(1, 4))
    vocab = data.draw(st.integers(1, 9))
    top_k = data.draw(st.integers(1, vocab))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    # Continuous log-probs: no ties among a node's children, so the top-k order is unique.
    logprobs = torch.randn(batch, width, vocab, generator=g).log_softmax(-1)
    frontier = -torch.rand(batch, width, generator=g) * 3
    scores, tokens, slots = expand_frontier(frontier, logprobs, top_k)
    for b in range(batch):
        want = []
        for k in range(width):
            children = sorted(range(vocab), key=lambda v: -float(logprobs[b, k, v]))[:top_k]
            want += [(float(frontier[b, k]) + float(logprobs[b, k, v]), v, k) for v in children]
        assert tokens[b].tolist() == [w[1] for w in want]
        assert slots[b].tolist() == [w[2] for w in want]
        assert scores[b].tolist() == pytest.approx([w[0] for w in want], abs=1e-6)
    keep = data.draw(st.integers(1, width * top_k))
    # Quantised scores tie often: ties go to the lower column.
    tied = (scores * 2).round() / 2
    f_scores, f_tokens, f_index = select_frontier(tied, tokens, keep)
    for b in range(batch):
        order = sorted(range(width * top_k), key=lambda j: (-float(tied[b, j]), j))[:keep]
        assert f_index[b].tolist() == order
        assert f_tokens[b].tolist() == [int(tokens[b, j]) for j in order]
        assert f_scores[b].tolist() == [float(tied[b, j]) for j in order]


@pytest.mark.parametrize("top_k, message", [(0, r"top_k 0 is invalid; it must be an int in "
                                                  r"\[1, 3\] \(vocabulary of 3\)"),
                                            (4, r"top_k 4 is invalid.*\[1, 3\]"),
                                            (True, r"top_k True is invalid")])
def test_expand_frontier_refuses_a_bad_top_k(top_k, message):
    with pytest.raises(RocdraftError, match=message):
        expand_frontier(torch.zeros(1, 1), torch.zeros(1, 1, 3), top_k)


def test_select_frontier_refuses_more_than_the_candidates():
    with pytest.raises(RocdraftError, match=r"top_k 5 is invalid.*\[1, 4\] \(4 candidates\)"):
        select_frontier(torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.int64), 5)


# --- dynamic trees: select_tree -----------------------------------------------------------------

def test_select_tree_docstring_example():
    node_ids, parents, depths = select_tree(torch.tensor([[-0.1, -0.5, -0.3, -0.9, -0.2]]),
                                            torch.tensor([[-1, -1, 0, 0, 2]]), 4)
    assert node_ids.tolist() == [[0, 1, 2, 4]]
    assert parents.tolist() == [[-1, -1, 0, 2]]
    assert depths.tolist() == [[1, 1, 2, 3]]


def grow_dynamic_tree(level_logprobs: list[torch.Tensor], top_k: int):
    """The EAGLE-2 growth loop over given per-level child log-probs ([B, 1, V] for level 1,
    [B, top_k, V] after): all candidates' scores, parents (candidate ids) and tokens."""
    batch = level_logprobs[0].shape[0]
    frontier_scores = torch.zeros(batch, 1)
    frontier_ids = torch.full((batch, 1), -1, dtype=torch.int64)
    scores, parents, tokens = [], [], []
    offset = 0
    for logprobs in level_logprobs:
        c_scores, c_tokens, c_slot = expand_frontier(frontier_scores, logprobs, top_k)
        c_parents = frontier_ids.gather(1, c_slot)
        scores.append(c_scores)
        parents.append(c_parents)
        tokens.append(c_tokens)
        frontier_scores, _, index = select_frontier(c_scores, c_tokens, top_k)
        frontier_ids = index + offset
        offset += c_scores.shape[1]
    return torch.cat(scores, 1), torch.cat(parents, 1), torch.cat(tokens, 1)


def naive_select_tree(scores, parents, keep):
    """One request: ids of the best `keep` candidates by (score desc, id asc), in BFS order
    (depth, then the lexicographic path of sibling ranks), their parents and depths."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:keep]
    kept = set(order)
    assert all(parents[i] < 0 or parents[i] in kept for i in order)  # connected
    rank = {}
    for i in order:  # siblings ranked in selection order
        rank[i] = sum(1 for j in order if parents[j] == parents[i] and order.index(j)
                      < order.index(i))

    def path(i):
        return [rank[j] for j in reversed(naive_chain(parents, i))]

    bfs = sorted(order, key=lambda i: (len(path(i)), path(i)))
    new = {i: n for n, i in enumerate(bfs)}
    return bfs, [new[parents[i]] if parents[i] >= 0 else -1 for i in bfs], \
        [len(path(i)) for i in bfs]


# Log-probs on a coarse grid tie often (0 included: a child as likely as its parent's path;
# -inf included: a token the head rules out).
GRID = [0.0, -0.5, -1.0, -1.5, -2.0, -math.inf]


@FAST
@given(st.data())
def test_select_tree_is_connected_and_matches_naive_loop(data):
    batch = data.draw(st.integers(1, 3))
    top_k = data.draw(st.integers(1, 3))
    depth = data.draw(st.integers(1, 4))
    vocab = data.draw(st.integers(top_k, 6))
    levels = []
    for level in range(depth):
        width = 1 if level == 0 else top_k
        values = data.draw(st.lists(st.sampled_from(GRID), min_size=batch * width * vocab,
                                    max_size=batch * width * vocab))
        levels.append(torch.tensor(values).view(batch, width, vocab))
    scores, parents, _ = grow_dynamic_tree(levels, top_k)
    num_cand = dynamic_tree_num_candidates(depth, top_k)
    assert scores.shape == parents.shape == (batch, num_cand)
    keep = data.draw(st.integers(1, num_cand))
    use_counts = data.draw(st.booleans())
    counts = [data.draw(st.integers(0, keep)) if use_counts else keep for _ in range(batch)]
    node_ids, new_parents, depths = select_tree(scores, parents, keep,
                                                torch.tensor(counts) if use_counts else None)
    assert node_ids.shape == new_parents.shape == depths.shape == (batch, keep)
    for b in range(batch):
        s, p = scores[b].tolist(), parents[b].tolist()
        # A child never outranks its parent: its score is no higher and its id is larger.
        assert all(p[i] < i and s[i] <= s[p[i]] for i in range(num_cand) if p[i] >= 0)
        n = counts[b]
        want_ids, want_parents, want_depths = naive_select_tree(s, p, n)
        assert node_ids[b].tolist() == want_ids + [-1] * (keep - n)
        assert new_parents[b].tolist() == want_parents + [-1] * (keep - n)
        assert depths[b].tolist() == want_depths + [0] * (keep - n)
        # The contract's BFS layout: parents come first, depths follow them, and the
        # structure tables agree.
        tree_parents = new_parents[b, :n]
        assert all(-1 <= q < i for i, q in enumerate(tree_parents.tolist()))
        assert node_depths(tree_parents).tolist() == want_depths
        for i, q in enumerate(tree_parents.tolist()):
            assert p[want_ids[i]] == (want_ids[q] if q >= 0 else -1)


def test_select_tree_refuses_a_bad_num_keep():
    for bad in (0, 6, True):
        with pytest.raises(RocdraftError, match=rf"num_keep {bad!r} is invalid; it must be "
                                                r"an int in \[1, 5\]"):
            select_tree(torch.zeros(1, 5), torch.full((1, 5), -1), bad)


# --- batch budget -----------------------------------------------------------------------------

def test_select_tree_batch_budget_docstring_example():
    num = select_tree_batch_budget(torch.tensor([[-0.1, -0.2, -0.3], [-1.0, -2.0, -3.0]]), 4, 1)
    assert num.tolist() == [3, 1] and num.dtype == torch.int64


def test_batch_budget_floor_wins_over_a_small_budget():
    scores = torch.tensor([[-0.1, -0.2], [-5.0, -6.0], [-7.0, -8.0]])
    assert select_tree_batch_budget(scores, 2, 1).tolist() == [1, 1, 1]
    assert select_tree_batch_budget(scores, 0, 0).tolist() == [0, 0, 0]
    assert select_tree_batch_budget(scores, 100, 0, max_per_request=1).tolist() == [1, 1, 1]


def naive_budget(rows, budget, floor, cap):
    counts = [floor] * len(rows)
    pool = []
    for b, row in enumerate(rows):
        ranked = sorted(row, reverse=True)
        pool += [(-v, b, j) for j, v in enumerate(ranked[floor:cap])]
    for _, b, _ in sorted(pool)[:max(budget - floor * len(rows), 0)]:
        counts[b] += 1
    return counts


@FAST
@given(st.data())
def test_batch_budget_matches_naive_loop_and_selects_connected_trees(data):
    batch = data.draw(st.integers(1, 4))
    top_k = data.draw(st.integers(1, 3))
    depth = data.draw(st.integers(1, 3))
    vocab = data.draw(st.integers(top_k, 5))
    levels = [torch.tensor(data.draw(st.lists(st.sampled_from(GRID[:-1]),
                                              min_size=batch * (1 if d == 0 else top_k) * vocab,
                                              max_size=batch * (1 if d == 0 else top_k) * vocab)))
              .view(batch, 1 if d == 0 else top_k, vocab) for d in range(depth)]
    scores, parents, _ = grow_dynamic_tree(levels, top_k)
    num_cand = scores.shape[1]
    cap = data.draw(st.integers(1, num_cand))
    floor = data.draw(st.integers(0, cap))
    budget = data.draw(st.integers(0, batch * num_cand + 2))
    num = select_tree_batch_budget(scores, budget, floor, cap)
    assert num.tolist() == naive_budget(scores.tolist(), budget, floor, cap)
    assert int(num.sum()) == max(floor * batch, min(budget, cap * batch))
    # Each request's share is the top of its own order, so its tree is connected.
    node_ids, new_parents, _ = select_tree(scores, parents, cap, num)
    for b in range(batch):
        n = int(num[b])
        assert all(-1 <= q < i for i, q in enumerate(new_parents[b, :n].tolist()))
        assert (node_ids[b, n:] == -1).all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget_nodes=-1, min_per_request=0), r"budget_nodes -1 is invalid; it must be an "
                                               r"int >= 0"),
    (dict(budget_nodes=4, min_per_request=-1), r"min_per_request -1 is invalid; it must be "
                                               r"an int in \[0, 3\]"),
    (dict(budget_nodes=4, min_per_request=3, max_per_request=2),
     r"min_per_request 3 is invalid; it must be an int in \[0, 2\]"),
    (dict(budget_nodes=4, min_per_request=0, max_per_request=4),
     r"max_per_request 4 is invalid; it must be an int in \[1, 3\]"),
])
def test_batch_budget_refusals(kwargs, message):
    with pytest.raises(RocdraftError, match=message):
        select_tree_batch_budget(torch.zeros(2, 3), **kwargs)


# --- sync-free ----------------------------------------------------------------------------------

def test_every_function_runs_on_meta_tensors_so_none_reads_a_value():
    """Meta tensors have shapes but no data: any host read (.item(), .tolist(), nonzero,
    boolean indexing, a data-dependent shape) would raise, so this proves sync-freedom."""
    meta = dict(device="meta")
    parents = torch.empty(2, 7, dtype=torch.int64, **meta)
    assert ancestor_mask(parents).shape == (2, 8, 8)
    assert extend_ancestor_mask(torch.empty(2, 7, 7, dtype=torch.bool, **meta),
                                torch.empty(2, 3, dtype=torch.int64, **meta)).shape == (2, 10, 10)
    depths = node_depths(parents)
    assert node_paths(parents, 3).shape == (2, 7, 3) and leaf_mask(parents).shape == (2, 7)
    context = torch.empty(2, dtype=torch.int64, **meta)
    assert tree_positions(context, depths, 9).shape == (2, 8)
    table = torch.empty(2, 4, dtype=torch.int32, **meta)
    assert tree_slot_mapping(table, context, context, 4, 16, width=8).shape == (2, 8)
    scores, tokens, _ = expand_frontier(torch.empty(2, 1, **meta),
                                        torch.empty(2, 1, 10, **meta), 3)
    assert select_frontier(scores, tokens, 3)[0].shape == (2, 3)
    all_scores = torch.empty(2, 21, **meta)
    all_parents = torch.empty(2, 21, dtype=torch.int64, **meta)
    assert all(t.shape == (2, 8) for t in select_tree(all_scores, all_parents, 8, context))
    assert select_tree_batch_budget(all_scores, 10, 2, 8).shape == (2,)
