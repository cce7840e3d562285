"""Index math of one tree step in the engine: the verification mask and positions, the
accepted-path-first token order the head's first forward reads, and each drafting level's
positions, slots and sequence lengths.

Layout (the tree contract, drafter/tree_math.py): a request verifies its ROOT (the last
sampled token) at sequence index L and node i at L + 1 + i, RoPE position L + depth(i).

Drafting levels. After the head's first forward, P is the position of each request's last
accepted token (the head has cached 0..P). The nodes the head is FED at level d (static trees:
the tree's level-d nodes; dynamic trees: the level's top_k frontier) get fed indices
``start .. end - 1`` (counted over all levels fed so far); fed node f sits at sequence index
P + 1 + f with position P + d, so ``seq_len = P + 1 + end`` and the tree mask covers the last
``end`` keys (the fed nodes; the context 0..P is always visible).

The max_model_len rule (as chain drafting clamps a draft past the end): a request is LIVE at
a level when ``P + 1 + end <= max_model_len``; then every slot it writes is inside the blocks
the scheduler allocated (lookahead covers the fed nodes). Otherwise it is DEAD: positions 0,
slots PADDING_SLOT_ID (nothing is written) and seq_len ``end`` (attention stays inside its
first blocks). A dead level's outputs are garbage, and that is harmless: the children it
makes have tree indices >= end, i.e. verification sequence indices >= P + 2 + end >
max_model_len, which the engine cuts before verifying (a request keeps only its first
``max_model_len - num_tokens`` nodes, an ancestor-closed BFS prefix).

Device functions are sync-free (no ``.item()`` / ``.tolist()`` / ``nonzero``); the two host
functions take Python lists (the scheduler's view).
"""
from __future__ import annotations

import torch

from rocdraft.backends.kv_cache import PADDING_SLOT_ID
from rocdraft.drafter.tree_math import ancestor_mask


def host_depths(parents: list[int]) -> list[int]:
    """Depth of every node of one tree (children of the root have depth 1); host ints.

    Example: parents [-1, -1, 0, 0, 1, 2] -> [1, 1, 2, 2, 2, 3].
    """
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def verify_tree_mask(parents_per_request: list[list[int]], width: int) -> torch.Tensor:
    """The verification ``spec_mask`` of a batch, per request, on the host.

    parents_per_request: request b's node parents (``n_b`` nodes, -1 = root; [] for a request
    without a tree), width (S: at least max(n_b) + 1) -> [B, S, S] bool. The mask covers the
    last S keys of each request: its last ``n_b + 1`` keys are its root and nodes, so the
    bottom-right ``(n_b + 1) x (n_b + 1)`` block is the tree's ancestor mask and everything
    else is True (left to the causal rule: earlier tokens and prompt chunks see the context).

    Example: parents [[-1, 0], []], width 3 -> request 0: [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    (root, node 0 child of the root, node 1 child of node 0); request 1: all True.
    """
    mask = torch.ones(len(parents_per_request), width, width, dtype=torch.bool)
    for b, parents in enumerate(parents_per_request):
        if parents:
            offset = width - len(parents) - 1
            mask[b, offset:, offset:] = ancestor_mask(torch.tensor(parents, dtype=torch.int64))
    return mask


def accepted_first_order(query_start_loc: torch.Tensor, accepted_nodes: torch.Tensor,
                         num_accepted: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Token order of the head's first forward after a tree step: in each request's segment
    the root (segment index 0), then the accepted nodes by depth, then every other token of
    the segment in its order. Tokens of requests without a tree keep their order.

    query_start_loc [B + 1], accepted_nodes [B, D] (node index per depth, -1 after the path),
    num_accepted [B], num_tokens (static) -> perm [num_tokens] int64, a permutation: the head
    reads ``tokens[perm]``. Node i of request b is segment index 1 + i. Only the first
    ``1 + num_accepted[b]`` entries of a segment matter (the rest are padding the padded path
    leaves unsampled), so with the slot mapping left in sequence order the accepted path is
    written to the consecutive slots L .. L + num_accepted.

    Example: query_start_loc [0, 4, 6], accepted_nodes [[1, -1], [-1, -1]], num_accepted
    [1, 0], num_tokens 6 -> [0, 2, 1, 3, 4, 5].
    """
    device = accepted_nodes.device
    qsl = query_start_loc.long()
    batch, depth = accepted_nodes.shape
    tokens = torch.arange(num_tokens, device=device)
    req = torch.searchsorted(qsl[1:], tokens, right=True).clamp(max=max(batch - 1, 0))
    local = tokens - qsl[req]  # [num_tokens] segment index
    # Rank of each segment index: the root 0, the accepted node at depth d rank d, others
    # after every accepted one (1 + depth + their segment index keeps their order).
    depths = torch.arange(1, depth + 1, device=device).expand(batch, depth)
    on_path = depths <= num_accepted.long().view(-1, 1)
    rank = (1 + depth + local).clone()
    hit = (accepted_nodes.long()[req] + 1 == local.view(-1, 1)) & on_path[req]  # [T, D]
    rank = torch.where(hit.any(dim=1), (hit.long() * depths[req]).sum(dim=1), rank)
    rank = rank.masked_fill(local == 0, 0)
    key = req * (2 * depth + num_tokens + 2) + rank
    return torch.argsort(key, stable=True)


def level_inputs(root_positions: torch.Tensor, start: int, end: int, depth: int,
                 block_table: torch.Tensor, block_size: int, max_model_len: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions, slots and sequence lengths of drafting level ``depth`` (module docstring).

    root_positions [B] (P: each request's last accepted position), start, end (static: the
    fed indices of this level are start .. end - 1), block_table [B, max_blocks] int32
    -> (positions [B, end - start] int64, slots [B, end - start] int64,
        seq_lens [B] int32).

    Example, block_size 4, max_model_len 12, block_table [[5, 6, 7], [1, 2, 3]], P [3, 8],
    start 2, end 4, depth 2: request 0 is live (3 + 1 + 4 <= 12): fed 2, 3 at sequence
    indices 6, 7 -> slots [26, 27], positions [5, 5], seq_len 8; request 1 is dead
    (8 + 1 + 4 > 12) -> slots [-1, -1], positions [0, 0], seq_len 4.
    """
    width = end - start
    device = block_table.device
    base = root_positions.long().view(-1, 1)  # [B, 1]
    live = base + 1 + end <= max_model_len  # [B, 1]
    index = base + 1 + torch.arange(start, end, device=device).view(1, -1)  # [B, width]
    safe = index.masked_fill(~live, 0)
    max_blocks = block_table.shape[1]
    column = (safe // block_size).clamp(max=max_blocks - 1)
    block_ids = block_table.gather(1, column).long()
    slots = block_ids * block_size + safe % block_size
    slots = slots.masked_fill(~live | (block_ids < 0), PADDING_SLOT_ID)
    positions = (base + depth).expand(-1, width).masked_fill(~live, 0)
    seq_lens = torch.where(live.view(-1), base.view(-1) + 1 + end,
                           torch.full_like(base.view(-1), end))
    return positions.contiguous(), slots, seq_lens.to(torch.int32)


def level_tables(level_ends: tuple[int, ...], device: torch.device | str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The constant tables ``level_schedule`` reads, built once per tree shape (so a captured
    graph never copies from the host). level_ends (static): level d (1-based) feeds the fed
    indices ``level_ends[d - 2] .. level_ends[d - 1] - 1`` (from 0 for d = 1)
    -> (depth_of [F], end_of [F], ends [num_levels]) int64: each fed index's level depth
    and level end, and the level ends.

    Example: level_ends (2, 4) -> depth_of [1, 1, 2, 2], end_of [2, 2, 4, 4], ends [2, 4].
    """
    starts = (0,) + tuple(level_ends[:-1])
    depth_of = [d + 1 for d, (a, b) in enumerate(zip(starts, level_ends)) for _ in range(a, b)]
    end_of = [b for a, b in zip(starts, level_ends) for _ in range(a, b)]
    return tuple(torch.tensor(t, dtype=torch.int64, device=device)
                 for t in (depth_of, end_of, list(level_ends)))


def level_schedule(root_positions: torch.Tensor, level_ends: tuple[int, ...],
                   block_table: torch.Tensor, block_size: int, max_model_len: int,
                   tables: tuple[torch.Tensor, ...] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``level_inputs`` of every drafting level at once (one set of ops per step instead of
    one per level). level_ends: as in ``level_tables``; tables: ``level_tables(level_ends)``
    built once (required inside a captured graph: it never copies from the host)
    -> (positions [B, F] int64, slots [B, F] int64, seq_lens [B, num_levels] int32), F =
    level_ends[-1]; level d's columns are its fed indices and its seq_lens column d - 1.

    Example, the ``level_inputs`` example's batch with level_ends (2, 4): request 0 (P 3):
    positions [4, 4, 5, 5], slots [24, 25, 26, 27], seq_lens [6, 8]; request 1 (P 8, max 12):
    level 1 is live (8 + 1 + 2 <= 12): positions [9, 9], slots [13, 14], seq_len 11; level 2
    is dead: positions [0, 0], slots [-1, -1], seq_len 4.
    """
    if tables is None:
        tables = level_tables(level_ends, block_table.device)
    depth_of, end_of, ends = tables
    base = root_positions.long().view(-1, 1)  # [B, 1]
    live = base + 1 + end_of <= max_model_len  # [B, F]
    index = base + 1 + torch.arange(depth_of.shape[0], device=depth_of.device)  # [B, F]
    safe = index.masked_fill(~live, 0)
    column = (safe // block_size).clamp(max=block_table.shape[1] - 1)
    block_ids = block_table.gather(1, column).long()
    slots = (block_ids * block_size + safe % block_size).masked_fill(~live | (block_ids < 0),
                                                                     PADDING_SLOT_ID)
    positions = (base + depth_of).masked_fill(~live, 0)
    level_seq = base + 1 + ends  # [B, num_levels]
    seq_lens = torch.where(level_seq <= max_model_len, level_seq, ends.expand_as(level_seq))
    return positions, slots, seq_lens.to(torch.int32)
