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
first draft forward over the target's tokens runs before: replayed per target key after a
padded target step (drafter/first_forward_graphs.py), else eagerly (a ragged batch).

Memory: a graph is captured for one host bound of every step's sequence length,
``max_seq_len`` (default ``max_model_len``), and a backend may size work buffers by it:
TORCH_SDPA gathers ``[bucket, max_seq_len, num_kv_heads, head_dim]`` float32 keys and values
per layer and step, i.e. ``2 * 4 * bucket * max_seq_len * num_kv_heads * head_dim`` bytes
(``sdpa_gather_bytes``); TRITON_ATTN allocates nothing per step. A smaller ``max_seq_len``
shrinks the graphs' pool; a batch whose sequences may grow past it (``seq_len_bound + k - 1
> max_seq_len``) runs eagerly instead of replaying. On a GPU the pool growth of each
bucket's capture is recorded in ``capture_bytes``. The CPU runs the same bounded loop
eagerly through the static buffers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

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


def graph_capture_refusal(backend, device: str, enforce_eager: bool,
                          role: str = "draft") -> str | None:
    """Why the draft loop (``role`` "draft"; the target forward: "target",
    rocdraft/engine/target_graphs.py) will run without graphs, or None when it will be
    captured."""
    if enforce_eager:
        return "enforce_eager is set"
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return "no GPU: graphs need CUDA or HIP (the CPU replays the same buffers eagerly)"
    if not backend.capabilities.has(Feature.FULL_GRAPH_CAPTURE):
        return (f"{role} attention backend {backend.name} declares graph capture "
                f"{backend.capabilities.graph_capture.name}, not FULL")
    return None


def sdpa_gather_bytes(bucket: int, max_seq_len: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes TORCH_SDPA's reference gathers per layer and draft step: float32 keys and
    values ``[bucket, max_seq_len, num_kv_heads, head_dim]``.

    Example: bucket 64, max_seq_len 4096, 8 KV heads of 128 -> 2 * 4 * 64 * 4096 * 1024 bytes
    = 2 GiB (at max_model_len 4096), 256 MiB at max_seq_len 512.
    """
    return 2 * 4 * bucket * max_seq_len * num_kv_heads * head_dim


def capture_one(run, pool) -> tuple["torch.cuda.CUDAGraph", int, object]:
    """Capture ``run()`` as one CUDA/HIP graph in ``pool`` after two warm-up runs on a side
    stream (lazy inits, autotuning, allocator growth) -> (graph, memory reserved by the
    capture, what the captured ``run()`` returned: its static outputs)."""
    before = torch.cuda.memory_reserved()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    return graph, torch.cuda.memory_reserved() - before, output


def capture_per_bucket(buckets: tuple[int, ...], loop, pool=None
                       ) -> tuple[dict[int, "torch.cuda.CUDAGraph"], dict[int, int]]:
    """Capture ``loop(bucket)`` as one CUDA/HIP graph per bucket (``capture_one``), all in
    ``pool`` (None: a new one; largest bucket first, so the pool fits them all) -> (bucket
    -> graph, bucket -> memory reserved by its capture). ``loop`` must write its results
    into buffers allocated outside the pool (other graphs may share it)."""
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    graphs, capture_bytes = {}, {}
    for bucket in sorted(buckets, reverse=True):
        graphs[bucket], capture_bytes[bucket], _ = capture_one(lambda: loop(bucket), pool)
    return graphs, capture_bytes


@dataclass(frozen=True)
class DraftGraphPlan:
    """How an EagleProposer builds its graph runners (its constructor builds them): the
    draft caches and shapes they need, the capture buckets, whether to capture
    (``use_graphs``; False replays the same static buffers eagerly, the CPU path), and
    which loops to build: the chain's k-draft loop (``chain``) and a tree's levels
    (``tree``, when the proposer drafts trees deeper than one level); ``pool``: the graph
    memory pool to capture in (the target forward's, rocdraft/engine/model_runner.py), None
    for one of its own."""

    kv_caches: list
    hidden_size: int
    max_blocks_per_seq: int
    buckets: tuple[int, ...]
    use_graphs: bool
    chain: bool
    tree: bool
    pool: object = None


def hidden_dtype(head: torch.nn.Module) -> torch.dtype:
    """The dtype of a head's hidden states: its fc's for an EAGLE head (which may compute in
    another dtype than the target whose embedding it shares and registers first,
    ``SpeculativeConfig.draft_dtype``), else its first parameter's (MTP layers run in the
    engine's dtype)."""
    fc = getattr(head, "fc", None)
    return fc.weight.dtype if isinstance(fc, torch.nn.Linear) else next(head.parameters()).dtype


class DraftLoopRunner:
    def __init__(self, proposer, kv_caches: list[LayerKVCache], hidden_size: int,
                 max_blocks_per_seq: int, buckets: tuple[int, ...], use_graphs: bool,
                 max_seq_len: int | None = None, pool=None) -> None:
        """``max_seq_len``: the longest sequence any captured step attends over (default and
        maximum ``proposer.max_model_len``); batches that may need more run eagerly;
        ``pool``: the graph memory pool to capture in (None: its own)."""
        steps = proposer.num_speculative_tokens - 1
        bound = proposer.max_model_len if max_seq_len is None else max_seq_len
        if not steps + 1 <= bound <= proposer.max_model_len:
            raise ValueError(f"max_seq_len must be in [{steps + 1}, max_model_len="
                             f"{proposer.max_model_len}], got {max_seq_len}")
        self.proposer, self.kv_caches = proposer, kv_caches
        self.buckets, self.use_graphs = tuple(sorted(buckets)), use_graphs
        self.max_seq_len = bound
        self.capture_bytes: dict[int, int] = {}  # bucket -> pool growth of its capture (GPU)
        largest, device = self.buckets[-1], proposer.device
        self.draft_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(largest, hidden_size, dtype=hidden_dtype(proposer.head),
                                  device=device)
        self.block_table = torch.full((largest, max_blocks_per_seq), -1, dtype=torch.int32,
                                      device=device)
        self.out = torch.zeros(largest, steps, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if use_graphs:
            self._capture_all(pool)

    def accepts(self, batch_size: int, seq_len_bound: int | None = None) -> bool:
        """Whether ``run`` replays the captured loop for this batch (else it runs eagerly)."""
        return batch_size <= self.buckets[-1] and (
            seq_len_bound is None or self._fits(seq_len_bound))

    def _fits(self, seq_len_bound: int) -> bool:
        """Every step's seq_len stays <= max_seq_len (draft_steps clamps at max_model_len)."""
        steps = self.proposer.num_speculative_tokens - 1
        return min(seq_len_bound + steps, self.proposer.max_model_len) <= self.max_seq_len

    def bucket_for(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    def _pad_all(self) -> None:
        self.positions.fill_(self.proposer.max_model_len)
        self.seq_lens.fill_(1)
        self.block_table.fill_(-1)
        self.draft_ids.zero_()
        self.hidden.zero_()

    def _loop(self, bucket: int) -> None:
        """The draft steps on the static buffers, bounded by max_seq_len (as captured)."""
        steps = self.proposer.num_speculative_tokens - 1
        self.proposer.draft_steps(
            self.draft_ids[:bucket], self.positions[:bucket], self.seq_lens[:bucket],
            self.hidden[:bucket], self.block_table[:bucket], self.kv_caches,
            seq_len_bound=self.max_seq_len - steps, out=self.out[:bucket])

    def _capture_all(self, pool) -> None:
        self._pad_all()  # capture with padding rows only: nothing is written to the cache
        self.graphs, self.capture_bytes = capture_per_bucket(self.buckets, self._loop, pool)
        log.info("captured the draft loop for buckets %s (max_seq_len %d, memory reserved "
                 "per capture %s)", list(self.buckets), self.max_seq_len, self.capture_bytes)

    def _copy_inputs(self, draft_ids: torch.Tensor, positions: torch.Tensor,
                     seq_lens: torch.Tensor, hidden: torch.Tensor, block_table: torch.Tensor
                     ) -> None:
        """The batch's rows [B, ...] into the first B rows of the static buffers; a narrower
        block table [B, width] leaves -1 in the columns past it."""
        batch_size, width = draft_ids.shape[0], block_table.shape[1]
        self.draft_ids[:batch_size].copy_(draft_ids)
        self.positions[:batch_size].copy_(positions)
        self.seq_lens[:batch_size].copy_(seq_lens)
        self.hidden[:batch_size].copy_(hidden)
        if width == self.block_table.shape[1]:
            self.block_table[:batch_size].copy_(block_table)
        else:
            self.block_table[:batch_size, :width].copy_(block_table)
            self.block_table[:batch_size, width:].fill_(-1)

    def run(self, draft_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
            hidden: torch.Tensor, block_table: torch.Tensor, seq_len_bound: int
            ) -> torch.Tensor:
        """Same contract as ``EagleProposer.draft_steps``; -> [B, k-1] (a copy). A batch
        whose steps may pass max_seq_len runs eagerly on its own tensors."""
        batch_size = draft_ids.shape[0]
        if not self._fits(seq_len_bound):
            return self.proposer.draft_steps(draft_ids, positions, seq_lens, hidden,
                                             block_table, self.kv_caches,
                                             seq_len_bound=seq_len_bound)
        bucket = self.bucket_for(batch_size)
        self._copy_inputs(draft_ids, positions, seq_lens, hidden, block_table)
        if batch_size < bucket:  # padding rows: clamped at every step, so slot -1, seq_len 1
            self.positions[batch_size:bucket].fill_(self.proposer.max_model_len)
            self.seq_lens[batch_size:bucket].fill_(1)
            self.block_table[batch_size:bucket].fill_(-1)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
        else:
            self._loop(bucket)
        return self.out[:batch_size].clone()
