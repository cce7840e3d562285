"""Tree drafting with an EAGLE head: one head forward per tree level over that level's nodes,
batched over requests, on the draft KV cache, with a tree mask so each node sees only its
ancestors and the context (layout and the max_model_len rule: drafter/tree_index.py).

Both kinds start from the head's first forward (``EagleProposer.first_forward``): its output
at each request's last accepted token is the ROOT's hidden state, whose logits rank the
depth-1 tokens.

- Static trees (``StaticTree``): level d's tokens are the top ``children_per_level_max[d-1]``
  tokens of each parent, picked by rank (``topk_gather_index``); the level is then fed (token,
  its parent's output hidden state) to produce the next level's logits. D - 1 head forwards.
- Dynamic trees (``DynamicTree``, EAGLE-2): the frontier (top_k nodes) is fed per level; each
  frontier node proposes its top_k children scored by cumulative log-probability
  (``expand_frontier``); the top_k best become the next frontier (``select_frontier``). After
  the last level every candidate is reranked and the best ``total_tokens - 1`` kept
  (``select_tree``), or with a batch budget a global top-N over the batch decides each
  request's count (``select_tree_batch_budget``). D - 1 head forwards.

EAGLE-3 heads feed their own output hidden states forward, as in chain drafting. Everything
is sync-free: shapes depend on the tree and the batch size only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rocdraft.backends.metadata import CommonAttentionMetadata
from rocdraft.drafter.tree_index import level_schedule, level_tables
from rocdraft.drafter.tree_math import (expand_frontier, extend_ancestor_mask, select_frontier,
                                        select_tree, select_tree_batch_budget)
from rocdraft.drafter.tree_spec import DynamicTree, StaticTree, budget_shape


@dataclass(frozen=True)
class TreeDrafts:
    """One tree per request, in BFS order (the tree contract)."""

    tokens: torch.Tensor  # [B, N] int64 target-vocabulary ids (padding columns: 0)
    parents: torch.Tensor  # [B, N] int64, -1 = the root (and padding)
    num_nodes: torch.Tensor  # [B] int64: nodes of request b are columns 0 .. num_nodes[b]-1
    # [B, N] float32: each node's cumulative log-probability under the head (dynamic trees;
    # padding -inf), None for static trees.
    scores: torch.Tensor | None = None


class TreeDrafter:
    """Runs the per-level loop of one tree shape for an EagleProposer's head and backend."""

    def __init__(self, proposer, tree: StaticTree | DynamicTree) -> None:
        self.proposer, self.tree = proposer, tree
        self.head, self.builder = proposer.head, proposer.builder
        device = proposer.device
        # The fed indices' level ends: static trees feed levels 1 .. D - 1, dynamic ones
        # top_k frontier nodes per level.
        if isinstance(tree, StaticTree):
            self.level_ends = tuple(tree.level_starts[1:tree.depth])
        else:
            self.level_ends = _fed_level_ends(tree)
        self.level_tables = level_tables(self.level_ends, device) if self.level_ends else None
        self._budget_tables: dict[DynamicTree, tuple] = {}  # budget-shaped trees' tables
        self.is_static = isinstance(tree, StaticTree)
        if isinstance(tree, StaticTree):
            # Node-only ancestor mask (the root is the context row P, always visible).
            self.node_mask = tree.ancestor_mask[1:, 1:].to(device)
            self.parents = torch.tensor(tree.parents, dtype=torch.int64, device=device)
            self.gather = torch.tensor(tree.topk_gather_index, dtype=torch.int64, device=device)

    def draft(self, root_hidden: torch.Tensor, root_positions: torch.Tensor,
              block_table: torch.Tensor, kv_caches, seq_len_bound: int,
              budget_nodes: int | None = None) -> TreeDrafts:
        """root_hidden [B, H] (the head's output at each request's last accepted token),
        root_positions [B] (P), block_table [B, max_blocks] int32, seq_len_bound (a host
        upper bound of P + 1), budget_nodes (nodes over the whole batch; None: every request
        gets the whole tree) -> TreeDrafts."""
        if root_positions.dim() != 1:
            raise ValueError(f"tree drafting needs 1-D positions, got shape "
                             f"{tuple(root_positions.shape)} (M-RoPE is not supported)")
        proposer = self.proposer
        tree, level_ends, tables = self.tree, self.level_ends, self.level_tables
        if isinstance(tree, DynamicTree) and budget_nodes is not None:
            tree = budget_shape(tree, max(budget_nodes // max(root_hidden.shape[0], 1), 1))
            if tree != self.tree:
                level_ends = _fed_level_ends(tree)
                if tree not in self._budget_tables:
                    self._budget_tables[tree] = level_tables(level_ends, proposer.device) \
                        if level_ends else None
                tables = self._budget_tables[tree]
        schedule = None
        if level_ends:
            schedule = level_schedule(root_positions, level_ends, block_table,
                                      proposer.block_size, proposer.max_model_len, tables)
        if isinstance(tree, StaticTree):
            return self._static(root_hidden, schedule, block_table, kv_caches, seq_len_bound,
                                budget_nodes)
        return self._dynamic(tree, root_hidden, schedule, block_table, kv_caches,
                             seq_len_bound, budget_nodes)

    # --- one level ------------------------------------------------------------------------

    def _level(self, token_ids: torch.Tensor, hidden: torch.Tensor, schedule, start: int,
               end: int, depth: int, mask: torch.Tensor, block_table: torch.Tensor, kv_caches,
               seq_len_bound: int) -> torch.Tensor:
        """Feed fed nodes start .. end - 1 of every request: token_ids [B, n], hidden
        [B, n, H] (each node's parent's output), schedule: ``level_schedule``'s tensors,
        mask [end, end] or [B, end, end] -> output hidden [B, n, H]."""
        proposer = self.proposer
        batch, width = token_ids.shape
        positions, slots = schedule[0][:, start:end], schedule[1][:, start:end]
        seq_lens = schedule[2][:, depth - 1].contiguous()  # kernels read it with stride 1
        max_seq_len = min(seq_len_bound + end, proposer.max_model_len)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=token_ids.device) * width
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=torch.arange(batch + 1, dtype=torch.int32)
            * width, seq_lens=seq_lens,
            seq_lens_cpu=torch.full((batch,), max(max_seq_len, end), dtype=torch.int32),
            num_reqs=batch, num_actual_tokens=batch * width, max_query_len=width,
            max_seq_len=max(max_seq_len, end), block_table=block_table,
            slot_mapping=slots.reshape(-1), causal=True, spec_mask=mask)
        metadata = self.builder.build_for_drafting(common, depth)
        out = self.head(token_ids.reshape(-1), positions.reshape(-1),
                        hidden.reshape(batch * width, -1), kv_caches, metadata)
        return out.view(batch, width, -1)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., draft_vocab] float32."""
        shape = hidden.shape[:-1]
        return self.head.compute_draft_logits(hidden.reshape(-1, hidden.shape[-1])).view(
            *shape, -1)

    # --- static trees ---------------------------------------------------------------------

    def _static(self, root_hidden, schedule, block_table, kv_caches, seq_len_bound,
                budget_nodes) -> TreeDrafts:
        tree, head = self.tree, self.head
        batch = root_hidden.shape[0]
        starts, topk = tree.level_starts, tree.children_per_level_max
        tokens = torch.zeros(batch, tree.num_nodes, dtype=torch.int64, device=root_hidden.device)
        # Level 1: the root's top children by rank.
        top = self._logits(root_hidden).topk(topk[0], dim=-1).indices  # [B, k1]
        tokens[:, :starts[1]] = head.draft_to_target(top[:, self.gather[:starts[1]]])
        level_out = root_hidden.unsqueeze(1)  # [B, 1, H]: the root, parent of level 1
        for depth in range(1, tree.depth):
            start, end = starts[depth - 1], starts[depth]
            if depth == 1:
                hidden = level_out.expand(batch, end - start, level_out.shape[-1])
            else:  # each node's parent sits in the previous level's outputs
                local = self.parents[start:end] - starts[depth - 2]
                hidden = level_out[:, local]
            level_out = self._level(tokens[:, start:end], hidden, schedule, start, end, depth,
                                    self.node_mask[:end, :end], block_table, kv_caches,
                                    seq_len_bound)  # [B, n_d, H]
            k = topk[depth]
            top = self._logits(level_out).topk(k, dim=-1).indices.reshape(batch, -1)
            child_start, child_end = starts[depth], starts[depth + 1]
            tokens[:, child_start:child_end] = head.draft_to_target(
                top[:, self.gather[child_start:child_end]])
        num_nodes = tree.num_nodes
        if budget_nodes is not None:
            num_nodes = min(num_nodes, budget_nodes // max(batch, 1))
        return TreeDrafts(tokens=tokens, parents=self.parents.expand(batch, -1),
                          num_nodes=torch.full((batch,), num_nodes, dtype=torch.int64,
                                               device=tokens.device))

    # --- dynamic trees (EAGLE-2) ------------------------------------------------------------

    def _dynamic(self, tree: DynamicTree, root_hidden, schedule, block_table, kv_caches,
                 seq_len_bound, budget_nodes) -> TreeDrafts:
        """tree: the config's tree, or its budget shape (``budget_shape``); the result has
        the config's node columns either way."""
        head = self.head
        batch, top_k = root_hidden.shape[0], tree.top_k
        device = root_hidden.device
        logprobs = torch.log_softmax(self._logits(root_hidden), dim=-1)  # [B, V]
        scores, ids = logprobs.topk(top_k, dim=-1)  # [B, K] best first: level-1 candidates
        all_scores, all_tokens = [scores], [head.draft_to_target(ids)]
        all_parents = [torch.full((batch, top_k), -1, dtype=torch.int64, device=device)]
        frontier_scores, frontier_tokens = scores, all_tokens[0]
        frontier_ids = torch.arange(top_k, device=device).expand(batch, top_k)  # candidate ids
        fed_parents = torch.full((batch, top_k), -1, dtype=torch.int64, device=device)
        mask = torch.zeros(batch, 0, 0, dtype=torch.bool, device=device)  # over fed nodes
        hidden = root_hidden.unsqueeze(1).expand(batch, top_k, root_hidden.shape[-1])
        offset = top_k  # candidate id of the next level's first candidate
        for depth in range(1, tree.depth):
            start, end = (depth - 1) * top_k, depth * top_k
            mask = extend_ancestor_mask(mask, fed_parents)  # [B, end, end]
            out = self._level(frontier_tokens, hidden, schedule, start, end, depth, mask,
                              block_table, kv_caches, seq_len_bound)  # [B, K, H]
            child_logprobs = torch.log_softmax(self._logits(out), dim=-1)  # [B, K, V]
            cand_scores, cand_ids, cand_slot = expand_frontier(frontier_scores, child_logprobs,
                                                               top_k)  # [B, K * K]
            all_scores.append(cand_scores)
            all_tokens.append(head.draft_to_target(cand_ids))
            all_parents.append(frontier_ids.gather(1, cand_slot))
            if depth < tree.depth - 1:
                frontier_scores, _, column = select_frontier(cand_scores, cand_ids, top_k)
                frontier_tokens = all_tokens[-1].gather(1, column)
                slot = cand_slot.gather(1, column)  # [B, K] the parent's frontier slot
                fed_parents = start + slot
                frontier_ids = offset + column
                hidden = out.gather(1, slot.unsqueeze(-1).expand(-1, -1, out.shape[-1]))
            offset += top_k * top_k
        scores = torch.cat(all_scores, dim=1)  # [B, M]
        num_keep = min(tree.num_nodes, scores.shape[1])
        num_nodes = None
        if budget_nodes is not None:
            num_nodes = select_tree_batch_budget(scores, budget_nodes,
                                                 min(1, budget_nodes // max(batch, 1)),
                                                 num_keep)
        node_ids, parents, _ = select_tree(scores, torch.cat(all_parents, dim=1), num_keep,
                                           num_nodes)
        tokens = torch.cat(all_tokens, dim=1).gather(1, node_ids.clamp(min=0))
        node_scores = scores.gather(1, node_ids.clamp(min=0)).masked_fill(node_ids < 0,
                                                                          float("-inf"))
        if num_nodes is None:
            num_nodes = torch.full((batch,), num_keep, dtype=torch.int64, device=device)
        width = self.tree.num_nodes  # the config's columns (a budget shape may keep fewer)
        tokens = tokens.masked_fill(node_ids < 0, 0)
        if num_keep < width:
            pad = width - num_keep
            tokens = torch.cat([tokens, tokens.new_zeros(batch, pad)], dim=1)
            parents = torch.cat([parents, parents.new_full((batch, pad), -1)], dim=1)
            node_scores = torch.cat([node_scores, node_scores.new_full((batch, pad),
                                                                       float("-inf"))], dim=1)
        return TreeDrafts(tokens=tokens, parents=parents, num_nodes=num_nodes,
                          scores=node_scores)


def _fed_level_ends(tree: DynamicTree) -> tuple[int, ...]:
    """A dynamic tree feeds top_k frontier nodes per level, levels 1 .. depth - 1."""
    return tuple(d * tree.top_k for d in range(1, tree.depth))
