"""Static token trees: parsing, validation and the per-level tables drafting needs.

A node is the path of child ranks from the root: ``(0, 1)`` is the second-ranked child of the
top-ranked first draft. A tree is written in the seed's string format,
``"[(0,), (1,), (0, 0), (0, 1), (1, 0)]"``, parsed with ``ast.literal_eval`` (never ``eval``).
``StaticTree`` holds the tree in the contract's BFS order (/work/briefs/tree_contract.md) with
every table built once: parents, depths, ranks, level starts, top-k per level, the ancestor
mask and the retrieve paths.
"""
from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rocdraft.drafter.tree_math import ancestor_mask, leaf_mask, node_paths
from rocdraft.errors import RocdraftError

Node = tuple[int, ...]
TreeNodes = tuple[Node, ...]

# EAGLE-1's default tree: 25 draft nodes plus the root (26 tokens verified per step), depth 5,
# not uniform. SafeAILab/EAGLE eagle/model/choices.py (commit 08dc06c), named `mc_sim_7b_63`
# there although it has 25 nodes (the name is Medusa's); xformers' tree-attention tests carry
# the same list as `eagle_mc_sim_7b_63`, citing SafeAILab/EAGLE e98fc7c model/choices.py.
EAGLE_DEFAULT_TREE: TreeNodes = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)

# A small uniform tree: two children per node, two levels (6 nodes).
UNIFORM_TREE_2X2: TreeNodes = ((0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1))

_FORMAT = ("expected a list of tuples of non-negative ints sorted by depth, "
           "e.g. [(0,), (1,), (0, 0)]")


def _refuse(what: str) -> RocdraftError:
    return RocdraftError(f"speculative_token_tree: {what}; {_FORMAT}")


def _as_node(item: object) -> Node:
    if not isinstance(item, (tuple, list)):
        raise _refuse(f"node {item!r} is not a tuple")
    if not item:
        raise _refuse("node () is empty (the root is implicit)")
    for rank in item:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise _refuse(f"node {item!r} has a non-int rank {rank!r}")
        if rank < 0:
            raise _refuse(f"node {item!r} has a negative rank {rank}")
    return tuple(item)


def parse_token_tree(tree: str | Sequence[Sequence[int]], max_depth: int | None = None
                     ) -> TreeNodes:
    """Parse and validate a static token tree; return its nodes in BFS order.

    tree: the string format (``"[(0,), (1,), (0, 0)]"``) or an already-parsed list/tuple of
    tuples (lists are accepted as nodes too, as EAGLE writes them); max_depth: the deepest
    level allowed (the caller passes max_speculative_tokens), None for no limit.

    Refused with a one-line RocdraftError naming the bad value: not a list of tuples of
    non-negative ints (bools refused), an empty tree, a duplicate node, nodes out of depth
    order, a node whose parent is missing, a depth beyond max_depth. Within one depth any
    order is accepted; the result is re-sorted to BFS order (by parent, then rank), which is
    the lexicographic order of the paths within each depth.

    Example: ``"[(1,), (0,), (0, 1), (0, 0)]"`` -> ``((0,), (1,), (0, 0), (0, 1))``.
    """
    if max_depth is not None and (isinstance(max_depth, bool) or not isinstance(max_depth, int)
                                  or max_depth < 1):
        raise RocdraftError(f"max_depth {max_depth!r} is invalid; it must be an int >= 1 "
                            "(max_speculative_tokens)")
    if isinstance(tree, str):
        try:
            value = ast.literal_eval(tree)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise _refuse(f"{tree!r} is not a Python literal") from None
    else:
        value = tree
    if not isinstance(value, (list, tuple)):
        raise _refuse(f"{value!r} is not a list")
    if not value:
        raise _refuse("the tree is empty")
    nodes = [_as_node(item) for item in value]
    seen: set[Node] = set()
    for node in nodes:
        if node in seen:
            raise _refuse(f"node {node!r} is listed twice")
        seen.add(node)
    for before, node in zip(nodes, nodes[1:]):
        if len(node) < len(before):
            raise _refuse(f"node {node!r} (depth {len(node)}) comes after {before!r} "
                          f"(depth {len(before)}): nodes must be sorted by depth")
    for node in nodes:
        if len(node) > 1 and node[:-1] not in seen:
            raise _refuse(f"node {node!r} has no parent {node[:-1]!r} in the tree")
        if max_depth is not None and len(node) > max_depth:
            raise _refuse(f"node {node!r} has depth {len(node)} > max_depth {max_depth} "
                          "(max_speculative_tokens)")
    return tuple(sorted(nodes, key=lambda n: (len(n), n)))


@dataclass(frozen=True)
class StaticTree:
    """A validated static token tree and its tables, built once (``StaticTree.from_nodes``).

    ``nodes`` is in BFS order; node i's tables (N = num_nodes, D = depth):
    - ``parents[i]``: parent node index, -1 for a child of the root (always < i);
    - ``depths[i]`` (1..D) and ``ranks[i]`` (the path's last element);
    - ``level_starts`` (D + 1 ints): level d's nodes are ``level_starts[d-1]:level_starts[d]``;
    - ``children_per_level_max[d-1]``: the top-k the drafter takes at level d (largest rank at
      that level + 1), over each node of level d - 1 (the root for level 1);
    - ``topk_gather_index[i]``: where node i's token sits in its level's flattened top-k,
      ``[num parents at level d - 1, children_per_level_max[d-1]]``: ``local parent * k + rank``;
    - ``ancestor_mask`` [N + 1, N + 1] bool (index 0 = root, the contract's spec_mask);
    - ``leaves``: leaf node indices ascending; ``retrieve_paths`` [num_leaves, D] int64: the
      node indices root -> leaf, -1 padded.

    Only ``nodes`` takes part in equality and hashing. The tensors are CPU tensors shared by
    every user: copy them (``.to(device)``) rather than modify them.
    """

    nodes: TreeNodes
    parents: tuple[int, ...] = field(init=False, compare=False)
    depths: tuple[int, ...] = field(init=False, compare=False)
    ranks: tuple[int, ...] = field(init=False, compare=False)
    level_starts: tuple[int, ...] = field(init=False, compare=False)
    children_per_level_max: tuple[int, ...] = field(init=False, compare=False)
    topk_gather_index: tuple[int, ...] = field(init=False, compare=False)
    leaves: tuple[int, ...] = field(init=False, compare=False)
    ancestor_mask: torch.Tensor = field(init=False, compare=False, repr=False)
    retrieve_paths: torch.Tensor = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        nodes = parse_token_tree(self.nodes)
        if nodes != self.nodes:
            raise RocdraftError(f"StaticTree nodes {self.nodes!r} are not in BFS order; build "
                                "it with StaticTree.from_nodes")
        index = {node: i for i, node in enumerate(nodes)}
        parents = tuple(index[n[:-1]] if len(n) > 1 else -1 for n in nodes)
        depths = tuple(len(n) for n in nodes)
        depth = depths[-1]
        starts = [0] * (depth + 1)
        for d in depths:
            starts[d] += 1
        for d in range(1, depth + 1):
            starts[d] += starts[d - 1]
        topk = tuple(1 + max(n[-1] for n in nodes[starts[d - 1]:starts[d]])
                     for d in range(1, depth + 1))
        gather = []
        for node, parent, d in zip(nodes, parents, depths):
            local_parent = 0 if parent < 0 else parent - starts[d - 2]
            gather.append(local_parent * topk[d - 1] + node[-1])
        parents_t = torch.tensor(parents, dtype=torch.int64)
        leaf = leaf_mask(parents_t)
        leaves = tuple(i for i, is_leaf in enumerate(leaf.tolist()) if is_leaf)
        values = dict(parents=parents, depths=depths, ranks=tuple(n[-1] for n in nodes),
                      level_starts=tuple(starts), children_per_level_max=topk,
                      topk_gather_index=tuple(gather), leaves=leaves,
                      ancestor_mask=ancestor_mask(parents_t),
                      retrieve_paths=node_paths(parents_t, depth)[list(leaves)])
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_nodes(cls, nodes: str | Sequence[Sequence[int]], max_depth: int | None = None
                   ) -> StaticTree:
        """Parse, validate (``parse_token_tree``) and tabulate a tree given as text or nodes.

        Example: ``StaticTree.from_nodes("[(0,), (1,), (0, 0), (0, 1), (1, 0)]", 4)``:
        parents (-1, -1, 0, 0, 1), depths (1, 1, 2, 2, 2), ranks (0, 1, 0, 1, 0),
        level_starts (0, 2, 5), children_per_level_max (2, 2),
        topk_gather_index (0, 1, 0, 1, 2), leaves (2, 3, 4),
        retrieve_paths [[0, 2], [0, 3], [1, 4]].
        """
        return cls(parse_token_tree(nodes, max_depth))

    @property
    def num_nodes(self) -> int:
        """N: draft nodes, the root excluded (the target verifies N + 1 tokens)."""
        return len(self.nodes)

    @property
    def depth(self) -> int:
        """D: the deepest level (the longest path of drafts)."""
        return self.depths[-1]

    @property
    def num_leaves(self) -> int:
        return len(self.leaves)


@dataclass(frozen=True)
class DynamicTree:
    """An EAGLE-2 dynamic tree's shape (validated by SpeculativeConfig): ``depth`` levels of
    candidates, ``top_k`` children per frontier node and frontier width, ``total_tokens``
    verified per request (the root plus ``total_tokens - 1`` nodes)."""

    depth: int
    top_k: int
    total_tokens: int

    @property
    def num_nodes(self) -> int:
        """N: draft nodes kept per request (the target verifies N + 1 tokens)."""
        return self.total_tokens - 1

    @property
    def num_fed(self) -> int:
        """Frontier nodes the head is fed over all levels (their KV sits after the root)."""
        return (self.depth - 1) * self.top_k


def budget_shape(tree: DynamicTree, nodes_per_request: int) -> DynamicTree:
    """The dynamic tree a step drafts when the batch node budget leaves each request about
    ``nodes_per_request`` (n) nodes: verification is bounded by the budget, and so is the
    drafting work, which grows with the frontier (top_k nodes fed per level) and the depth.

    The rule: with n >= the tree's nodes, the tree itself; else a frontier of
    ``min(top_k, max(min(2, n), round(sqrt(n))))`` (at least 2 from n = 2, so the batch-wide
    top-N has more candidates than n to choose from; EAGLE-2's own settings keep top_k near the square
    root of the nodes kept: 4 for 16, 8 for 60), ``min(depth, max(1, n))`` levels (a request
    with n nodes rarely uses more depth), and every candidate of that shape eligible (up to the
    tree's own node count): the batch-wide top-N still gives confident requests more nodes.

    Example: DynamicTree(5, 4, 16): n 15 -> itself; n 4 -> DynamicTree(4, 2, 15) (14
    candidates: 2 + 3 * 4); n 2 -> DynamicTree(2, 2, 7); n 1 -> DynamicTree(1, 1, 2).
    """
    from rocdraft.drafter.tree_math import dynamic_tree_num_candidates

    if nodes_per_request >= tree.num_nodes:
        return tree
    top_k = min(tree.top_k, max(min(2, nodes_per_request), round(nodes_per_request ** 0.5)))
    depth = min(tree.depth, max(1, nodes_per_request))
    total = min(tree.total_tokens, 1 + dynamic_tree_num_candidates(depth, top_k))
    return DynamicTree(depth, top_k, total)


def draft_lookahead(tree: StaticTree | DynamicTree) -> int:
    """KV slots a request needs past its last token for one tree step: the verified nodes,
    or the fed frontier nodes when there are more (dynamic trees).

    Example: DynamicTree(depth 5, top_k 4, total_tokens 16) -> max(15, 16) = 16.
    """
    return max(tree.num_nodes, getattr(tree, "num_fed", 0))
