"""Whole-draft-loop capture: the k-1 single-token draft steps of a batch-size bucket as one
CUDA graph (a HIP graph on ROCm), all buckets sharing one memory pool.

A batch of ``B`` requests runs in the smallest bucket ``>= B``: its inputs are copied into
static buffers and rows ``B..bucket-1`` are padding whose position is ``max_model_len``, so
``advance_draft_step`` clamps them at every step (position 0, slot -1, seq_len 1): they never
write the KV cache and their drafts are dropped. On a GPU the captured graph is replayed; on
the CPU (no graphs) the very same function runs eagerly on the same static buffers, which is
what the CPU tests compare against unpadded execution.

What is captured: per step the position/slot/seq-len update, the metadata refresh
(``build_for_drafting``), the head's forward (KV write + attention) and the argmax. The
first draft forward over the target's tokens has a ragged shape and runs eagerly before.
"""
from __future__ import annotations

import logging

import torch

from rocdraft.backends.base import Feature
from rocdraft.backends.kv_cache import LayerKVCache

log = logging.getLogger(__name__)


def capture_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 32, 64, then multiples of 64 up to ``max_num_seqs`` (always included).

    Example: max_num_seqs 100 -> (1, 2, 4, 8, 16, 32, 64, 100).
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    buckets = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < max_num_seqs]
    buckets += list(range(128, max_num_seqs, 64))
    return tuple(buckets) + (max_num_seqs,)


def graph_capture_refusal(backend, device: str, enforce_eager: bool) -> str | None:
    """Why the draft loop will run without graphs, or None when it will be captured."""
    if enforce_eager:
        return "enforce_eager is set"
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return "no GPU: graphs need CUDA or HIP (the CPU replays the same buffers eagerly)"
    if not backend.capabilities.has(Feature.FULL_GRAPH_CAPTURE):
        return (f"draft attention backend {backend.name} declares graph capture "
                f"{backend.capabilities.graph_capture.name}, not FULL")
    return None


class DraftLoopRunner:
    def __init__(self, proposer, kv_caches: list[LayerKVCache], hidden_size: int,
                 max_blocks_per_seq: int, buckets: tuple[int, ...], use_graphs: bool) -> None:
        self.proposer, self.kv_caches = proposer, kv_caches
        self.buckets, self.use_graphs = tuple(sorted(buckets)), use_graphs
        largest, device = self.buckets[-1], proposer.device
        steps = proposer.num_speculative_tokens - 1
        self.draft_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        dtype = next(proposer.head.parameters()).dtype
        self.hidden = torch.zeros(largest, hidden_size, dtype=dtype, device=device)
        self.block_table = torch.full((largest, max_blocks_per_seq), -1, dtype=torch.int32,
                                      device=device)
        self.out = torch.zeros(largest, steps, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if use_graphs:
            self._capture_all()

    def accepts(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def bucket_for(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    def _pad_all(self) -> None:
        self.positions.fill_(self.proposer.max_model_len)
        self.seq_lens.fill_(1)
        self.block_table.fill_(-1)
        self.draft_ids.zero_()
        self.hidden.zero_()

    def _loop(self, bucket: int, seq_len_bound: int) -> None:
        self.proposer.draft_steps(
            self.draft_ids[:bucket], self.positions[:bucket], self.seq_lens[:bucket],
            self.hidden[:bucket], self.block_table[:bucket], self.kv_caches,
            seq_len_bound=seq_len_bound, out=self.out[:bucket])

    def _capture_all(self) -> None:
        bound = self.proposer.max_model_len  # static: any step's seq_len is below it
        pool = torch.cuda.graph_pool_handle()
        self._pad_all()  # capture with padding rows only: nothing is written to the cache
        for bucket in reversed(self.buckets):  # largest first, so the pool fits them all
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: lazy inits, autotuning, allocator growth
                    self._loop(bucket, bound)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._loop(bucket, bound)
            self.graphs[bucket] = graph
        log.info("captured the draft loop for buckets %s", list(self.buckets))

    def run(self, draft_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
            hidden: torch.Tensor, block_table: torch.Tensor, seq_len_bound: int
            ) -> torch.Tensor:
        """Same contract as ``EagleProposer.draft_steps``; -> [B, k-1] (a copy)."""
        batch_size = draft_ids.shape[0]
        bucket = self.bucket_for(batch_size)
        width = block_table.shape[1]
        self.draft_ids[:batch_size].copy_(draft_ids)
        self.positions[:batch_size].copy_(positions)
        self.seq_lens[:batch_size].copy_(seq_lens)
        self.hidden[:batch_size].copy_(hidden)
        self.block_table[:batch_size, :width].copy_(block_table)
        self.block_table[:batch_size, width:].fill_(-1)
        # Padding rows: clamped at every step, so slot -1 and seq_len 1.
        self.positions[batch_size:bucket].fill_(self.proposer.max_model_len)
        self.seq_lens[batch_size:bucket].fill_(1)
        self.block_table[batch_size:bucket].fill_(-1)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
        else:
            self._loop(bucket, seq_len_bound)
        return self.out[:batch_size].clone()
