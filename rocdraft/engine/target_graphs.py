"""The target forward of uniform batches as CUDA/HIP graphs, one per (bucket, query length).

A uniform batch is one where every request computes the same number ``q`` of query tokens
and none has images: decode steps (q = 1), chain verification (q = k + 1, every request
carrying k drafts) and tree verification (q = the tree's nodes + 1). Such a batch of ``B``
requests runs in the smallest capture bucket ``>= B`` (drafter/graphs.py
``capture_buckets``): ``build_step_batch(pad_to=bucket)`` writes its inputs for every row
of the bucket into this runner's persistent input buffer in one host-to-device copy
(rocdraft/core/step_inputs.py), padding rows writing slot -1 (never the KV cache), and the
graph of its key replays. Everything else (prefill chunks, mixed steps, images, batches
larger than the largest bucket, sequences past ``max_seq_len``) runs eagerly: prompt
chunks carry enough tokens that their launches are not the bottleneck, and their shapes
vary every step.

Key: (bucket, q, drafts per row, tree mask or not, aux layers). The host integers the
forward reads (rows, tokens, ``max_query_len``, and ``max_seq_len`` = this runner's bound)
follow from the key alone, so a replay with new inputs runs exactly what was captured.
Graphs are captured at start-up (``capture``) for every bucket and the shapes an engine's
config runs uniformly (``startup_shapes``: decode, chain verification of each draft count
the policy may pick, a branching tree's full verification), on batches of padding rows
only (``padding_only_batch``: same layout, slot -1, so capture writes no KV); a key met
later (a tree cut to a node budget, a prompt chunk of uniform length) is captured on first
use, logged. Each capture is two warm-up runs on a side stream, then the capture, in the
memory pool the head's first forward and the draft loops use too (``ModelRunner.
graph_pool``). That sharing is safe because every graph's outputs stay allocated (the
runners keep them, so no later capture is handed their memory) and no graph's output is
read after another graph of the pool replays: the target's hidden states feed the logits
(eager) and then the head's first forward (eager, or its graph, drafter/
first_forward_graphs.py, whose output is cloned at once); the draft loops copy their inputs
into, and write their results to, buffers allocated outside the pool.
``capture_bytes`` records each capture's pool growth.

On the CPU (no graphs) the very same function runs eagerly on the same padded static
inputs: tests compare it against the unpadded eager forward.

What is captured: metadata build (``build_for_graph_capture``), embedding, every decoder
layer (KV write and attention included) and the final norm. The logits at the sample
positions are computed eagerly on the real rows (one matmul; capturing them would hold a
[bucket * q, vocab] float32 buffer per key in the pool).
"""
from __future__ import annotations

import logging

import torch

from rocdraft.drafter.graphs import capture_one, graph_capture_refusal
from rocdraft.core.scheduler import ScheduledRequest
from rocdraft.core.step_batch import InFlight, StepBatch, UniformShape, graph_key

log = logging.getLogger(__name__)


def target_graph_refusal(backend, device: str, enforce_eager: bool, tensor_parallel: bool,
                         compiled: bool) -> str | None:
    """Why the target forward will not be captured, or None when it will be: the draft
    loop's reasons (drafter/graphs.py) after tensor parallelism and compile."""
    if not enforce_eager and tensor_parallel:
        return "tensor parallelism: the forward holds collectives with the worker processes"
    if not enforce_eager and compiled:
        return "compile is set"
    return graph_capture_refusal(backend, device, enforce_eager, role="target")


def input_bytes_bound(rows: int, max_query_len: int, max_blocks_per_seq: int) -> int:
    """Bytes of the largest padded step input (rocdraft/core/step_batch.py's sections at
    ``rows`` requests of ``max_query_len`` tokens, tree parents and mask included, and an
    async decode step's input sources), with 16 bytes of alignment slack per section.

    Example: 4 rows, q 5, 8 blocks per row -> 8 * (3 * 20 + 20 + 16 + 8 + 16 + 4) + 4 * 5
    + 4 * 4 + 4 + 4 * 32 + 100 + 14 * 16 = 1484.
    """
    tokens, drafts = rows * max_query_len, max_query_len - 1
    int64s = 3 * tokens + rows * max_query_len + rows * drafts + 2 * rows + rows * drafts \
        + rows  # the last: input_sources (rocdraft/engine/overlap.py)
    int32s = (rows + 1) + rows + rows * max_blocks_per_seq
    return 8 * int64s + 4 * int32s + rows + rows * max_query_len ** 2 + 14 * 16


GATHER_BUDGET_BYTES = 1 << 30  # per layer, for a backend that gathers K/V (gathers_kv)


def captured_seq_len(backend, max_model_len: int, largest_bucket: int, num_kv_heads: int,
                     head_dim: int, max_query_len: int) -> int:
    """The longest sequence a captured target forward attends over: ``max_model_len``, or
    for a backend that gathers K/V per forward (``capabilities.gathers_kv``: TORCH_SDPA)
    the longest whose float32 K and V of the largest bucket fit ``GATHER_BUDGET_BYTES``
    (drafter/graphs.py ``sdpa_gather_bytes``); batches past it run eagerly.

    Example: TORCH_SDPA, max_model_len 131072, bucket 64, 8 KV heads of 128 -> 2048
    (2 * 4 * 64 * 2048 * 1024 bytes = 1 GiB); TRITON_ATTN -> 131072.
    """
    if not backend.capabilities.gathers_kv:
        return max_model_len
    per_position = 2 * 4 * largest_bucket * num_kv_heads * head_dim
    return min(max_model_len, max(GATHER_BUDGET_BYTES // per_position, max_query_len))


def startup_shapes(max_chain_drafts: int, tree_nodes: int | None = None
                   ) -> tuple[UniformShape, ...]:
    """The uniform shapes an engine captures at start-up: decode (a d = 0 step or
    target-only), chain verification of every draft count 1..``max_chain_drafts`` (the draft
    policy picks d per step), and with ``tree_nodes`` a branching tree's full verification.

    Example: 3 -> (1, 0), (2, 1), (3, 2), (4, 3); 0 (target-only) -> (1, 0);
    2, tree_nodes 5 -> (1, 0), (2, 1), (3, 2), (6, 5, tree mask).
    """
    if max_chain_drafts < 0 or tree_nodes is not None and tree_nodes < 2:
        raise ValueError(f"max_chain_drafts must be >= 0 and tree_nodes None or >= 2, got "
                         f"{max_chain_drafts}, {tree_nodes}")
    shapes = tuple(UniformShape(d + 1, d) for d in range(max_chain_drafts + 1))
    if tree_nodes is not None:
        shapes += (UniformShape(tree_nodes + 1, tree_nodes, tree_mask=True),)
    return shapes


def config_shapes(spec, tree, chains_in_tree_mode: bool) -> tuple[UniformShape, ...]:
    """The uniform batch shapes the steps of a speculative config ``spec`` (None:
    target-only) with draft tree ``tree`` run (``startup_shapes``): decode; chains of 1..k
    drafts (in a tree config at most the tree's depth, and only where its policy may draft
    chains: ``chains_in_tree_mode``); a branching tree's full verification."""
    if spec is None:
        return startup_shapes(0)
    k = spec.num_speculative_tokens
    if tree is None:
        return startup_shapes(k)
    branching = tree.num_nodes > tree.depth
    chains = min(k, tree.depth) if chains_in_tree_mode or not branching else 0
    return startup_shapes(chains, tree.num_nodes if branching else None)


class TargetGraphRunner:
    def __init__(self, target, builder, kv_caches: list, buckets: tuple[int, ...],
                 max_query_len: int, max_seq_len: int, use_graphs: bool, pool=None) -> None:
        """``max_query_len``: the longest uniform query it runs (1 + a step's drafts);
        ``max_seq_len``: the longest sequence a captured forward attends over (a host bound
        backends may size work buffers by: TORCH_SDPA gathers [bucket, max_seq_len] keys
        per layer, drafter/graphs.py ``sdpa_gather_bytes``); ``pool``: the graph memory
        pool to capture in (None: a pool of its own)."""
        self.target, self.builder, self.kv_caches = target, builder, kv_caches
        self.buckets = tuple(sorted(buckets))
        self.max_query_len, self.max_seq_len = max_query_len, max_seq_len
        self.use_graphs = use_graphs
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        # key -> the captured forward's output (on the CPU: the key's last eager output; the
        # head's first forward reads it, drafter/first_forward_graphs.py)
        self.outputs: dict[tuple, object] = {}
        self.capture_bytes: dict[tuple, int] = {}
        self.pool = pool if pool is not None or not use_graphs \
            else torch.cuda.graph_pool_handle()
        self.num_replays = 0  # steps this runner ran (replayed, or eagerly on the CPU)
        # Keys prepared by ``capture`` (captured, or run once eagerly on the CPU), and keys a
        # step met first (captured then, on a GPU, in the middle of serving).
        self.startup_keys: set[tuple] = set()
        self.late_keys: set[tuple] = set()

    def bucket_for(self, scheduled: list[ScheduledRequest],
                   in_flight: list[InFlight] | None = None) -> int | None:
        """The bucket this runner runs the batch in, or None when it runs eagerly
        (not uniform, images, too many rows, too long a query or sequence); ``in_flight``:
        per request an ``InFlight`` (rocdraft/core/step_batch.py), whose tokens computed
        ahead of ``num_computed_tokens`` count at their most (async scheduling)."""
        if not scheduled or len(scheduled) > self.buckets[-1]:
            return None
        q = scheduled[0].num_new_tokens
        if q > self.max_query_len or any(s.num_new_tokens != q for s in scheduled):
            return None
        ahead = [0] * len(scheduled) if in_flight is None \
            else [0 if entry is None else entry.kept + entry.more for entry in in_flight]
        if any(s.request.num_computed_tokens + extra + q > self.max_seq_len
               for s, extra in zip(scheduled, ahead)):
            return None
        if any(getattr(s.request, "images", None) is not None for s in scheduled):
            return None
        return next(b for b in self.buckets if b >= len(scheduled))

    def forward(self, batch: StepBatch, aux_layer_ids: tuple[int, ...]):
        """The target forward of a padded batch -> its TargetOutput over the real tokens
        (views of the static outputs: valid until the next step)."""
        key = graph_key(batch, aux_layer_ids)
        if key not in self.startup_keys and key not in self.late_keys:
            self.late_keys.add(key)
            log.info("target forward key %s (bucket, q, drafts, tree mask, aux) first met in "
                     "a step%s", key, ": capturing it now" if self.use_graphs else "")
        if not self.use_graphs:  # the key's "static" outputs: this step's, kept as on a GPU
            out = self.outputs[key] = self._run(batch, aux_layer_ids)
        else:
            if key not in self.graphs:
                self._capture(key, batch, aux_layer_ids)
            self.graphs[key].replay()
            out = self.outputs[key]
        self.num_replays += 1
        tokens = batch.common.num_actual_tokens
        return type(out)(out.hidden_states[:tokens],
                         tuple(a[:tokens] for a in out.aux_hidden_states))

    def capture(self, shapes: tuple[UniformShape, ...], aux_layer_ids: tuple[int, ...],
                make_batch, max_num_tokens: int) -> int:
        """Prepare every (bucket, shape) key that a step of at most ``max_num_tokens``
        tokens (the scheduler's budget) can meet, largest bucket first (the pool then fits
        the smaller ones): captured on a GPU, run once eagerly on the CPU (the same padded
        inputs). ``make_batch(shape, bucket)``: a padding-only batch
        (rocdraft/core/step_batch.py ``padding_only_batch``) -> keys newly prepared."""
        done = 0
        for bucket in sorted(self.buckets, reverse=True):
            below = max([b for b in self.buckets if b < bucket], default=0)
            for shape in shapes:
                # The fewest rows this bucket runs (one more than the bucket below) must fit.
                if shape.query_len > self.max_query_len \
                        or (below + 1) * shape.query_len > max_num_tokens:
                    continue
                batch = make_batch(shape, bucket)
                key = graph_key(batch, aux_layer_ids)
                if key in self.startup_keys:
                    continue
                if self.use_graphs:
                    self._capture(key, batch, aux_layer_ids)
                else:
                    self.outputs[key] = self._run(batch, aux_layer_ids)
                self.startup_keys.add(key)
                done += 1
        return done

    def _run(self, batch: StepBatch, aux_layer_ids: tuple[int, ...]):
        """The forward on the static inputs, with the key's host integers."""
        padded = batch.padded
        common = padded.common.with_updates(max_seq_len=self.max_seq_len)
        metadata = self.builder.build_for_graph_capture(common)
        return self.target(padded.input_ids, padded.positions, self.kv_caches, metadata,
                           aux_layer_ids=aux_layer_ids)

    def _capture(self, key: tuple, batch: StepBatch, aux_layer_ids: tuple[int, ...]) -> None:
        self.graphs[key], self.capture_bytes[key], self.outputs[key] = capture_one(
            lambda: self._run(batch, aux_layer_ids), self.pool)
        log.debug("captured the target forward for (bucket, q, drafts, tree mask, aux) %s: "
                  "%d bytes reserved", key, self.capture_bytes[key])
