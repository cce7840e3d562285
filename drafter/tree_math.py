"""Pure index math of tree drafting (static token trees and EAGLE-2 dynamic trees).

Every function is sync-free (no ``.item()``, ``.tolist()``, ``nonzero`` or boolean indexing on
tensors; shapes depend only on shapes and Python ints), so it can run inside a captured
graph, and each has a worked example and a property test against a naive per-node loop in
tests/test_tree_math.py.

Conventions (the tree contract, /work/briefs/tree_contract.md): a request's tree has a ROOT
(the last sampled token, not a draft) and N draft nodes in BFS order; ``parents [..., N]``
holds each node's parent node index, -1 for a child of the root, and ``parents[i] < i``.
Square masks ``[..., N + 1, N + 1]`` use index 0 for the root and index ``i + 1`` for node i.
Node i sits at sequence index ``L + 1 + i`` (the root at ``L``), with RoPE position
``L + depths[i]``.

Dynamic trees (EAGLE-2) grow with fixed shapes per level: level 1 expands the root (a
frontier of one node with score 0) into ``top_k`` candidates, every later level expands the
``top_k`` best candidates of the previous level into ``top_k * top_k`` candidates. Each
candidate's id is its creation index over all levels (``M = top_k + (depth - 1) * top_k**2``
ids), so a parent's id is always below its children's; its score is the cumulative
log-probability of its path. ``select_tree`` keeps the best ``num_keep`` candidates, ordered
by score (descending) then id (ascending). A child's score is its parent's plus a
log-probability <= 0, and IEEE rounding is monotone, so a child's score never exceeds its
parent's; on a tie the parent's lower id wins. So the parent always outranks its child and
every kept set (any prefix of that order) is a connected tree.
"""
from __future__ import annotations

import torch

from rocdraft.backends.kv_cache import PADDING_SLOT_ID
from rocdraft.errors import RocdraftError


def _doubling_rounds(num_nodes: int) -> int:
    """Rounds of pointer doubling that reach any ancestor of an N-node tree (2**r > N)."""
    return max(1, num_nodes.bit_length())


def _with_root(parents: torch.Tensor) -> torch.Tensor:
    """[..., N] node parents -> [..., N + 1] parents in root-included indices (root -> 0)."""
    zeros = parents.new_zeros((*parents.shape[:-1], 1), dtype=torch.int64)
    return torch.cat([zeros, parents.long() + 1], dim=-1)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """Tree attention mask: mask[a, b] is True when b is a or an ancestor of a.

    parents [..., N] (int, -1 = child of the root, ``parents[i] < i``) -> [..., N + 1, N + 1]
    bool, index 0 = root, index i + 1 = node i. Batched over any leading dims (a dynamic tree
    per request). Pointer doubling: O(log N) ops of O(N^2) each.

    Example: parents [-1, -1, 0, 0, 1] (nodes (0,), (1,), (0, 0), (0, 1), (1, 0)) ->
    ``[[1,0,0,0,0,0], [1,1,0,0,0,0], [1,0,1,0,0,0], [1,1,0,1,0,0], [1,1,0,0,1,0],
    [1,0,1,0,0,1]]``.
    """
    jump = _with_root(parents)  # [..., S]
    size = jump.shape[-1]
    mask = torch.eye(size, dtype=torch.bool, device=parents.device).expand(
        *jump.shape[:-1], size, size)
    # After round r, mask[a] holds a's ancestors at distance < 2**r and jump[a] is the
    # ancestor at distance 2**r (the root is its own parent, so it saturates there).
    for _ in range(_doubling_rounds(size - 1)):
        rows = mask.gather(-2, jump.unsqueeze(-1).expand(*jump.shape, size))
        mask = mask | rows
        jump = jump.gather(-1, jump)
    return mask


def extend_ancestor_mask(mask: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """Add a level of nodes to a node-only ancestor mask (no root row): O(1) ops per level
    instead of ``ancestor_mask``'s O(log N).

    mask [B, n, n] bool (mask[a, b]: b is a or an ancestor of a, over n nodes), parents
    [B, m] (the new nodes' parents among the n, -1 = the root) -> [B, n + m, n + m]: new node
    j sees itself and what its parent sees.

    Example: mask [[[1]]] (one node), parents [[0, -1]] -> [[[1, 0, 0], [1, 1, 0], [0, 0, 1]]].
    """
    batch, n, _ = mask.shape
    m = parents.shape[1]
    rows = mask.gather(1, parents.clamp(min=0).unsqueeze(-1).expand(batch, m, n))  # [B, m, n]
    rows = rows & (parents >= 0).unsqueeze(-1)
    eye = torch.eye(m, dtype=torch.bool, device=mask.device).expand(batch, m, m)
    top = torch.cat([mask, mask.new_zeros(batch, n, m)], dim=2)
    return torch.cat([top, torch.cat([rows, eye], dim=2)], dim=1)


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node (children of the root have depth 1).

    parents [..., N] -> depths [..., N] int64. Pointer doubling (list ranking): O(log N) ops.

    Example: parents [-1, -1, 0, 0, 1, 2] -> [1, 1, 2, 2, 2, 3].
    """
    jump = _with_root(parents)  # [..., S]
    dist = torch.ones_like(jump)
    dist[..., 0] = 0  # dist[a] = distance from a to jump[a]
    for _ in range(_doubling_rounds(jump.shape[-1] - 1)):
        dist = dist + dist.gather(-1, jump)
        jump = jump.gather(-1, jump)
    return dist[..., 1:]


def node_paths(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """Root-to-node path of every node: path[i, d - 1] = node i's ancestor (or itself) at
    depth d, -1 past node i's depth.

    parents [..., N], depth (static, >= the tree's depth) -> [..., N, depth] int64. The
    retrieve paths of a tree are the rows of its leaves (``leaf_mask``).

    Example: parents [-1, -1, 0, 0, 1], depth 2 ->
    ``[[0, -1], [1, -1], [0, 2], [0, 3], [1, 4]]``.
    """
    num_nodes = parents.shape[-1]
    anc = ancestor_mask(parents)[..., 1:, 1:]  # [..., N (node), N (ancestor)]
    depths = node_depths(parents)  # [..., N]
    levels = torch.arange(1, depth + 1, device=parents.device)
    at_level = depths.unsqueeze(-2) == levels.unsqueeze(-1)  # [..., depth, N]
    hits = anc.unsqueeze(-2) & at_level.unsqueeze(-3)  # [..., N, depth, N]
    ids = torch.arange(1, num_nodes + 1, device=parents.device)
    return (hits.long() * ids).sum(dim=-1) - 1  # at most one ancestor per depth


def leaf_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [..., N] -> [..., N] bool: True for nodes without children.

    Example: parents [-1, -1, 0, 0, 1] -> [False, False, True, True, True].
    """
    num_nodes = parents.shape[-1]
    ids = torch.arange(num_nodes, device=parents.device)
    has_child = (parents.long().unsqueeze(-2) == ids.unsqueeze(-1)).any(dim=-1)
    return ~has_child


def tree_positions(context_len: torch.Tensor, depths: torch.Tensor,
                   max_model_len: int | None = None) -> torch.Tensor:
    """RoPE positions of the root and the nodes: the root's is L, node i's is L + depths[i].

    context_len [B] (L: tokens cached before this step), depths [B or 1, N] -> [B, N + 1]
    int64. With ``max_model_len``, positions >= max_model_len are clamped to 0 (as chain
    drafting does; those tokens' slots are PADDING_SLOT_ID and their outputs are discarded).

    Example: context_len [7, 3], depths [[1, 1, 2]] -> [[7, 8, 8, 9], [3, 4, 4, 5]];
    with max_model_len 9 -> [[7, 8, 8, 0], [3, 4, 4, 5]].
    """
    root = depths.new_zeros((*depths.shape[:-1], 1), dtype=torch.int64)
    offsets = torch.cat([root, depths.long()], dim=-1)  # [B or 1, N + 1]
    positions = context_len.long().unsqueeze(-1) + offsets
    if max_model_len is not None:
        positions = positions.masked_fill(positions >= max_model_len, 0)
    return positions


def tree_slot_mapping(block_table: torch.Tensor, context_len: torch.Tensor,
                      num_new: torch.Tensor | int, block_size: int, max_model_len: int,
                      width: int | None = None) -> torch.Tensor:
    """KV slots of sequence indices L .. L + width - 1 (the root, then node i at L + 1 + i).

    block_table [B, max_blocks] int32, context_len [B] (L), num_new [B] tensor or int (tokens
    this request writes: N + 1 for a full tree), width (static columns; defaults to num_new
    when that is an int, required when it is a tensor) -> slots [B, width] int64.

    A column is PADDING_SLOT_ID (nothing is written) where it is past the request's
    ``num_new``, where its sequence index is >= max_model_len, where it falls past the block
    table, or where the table entry is negative: a tree never writes outside its request's
    blocks.

    Example, block_size 4, max_model_len 10, block_table [[3, 7, 1], [2, 5, 6]],
    context_len [6, 8], num_new 3 -> [[30, 31, 4], [24, 25, -1]];
    num_new [2, 3], width 3 -> [[30, 31, -1], [24, 25, -1]].
    """
    if isinstance(num_new, int):
        width = num_new if width is None else width
        limit = torch.full_like(context_len, num_new, dtype=torch.int64)
    elif width is None:
        raise RocdraftError("tree_slot_mapping: width is required when num_new is a tensor "
                            f"(got num_new of shape {tuple(num_new.shape)}); pass the static "
                            "number of columns")
    else:
        limit = num_new.long()
    max_blocks = block_table.shape[1]
    cols = torch.arange(width, device=block_table.device)
    index = context_len.long().unsqueeze(-1) + cols  # [B, width]
    invalid = ((cols >= limit.unsqueeze(-1)) | (index >= max_model_len)
               | (index >= max_blocks * block_size))
    safe = index.masked_fill(invalid, 0)
    block_ids = block_table.gather(1, safe // block_size).long()
    invalid = invalid | (block_ids < 0)
    slots = block_ids * block_size + safe % block_size
    return slots.masked_fill(invalid, PADDING_SLOT_ID)


def _check_top_k(top_k: int, limit: int, what: str) -> None:
    """Refuse a top_k outside [1, limit] (a static int check, no tensor is read)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= limit:
        raise RocdraftError(f"top_k {top_k!r} is invalid; it must be an int in [1, {limit}] "
                            f"({what})")


def dynamic_tree_num_candidates(depth: int, top_k: int) -> int:
    """Candidates an EAGLE-2 tree of ``depth`` levels creates: top_k + (depth - 1) * top_k**2.

    Example: depth 5, top_k 4 -> 68.
    """
    return top_k + (depth - 1) * top_k * top_k


def expand_frontier(frontier_scores: torch.Tensor, child_logprobs: torch.Tensor, top_k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each frontier node proposes its top_k children; score = parent score + child log-prob.

    frontier_scores [B, K] (cumulative log-probs; zeros [B, 1] for the root),
    child_logprobs [B, K, V] (log-probabilities, <= 0, of each frontier node's children)
    -> (cand_scores [B, K * top_k] float32, cand_tokens [B, K * top_k] int64,
        cand_parent_slot [B, K * top_k] int64: the frontier slot 0..K-1 of the parent).
    Candidates are grouped by frontier slot, each group in descending child log-prob.

    Example, top_k 2: frontier_scores [[0.0, -1.0]], child_logprobs
    [[[-0.1, -3.0, -0.5], [-2.0, -0.2, -0.7]]] -> scores [[-0.1, -0.5, -1.2, -1.7]],
    tokens [[0, 2, 1, 2]], parent slots [[0, 0, 1, 1]].
    """
    batch, width, vocab = child_logprobs.shape
    _check_top_k(top_k, vocab, f"vocabulary of {vocab}")
    logprobs, tokens = child_logprobs.topk(top_k, dim=-1)  # [B, K, top_k], descending
    scores = frontier_scores.float().unsqueeze(-1) + logprobs.float()
    slots = torch.arange(width, device=child_logprobs.device).view(1, width, 1)
    slots = slots.expand(batch, width, top_k)
    return (scores.reshape(batch, width * top_k), tokens.reshape(batch, width * top_k),
            slots.reshape(batch, width * top_k))


def _rank_order(scores: torch.Tensor) -> torch.Tensor:
    """[B, M] -> indices [B, M] by score descending, ties by index ascending."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices


def select_frontier(cand_scores: torch.Tensor, cand_tokens: torch.Tensor, top_k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep the top_k candidates of a level as the next frontier.

    cand_scores [B, C], cand_tokens [B, C] -> (frontier_scores [B, top_k],
    frontier_tokens [B, top_k], cand_index [B, top_k] int64: the kept candidates' columns,
    best first; ties go to the lower column).

    Example, top_k 2: scores [[-0.1, -0.5, -1.2, -0.5]], tokens [[4, 9, 7, 3]]
    -> scores [[-0.1, -0.5]], tokens [[4, 9]], index [[0, 1]].
    """
    _check_top_k(top_k, cand_scores.shape[-1], f"{cand_scores.shape[-1]} candidates")
    index = _rank_order(cand_scores)[:, :top_k]
    return cand_scores.gather(1, index), cand_tokens.gather(1, index), index


def select_tree(all_scores: torch.Tensor, all_parents: torch.Tensor, num_keep: int,
                num_nodes: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep each request's best candidates by cumulative log-prob and lay them out in BFS order.

    all_scores [B, M] (cumulative log-probs), all_parents [B, M] (parent candidate id, -1 =
    root; ids are creation order, so ``all_parents[b, i] < i`` and scores never rise along a
    path), num_keep (static: ``total_tokens - 1``), num_nodes [B] (optional: request b keeps
    only its best ``num_nodes[b] <= num_keep``, e.g. from ``select_tree_batch_budget``)
    -> (node_ids [B, num_keep] int64: the candidate id of each tree node,
        parents [B, num_keep] int64: the parent's index among the kept nodes, -1 = root,
        depths [B, num_keep] int64).

    The kept set is the top of the order (score descending, id ascending), which is
    ancestor-closed (module docstring). The nodes are in the contract's BFS order: by depth,
    then by parent, siblings in rank order (the best child first). Columns past num_nodes[b]
    are padding: node id -1, parent -1, depth 0.

    Example, num_keep 4: scores [[-0.1, -0.5, -0.3, -0.9, -0.2]], parents [[-1, -1, 0, 0, 2]]
    (candidate 2 is a child of 0, 4 a child of 2) keeps ids {0, 4, 2, 1}: node_ids
    [[0, 1, 2, 4]], parents [[-1, -1, 0, 2]], depths [[1, 1, 2, 3]].
    """
    batch, num_cand = all_scores.shape
    if isinstance(num_keep, bool) or not isinstance(num_keep, int) \
            or not 1 <= num_keep <= num_cand:
        raise RocdraftError(f"num_keep {num_keep!r} is invalid; it must be an int in "
                            f"[1, {num_cand}] (the number of candidates)")
    device = all_scores.device
    local = torch.arange(num_keep, device=device)
    kept = _rank_order(all_scores)[:, :num_keep]  # [B, K] candidate ids, selection order
    local_of = torch.full((batch, num_cand), -1, dtype=torch.int64, device=device)
    local_of.scatter_(1, kept, local.expand(batch, num_keep))
    parent_id = all_parents.long().gather(1, kept)
    parent = torch.where(parent_id >= 0, local_of.gather(1, parent_id.clamp(min=0)), -1)
    # In selection order a parent precedes its children, so `parent` is a valid tree.
    depths = node_depths(parent)  # [B, K]
    anc = ancestor_mask(parent)[:, 1:, 1:]  # [B, K (node), K (ancestor)]
    # Preorder (lexicographic path order): u precedes v when u is a proper ancestor of v, or
    # when some ancestor-or-self a of u and b of v are siblings with a ranked before b.
    sibling_before = ((parent.unsqueeze(-1) == parent.unsqueeze(-2))
                      & (local.view(-1, 1) < local.view(1, -1)))  # [B, a, b]
    ancf = anc.float()
    branch_before = (ancf @ sibling_before.float() @ ancf.transpose(1, 2)) > 0  # [B, u, v]
    proper_anc = anc.transpose(1, 2) & ~torch.eye(num_keep, dtype=torch.bool, device=device)
    preorder = (branch_before | proper_anc).sum(dim=1)  # [B, K], a permutation of 0..K-1
    # Within one depth, preorder is the BFS order (parent order, then rank); padding last.
    keep = local.unsqueeze(0) < (num_keep if num_nodes is None else num_nodes.long()
                                 .unsqueeze(-1))
    key = torch.where(keep, depths * (num_keep + 1) + preorder,
                      (num_keep + 1) ** 2 + local)
    bfs = torch.argsort(key, dim=1, stable=True)  # [B, K] selection index of each BFS slot
    new_of = torch.empty_like(bfs).scatter_(1, bfs, local.expand(batch, num_keep))
    bfs_parent = parent.gather(1, bfs)
    parents = torch.where(bfs_parent >= 0, new_of.gather(1, bfs_parent.clamp(min=0)), -1)
    bfs_keep = keep.expand(batch, num_keep).gather(1, bfs)
    node_ids = kept.gather(1, bfs).masked_fill(~bfs_keep, -1)
    return (node_ids, parents.masked_fill(~bfs_keep, -1),
            depths.gather(1, bfs).masked_fill(~bfs_keep, 0))


def select_tree_batch_budget(all_scores: torch.Tensor, budget_nodes: int, min_per_request: int,
                             max_per_request: int | None = None) -> torch.Tensor:
    """How many tree nodes each request of the batch keeps under a batch-wide node budget.

    all_scores [B, M] (every request's candidate cumulative log-probs), budget_nodes (N: the
    nodes verified per step over the whole batch), min_per_request (a floor per request),
    max_per_request (a cap per request, default M: the verification buffer per request)
    -> num_nodes [B] int64, for ``select_tree(..., num_keep=max_per_request, num_nodes=...)``.

    The rule: every request first keeps its own best ``min_per_request`` candidates; the
    remaining ``N - B * min_per_request`` nodes (none if that is negative: the floor wins over
    the budget) go to the best remaining candidates of the whole batch by cumulative log-prob
    (a global top-N), at most ``max_per_request`` per request; ties go to the lower request
    index, then the lower candidate id. Requests on which the head is confident have higher
    scores deeper in their trees and so get more nodes. Each request's nodes are the top of
    its own order, so ``select_tree`` keeps a connected tree.

    Example: scores [[-0.1, -0.2, -0.3], [-1.0, -2.0, -3.0]], budget 4, min 1 -> [3, 1]:
    the floor takes -0.1 and -1.0, the two best of the rest are -0.2 and -0.3.
    """
    batch, num_cand = all_scores.shape
    cap = num_cand if max_per_request is None else max_per_request
    if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= num_cand:
        raise RocdraftError(f"max_per_request {max_per_request!r} is invalid; it must be an "
                            f"int in [1, {num_cand}] (the number of candidates)")
    if isinstance(min_per_request, bool) or not isinstance(min_per_request, int) \
            or not 0 <= min_per_request <= cap:
        raise RocdraftError(f"min_per_request {min_per_request!r} is invalid; it must be an "
                            f"int in [0, {cap}] (max_per_request)")
    if isinstance(budget_nodes, bool) or not isinstance(budget_nodes, int) or budget_nodes < 0:
        raise RocdraftError(f"budget_nodes {budget_nodes!r} is invalid; it must be an int >= 0")
    extra_width = cap - min_per_request
    num_extra = min(max(budget_nodes - batch * min_per_request, 0), batch * extra_width)
    counts = torch.zeros(batch, dtype=torch.int64, device=all_scores.device)
    if num_extra:
        ranked = torch.sort(all_scores, dim=1, descending=True, stable=True).values
        extra = ranked[:, min_per_request:cap].reshape(-1)  # row-major: (request, rank)
        chosen = torch.sort(extra, descending=True, stable=True).indices[:num_extra]
        counts.scatter_add_(0, chosen // extra_width, torch.ones_like(chosen))
    return counts + min_per_request
