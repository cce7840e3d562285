"""Static token trees: parsing, every refusal with its message, and the tables of StaticTree
against a naive per-node computation on random trees (EAGLE's non-uniform tree included)."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rocdraft.drafter.tree_spec import (EAGLE_DEFAULT_TREE, UNIFORM_TREE_2X2, StaticTree,
                                        parse_token_tree)
from rocdraft.errors import RocdraftError

FAST = settings(max_examples=60, deadline=None)
SEED_EXAMPLE = "[(0,), (1,), (0, 0), (0, 1), (1, 0)]"


# --- parse_token_tree -----------------------------------------------------------------------

def test_parse_seed_string_format():
    assert parse_token_tree(SEED_EXAMPLE) == ((0,), (1,), (0, 0), (0, 1), (1, 0))


def test_parse_docstring_example_resorts_within_a_depth_to_bfs_order():
    assert parse_token_tree("[(1,), (0,), (0, 1), (0, 0)]") == ((0,), (1,), (0, 0), (0, 1))


def test_parse_accepts_parsed_nodes_and_eagle_lists():
    assert parse_token_tree([(0,), (0, 0)]) == ((0,), (0, 0))
    assert parse_token_tree([[0], [1], [0, 0]]) == ((0,), (1,), (0, 0))
    assert parse_token_tree("[[0], [0, 0]]", max_depth=2) == ((0,), (0, 0))


def test_parse_allows_rank_gaps():
    # A node may skip ranks (top-3 at the root, only ranks 0 and 2 kept).
    assert parse_token_tree("[(0,), (2,)]") == ((0,), (2,))


@pytest.mark.parametrize("text, message", [
    ("[(0,), (1,)", "'[(0,), (1,)' is not a Python literal"),
    ("__import__('os').system('true')", "is not a Python literal"),
    ("[(0,), foo]", "is not a Python literal"),
    ("5", "5 is not a list"),
    ("{(0,), (1,)}", "is not a list"),
    ("[0, 1]", "node 0 is not a tuple"),
    ("[(0,), (1.5,)]", "node (1.5,) has a non-int rank 1.5"),
    ("[(True,)]", "node (True,) has a non-int rank True"),
    ("[(0,), ('a',)]", "node ('a',) has a non-int rank 'a'"),
    ("[(0,), (-1,)]", "node (-1,) has a negative rank -1"),
    ("[]", "the tree is empty"),
    ("()", "the tree is empty"),
    ("[()]", "node () is empty"),
    ("[(0,), (1,), (0,)]", "node (0,) is listed twice"),
    ("[(0,), (0, 0), (1,)]", "node (1,) (depth 1) comes after (0, 0) (depth 2)"),
    ("[(0,), (1, 0)]", "node (1, 0) has no parent (1,) in the tree"),
    ("[(0,), (0, 0, 0)]", "node (0, 0, 0) has no parent (0, 0) in the tree"),
])
def test_parse_refusals_name_the_bad_value(text, message):
    with pytest.raises(RocdraftError) as info:
        parse_token_tree(text)
    text_of = str(info.value)
    assert message in text_of
    assert text_of.startswith("speculative_token_tree: ")
    assert "\n" not in text_of and "list of tuples of non-negative ints" in text_of


def test_parse_refuses_a_depth_beyond_max_depth():
    with pytest.raises(RocdraftError, match=r"node \(0, 0, 0\) has depth 3 > max_depth 2 "
                                            r"\(max_speculative_tokens\)"):
        parse_token_tree("[(0,), (0, 0), (0, 0, 0)]", max_depth=2)
    assert len(parse_token_tree(EAGLE_DEFAULT_TREE, max_depth=5)) == 25
    with pytest.raises(RocdraftError, match="depth 5 > max_depth 4"):
        StaticTree.from_nodes(EAGLE_DEFAULT_TREE, max_depth=4)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_parse_refuses_a_bad_max_depth(bad):
    with pytest.raises(RocdraftError, match=f"max_depth {bad!r} is invalid"):
        parse_token_tree(SEED_EXAMPLE, max_depth=bad)


def test_static_tree_refuses_nodes_not_in_bfs_order():
    with pytest.raises(RocdraftError, match="not in BFS order; build it with "
                                            "StaticTree.from_nodes"):
        StaticTree(((1,), (0,)))


# --- StaticTree tables ----------------------------------------------------------------------

def test_static_tree_docstring_example():
    tree = StaticTree.from_nodes(SEED_EXAMPLE, 4)
    assert (tree.num_nodes, tree.depth, tree.num_leaves) == (5, 2, 3)
    assert tree.parents == (-1, -1, 0, 0, 1)
    assert tree.depths == (1, 1, 2, 2, 2)
    assert tree.ranks == (0, 1, 0, 1, 0)
    assert tree.level_starts == (0, 2, 5)
    assert tree.children_per_level_max == (2, 2)
    assert tree.topk_gather_index == (0, 1, 0, 1, 2)
    assert tree.leaves == (2, 3, 4)
    assert tree.retrieve_paths.tolist() == [[0, 2], [0, 3], [1, 4]]
    assert tree.ancestor_mask.dtype == torch.bool
    assert tree.ancestor_mask.int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0],
                                                 [1, 0, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0],
                                                 [1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 1]]


def test_eagle_default_tree_is_the_non_uniform_26_token_tree():
    tree = StaticTree.from_nodes(EAGLE_DEFAULT_TREE, 5)
    assert tree.nodes == EAGLE_DEFAULT_TREE  # already in BFS order
    assert (tree.num_nodes + 1, tree.depth) == (26, 5)
    assert tree.level_starts == (0, 4, 12, 20, 23, 25)
    assert tree.children_per_level_max == (4, 3, 3, 3, 2)
    assert tree.ancestor_mask.shape == (26, 26)
    assert tree.retrieve_paths.shape == (15, 5)
    assert tree.retrieve_paths[-1].tolist() == [0, 4, 12, 20, 24]  # (0, 0, 0, 0, 1)


def test_uniform_tree():
    tree = StaticTree.from_nodes(UNIFORM_TREE_2X2, 2)
    assert tree.level_starts == (0, 2, 6)
    assert tree.children_per_level_max == (2, 2)
    assert tree.parents == (-1, -1, 0, 0, 1, 1)
    assert tree.retrieve_paths.tolist() == [[0, 2], [0, 3], [1, 4], [1, 5]]


def test_static_tree_equality_and_hash_use_the_nodes_only():
    a = StaticTree.from_nodes(SEED_EXAMPLE)
    b = StaticTree.from_nodes([[1], [0], [1, 0], [0, 1], [0, 0]])
    assert a == b and hash(a) == hash(b)
    assert a != StaticTree.from_nodes(UNIFORM_TREE_2X2)
    with pytest.raises(AttributeError):
        a.parents = (0,)  # frozen


@st.composite
def random_trees(draw):
    """Random valid trees as node paths: each new node picks an existing parent (or the root)
    and an unused rank below 4."""
    num_nodes = draw(st.integers(1, 16))
    paths: list[tuple[int, ...]] = []
    for _ in range(num_nodes):
        parent = draw(st.sampled_from([()] + paths))
        used = {p[-1] for p in paths if p[:-1] == parent}
        free = [r for r in range(4) if r not in used]
        if free:
            paths.append(parent + (draw(st.sampled_from(free)),))
    return paths


@FAST
@given(random_trees(), st.randoms(use_true_random=False))
def test_static_tree_tables_match_naive_per_node_loop(paths, rng: random.Random):
    # Any order within a depth is accepted and re-sorted.
    shuffled = sorted(paths, key=lambda p: (len(p), rng.random()))
    tree = StaticTree.from_nodes(shuffled, max_depth=max(map(len, paths)))
    nodes = tree.nodes
    assert sorted(nodes) == sorted(paths)
    n, depth = len(nodes), max(map(len, paths))
    assert (tree.num_nodes, tree.depth) == (n, depth)
    for i, node in enumerate(nodes):
        parent = nodes.index(node[:-1]) if len(node) > 1 else -1
        assert tree.parents[i] == parent < i
        assert tree.depths[i] == len(node) and tree.ranks[i] == node[-1]
    # BFS order: by depth, then parent index, then rank.
    keys = [(tree.depths[i], tree.parents[i], tree.ranks[i]) for i in range(n)]
    assert keys == sorted(keys)
    for d in range(1, depth + 1):
        level = [i for i in range(n) if tree.depths[i] == d]
        assert list(range(tree.level_starts[d - 1], tree.level_starts[d])) == level
        assert tree.children_per_level_max[d - 1] == 1 + max(nodes[i][-1] for i in level)
    # The drafter's flattened top-k of a level [num parents, k]: entry (parent, rank).
    for i, node in enumerate(nodes):
        d = len(node)
        k = tree.children_per_level_max[d - 1]
        prev = [()] if d == 1 else list(nodes[tree.level_starts[d - 2]:tree.level_starts[d - 1]])
        flat = [(p, r) for p in prev for r in range(k)]
        assert flat[tree.topk_gather_index[i]] == (node[:-1], node[-1])
    mask = tree.ancestor_mask
    for a in range(n + 1):
        for b in range(n + 1):
            path_a = () if a == 0 else nodes[a - 1]
            path_b = () if b == 0 else nodes[b - 1]
            assert bool(mask[a, b]) == (path_a[:len(path_b)] == path_b)
    leaves = [i for i, node in enumerate(nodes)
              if not any(len(o) == len(node) + 1 and o[:-1] == node for o in nodes)]
    assert list(tree.leaves) == leaves
    assert tree.retrieve_paths.shape == (len(leaves), depth)
    for row, leaf in zip(tree.retrieve_paths.tolist(), leaves):
        node = nodes[leaf]
        want = [nodes.index(node[:d]) for d in range(1, len(node) + 1)]
        assert row == want + [-1] * (depth - len(node))


def test_budget_shape_docstring_examples_and_bounds():
    from rocdraft.drafter.tree_spec import DynamicTree, budget_shape, draft_lookahead
    from rocdraft.drafter.tree_math import dynamic_tree_num_candidates

    tree = DynamicTree(5, 4, 16)
    assert budget_shape(tree, 15) is tree and budget_shape(tree, 40) is tree
    assert budget_shape(tree, 4) == DynamicTree(4, 2, 15)
    assert budget_shape(tree, 2) == DynamicTree(2, 2, 7)
    assert budget_shape(tree, 1) == DynamicTree(1, 1, 2)
    assert draft_lookahead(tree) == 16
    for n in range(1, 16):  # never larger than the tree, always more candidates than n
        shape = budget_shape(tree, n)
        assert shape.depth <= tree.depth and shape.top_k <= tree.top_k
        assert shape.num_fed <= tree.num_fed and shape.num_nodes <= tree.num_nodes
        assert dynamic_tree_num_candidates(shape.depth, shape.top_k) >= n + (n > 1)
