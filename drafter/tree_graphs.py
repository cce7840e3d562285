"""Whole-tree-loop capture: the per-level head forwards of one tree shape (static, or an
EAGLE-2 dynamic tree's fixed top_k frontier and total_tokens) for a batch-size bucket as one
CUDA graph (a HIP graph on ROCm), all buckets sharing one memory pool, as drafter/graphs.py
does for the chain.

A batch of ``B`` requests runs in the smallest bucket ``>= B``: its root hidden states, root
positions and block tables are copied into static buffers; rows ``B..bucket-1`` are padding
whose root position is ``max_model_len``, so every level is DEAD for them
(drafter/tree_index.py: positions 0, slots PADDING_SLOT_ID, nothing written) and their trees
are dropped. On a GPU the captured graph is replayed; on the CPU (no graphs) the very same
loop runs eagerly on the same static buffers, which is what the CPU tests compare against
unbucketed execution.

What is captured: the level schedule (positions, slots, seq_lens of every level), per level
the metadata refresh (``build_for_drafting``), the head's forward (KV write + attention with
the tree mask), its logits and top-k, and for dynamic trees the frontier expansion,
selection and the final ``select_tree``. The first head forward over the target's tokens has a
ragged shape and runs eagerly before. Every constant table is built once (TreeDrafter), so
the loop never copies from the host.

Not captured: a step with a batch node budget (``max_draft_tokens_per_step``): the budget
rule is over the real requests, so padding rows would take a share; such steps run eagerly.
Memory: as for the chain, a graph is captured for one host bound of every level's sequence
length, ``max_seq_len`` (default ``max_model_len``); a batch whose levels may pass it runs
eagerly.
"""
from __future__ import annotations

import logging

import torch

from rocdraft.backends.kv_cache import LayerKVCache
from rocdraft.drafter.graphs import capture_per_bucket, hidden_dtype
from rocdraft.drafter.tree_draft import TreeDrafter, TreeDrafts

log = logging.getLogger(__name__)


class TreeLoopRunner:
    def __init__(self, drafter: TreeDrafter, kv_caches: list[LayerKVCache], hidden_size: int,
                 max_blocks_per_seq: int, buckets: tuple[int, ...], use_graphs: bool,
                 max_seq_len: int | None = None, pool=None) -> None:
        proposer = drafter.proposer
        self.drafter, self.kv_caches, self.proposer = drafter, kv_caches, proposer
        self.num_fed = drafter.level_ends[-1] if drafter.level_ends else 0
        bound = proposer.max_model_len if max_seq_len is None else max_seq_len
        if not self.num_fed + 1 <= bound <= proposer.max_model_len:
            raise ValueError(f"max_seq_len must be in [{self.num_fed + 1}, max_model_len="
                             f"{proposer.max_model_len}], got {max_seq_len}")
        self.max_seq_len = bound
        self.buckets, self.use_graphs = tuple(sorted(buckets)), use_graphs
        self.capture_bytes: dict[int, int] = {}
        largest, device = self.buckets[-1], proposer.device
        dtype = hidden_dtype(proposer.head)
        num_nodes = drafter.tree.num_nodes
        self.root_hidden = torch.zeros(largest, hidden_size, dtype=dtype, device=device)
        self.root_positions = torch.full((largest,), proposer.max_model_len, dtype=torch.long,
                                         device=device)
        self.block_table = torch.full((largest, max_blocks_per_seq), -1, dtype=torch.int32,
                                      device=device)
        self.tokens = torch.zeros(largest, num_nodes, dtype=torch.long, device=device)
        self.parents = torch.full((largest, num_nodes), -1, dtype=torch.long, device=device)
        self.num_nodes = torch.zeros(largest, dtype=torch.long, device=device)
        self.scores = torch.full((largest, num_nodes), float("-inf"), device=device) \
            if not drafter.is_static else None  # dynamic trees' node scores
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if use_graphs:
            self._capture_all(pool)

    def _fits(self, seq_len_bound: int) -> bool:
        """Every level's seq_len stays <= max_seq_len (levels clamp at max_model_len)."""
        return min(seq_len_bound + self.num_fed, self.proposer.max_model_len) <= self.max_seq_len

    def accepts(self, batch_size: int, seq_len_bound: int, budget_nodes: int | None) -> bool:
        """Whether ``run`` serves this batch through the static buffers (else: eager)."""
        return batch_size <= self.buckets[-1] and budget_nodes is None \
            and self._fits(seq_len_bound)

    def bucket_for(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    def _loop(self, bucket: int) -> None:
        """The tree levels on the static buffers, bounded by max_seq_len (as captured)."""
        drafts = self.drafter.draft(self.root_hidden[:bucket], self.root_positions[:bucket],
                                    self.block_table[:bucket], self.kv_caches,
                                    seq_len_bound=self.max_seq_len - self.num_fed)
        self.tokens[:bucket].copy_(drafts.tokens)
        self.parents[:bucket].copy_(drafts.parents)
        self.num_nodes[:bucket].copy_(drafts.num_nodes)
        if self.scores is not None:
            self.scores[:bucket].copy_(drafts.scores)

    def _capture_all(self, pool) -> None:
        self.graphs, self.capture_bytes = capture_per_bucket(self.buckets, self._loop, pool)
        log.info("captured the tree loop for buckets %s (max_seq_len %d, memory reserved per "
                 "capture %s)", list(self.buckets), self.max_seq_len, self.capture_bytes)

    def run(self, root_hidden: torch.Tensor, root_positions: torch.Tensor,
            block_table: torch.Tensor, seq_len_bound: int) -> TreeDrafts:
        """Same contract as ``TreeDrafter.draft`` without a budget; -> TreeDrafts (copies).
        A batch whose levels may pass max_seq_len runs eagerly on its own tensors."""
        batch_size = root_hidden.shape[0]
        if not self._fits(seq_len_bound):
            return self.drafter.draft(root_hidden, root_positions, block_table, self.kv_caches,
                                      seq_len_bound)
        bucket = self.bucket_for(batch_size)
        width = block_table.shape[1]
        self.root_hidden[:batch_size].copy_(root_hidden)
        self.root_positions[:batch_size].copy_(root_positions)
        self.block_table[:batch_size, :width].copy_(block_table)
        self.block_table[:batch_size, width:].fill_(-1)
        # Padding rows: every level dead (no KV write), their trees dropped.
        self.root_hidden[batch_size:bucket].zero_()
        self.root_positions[batch_size:bucket].fill_(self.proposer.max_model_len)
        self.block_table[batch_size:bucket].fill_(-1)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
        else:
            self._loop(bucket)
        return TreeDrafts(tokens=self.tokens[:batch_size].clone(),
                          parents=self.parents[:batch_size].clone(),
                          num_nodes=self.num_nodes[:batch_size].clone(),
                          scores=None if self.scores is None
                          else self.scores[:batch_size].clone())
