"""``ModelRunner``: the target side of a step. It owns the platform and dtype, the
tensor-parallel executor, the target model and its attention backend, the KV-cache plan and
the target's caches, the metadata builder and the sampling tensors; it runs the target
forward over a step's batch and verifies the drafts that batch carried.

    StepBatch ──forward──> target hidden states [num_tokens, H] (aux layers for EAGLE-3),
                           logits at the sample positions [B, max_drafts + 1, V]
              ──verify──>  sampled [B, max_drafts + 1] (-1 = rejected): the rejection
                           sampler for chains; for trees the tree walk, then the accepted
                           nodes' K/V compacted onto the accepted path

The draft side (the head, its cache, the proposer) is rocdraft/spec_decode/draft_runner.py;
the engine (rocdraft/engine/llm_engine.py) holds both and the scheduler.
"""
from __future__ import annotations

import logging
import time

import torch

from rocdraft import envs
from rocdraft.backends import registry
from rocdraft.backends.base import Feature
from rocdraft.backends.kv_cache import allocate_kv_cache
from rocdraft.config import SchedulerConfig
from rocdraft.core.kv_budget import kv_bytes_per_block, plan_kv_cache
from rocdraft.core.scheduler import ScheduledRequest
from rocdraft.core.step_batch import (StepBatch, UniformShape, build_step_batch,
                                      padding_only_batch)
from rocdraft.core.step_inputs import StepInputBuffers
from rocdraft.distributed.engine_setup import start_tensor_parallel, worker_spec
from rocdraft.drafter.graphs import capture_buckets
from rocdraft.engine.args import EngineArgs
from rocdraft.engine.loading import head_dtype, load_target_model
from rocdraft.engine.target_graphs import (TargetGraphRunner, captured_seq_len,
                                           input_bytes_bound, target_graph_refusal)
from rocdraft.errors import RocdraftError
from rocdraft.models.compiled_regions import compiled_regions
from rocdraft.models.rope import reserve_positions
from rocdraft.platform import TORCH_DTYPES, detect_platform
from rocdraft.sample.rejection_sampler import rejection_sample
from rocdraft.sample.sampler import SamplingTensorCache
from rocdraft.sample.tree_step import compact_target_kv, verify_tree_step
from rocdraft.sample.tree_sampler import TreeVerifyResult

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, args: EngineArgs, head_cache_specs: list[tuple[int, int, int]],
                 num_lookahead_tokens: int, tree=None) -> None:
        """Start the TP workers' group (refusals before any weight loads), load the target,
        plan the KV cache for the target and ``head_cache_specs`` (one budget for both) with
        ``num_lookahead_tokens`` slots per request for a step's drafts, and allocate the
        target's caches. ``tree``: the draft tree config (its depth bounds tree verification)."""
        platform = detect_platform()
        self.device, self.torch_dtype = args.device, TORCH_DTYPES[args.dtype]
        self.platform_kind = "cpu" if self.device == "cpu" else platform.kind
        self.arch = platform.arch if self.platform_kind != "cpu" else None
        self.sync_timing = args.sync_timing
        self.tree = tree
        self.executor = None
        if args.tensor_parallel_size != 1:
            self.executor = start_tensor_parallel(args.target, args.tensor_parallel_size,
                                                  args.distributed_backend, self.device,
                                                  args.distributed_timeout_s)
        executor = self.executor
        tree_features = (Feature.TREE_DRAFTING,) if tree is not None else ()
        self.target, self.tokenizer, self.backend = load_target_model(
            args.target, self.torch_dtype, self.device, self.platform_kind, args.block_size,
            args.attention_backend or envs.checked_backend(envs.ATTENTION_BACKEND,
                                                           registry.registered_names()),
            tree_features, executor and executor.group, executor and executor.counter)
        if executor is not None:
            self.target = executor.wrap_target(self.target)
        if tree is not None and getattr(self.target, "vl_config", None) is not None:
            spec = args.speculative_config
            raise RocdraftError(f"{spec.tree_kind} tree drafting on the vision-language target "
                                f"{args.target} is not supported (M-RoPE tree positions); use "
                                f"a chain (num_speculative_tokens without a tree)")
        if args.compile_backend is not None:
            self.target.regions = compiled_regions(args.compile_backend)
        cfg = self.target.config
        self.max_model_len = min(args.max_model_len if args.max_model_len is not None
                                 else cfg.max_position_embeddings, cfg.max_position_embeddings)
        if cfg.sliding_window:  # attention here is full: stay where that equals the window's
            self.max_model_len = min(self.max_model_len, cfg.sliding_window)
        self.builder = self.backend.builder_cls(self.device)
        if self.device != "cpu" and isinstance(self.target, torch.nn.Module):
            reserve_positions(self.target, self.max_model_len + 1)  # RoPE rows looked up
        self.kv_cache_plan = plan_kv_cache(
            block_size=args.block_size, max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len, num_lookahead_tokens=num_lookahead_tokens,
            bytes_per_block=kv_bytes_per_block(
                args.block_size, self.torch_dtype.itemsize,
                [self.target.kv_cache_spec(), *head_cache_specs],
                head_dtype(args.speculative_config, self.torch_dtype).itemsize
                if args.speculative_config is not None else None),
            num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            free_device_memory=None if self.device == "cpu"
            else torch.cuda.mem_get_info(self.device)[0])
        log.info("KV cache: %s", self.kv_cache_plan.describe())
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=self.max_model_len, block_size=args.block_size,
            num_blocks=self.kv_cache_plan.num_blocks, num_lookahead_tokens=num_lookahead_tokens)
        num_layers, num_kv_heads, head_dim = self.target.kv_cache_spec()
        self.kv_caches = allocate_kv_cache(num_layers, self.kv_cache_plan.num_blocks,
                                           args.block_size, num_kv_heads, head_dim,
                                           self.torch_dtype, self.device)
        self.sampling_cache = SamplingTensorCache()  # a batch's sampling tensors, kept
        # The graph memory pool the target forward's graphs are captured in (None where they
        # are not captured); the head's first forward and the draft loops capture in it too
        # (engine/loading.py).
        self.graph_pool = None
        self.graphs, self.graph_refusal = self._graph_runner(args, num_lookahead_tokens)
        cfg = self.scheduler_config
        self.step_inputs = StepInputBuffers(self.device, 0 if self.graphs is None else
                                            input_bytes_bound(self.graphs.buckets[-1],
                                                              self.graphs.max_query_len,
                                                              cfg.max_blocks_per_seq))

    def _graph_runner(self, args: EngineArgs, num_lookahead_tokens: int
                      ) -> tuple[TargetGraphRunner | None, str | None]:
        """The target's graph runner (rocdraft/engine/target_graphs.py) and why it does not
        capture: built where capture is allowed, or everywhere with ``graph_mode=
        "replay-eagerly"`` (the CPU replays its static inputs eagerly) unless tensor
        parallelism or compile rule it out; None where neither."""
        refusal = target_graph_refusal(self.backend, self.device, args.eager,
                                       self.executor is not None,
                                       args.compile_backend is not None)
        replay = args.graph_mode == "replay-eagerly" and self.executor is None \
            and args.compile_backend is None
        if refusal is not None:
            log.info("target forward runs eagerly: %s", refusal)
        if refusal is not None and not replay:
            return None, refusal
        if refusal is None:  # one pool for every graph (graph_pool above)
            self.graph_pool = torch.cuda.graph_pool_handle()
        buckets = capture_buckets(args.max_num_seqs)
        _, num_kv_heads, head_dim = self.target.kv_cache_spec()
        runner = TargetGraphRunner(self.target, self.builder, self.kv_caches, buckets,
                                   max_query_len=num_lookahead_tokens + 1,
                                   max_seq_len=captured_seq_len(
                                       self.backend, self.max_model_len, buckets[-1],
                                       num_kv_heads, head_dim, num_lookahead_tokens + 1),
                                   use_graphs=refusal is None, pool=self.graph_pool)
        return runner, refusal

    def capture_target_graphs(self, shapes: tuple[UniformShape, ...],
                              aux_layer_ids: tuple[int, ...]) -> None:
        """Capture the target forward for every bucket and shape now (start-up: no request
        holds KV, and capture writes none anyway), so no step pays a capture; on the CPU
        with ``graph_mode="replay-eagerly"`` each key runs once on its padding-only inputs.
        Nothing to do without a graph runner."""
        if self.graphs is None:
            return
        start = time.perf_counter()
        count = self.graphs.capture(shapes, aux_layer_ids, self.padding_batch,
                                    self.scheduler_config.max_num_batched_tokens)
        log.info("target forward: %d keys %s at start-up in %.2f s (buckets %s, shapes %s)%s",
                 count, "captured" if self.graphs.use_graphs else "prepared (run eagerly)",
                 time.perf_counter() - start, list(self.graphs.buckets),
                 [(s.query_len, s.num_drafts, s.tree_mask) for s in shapes],
                 f", {sum(self.graphs.capture_bytes.values()) / 2**20:.1f} MiB of graph memory"
                 if self.graphs.use_graphs else "")

    def padding_batch(self, shape: UniformShape, bucket: int) -> StepBatch:
        """A batch of ``bucket`` padding rows of ``shape`` in the graph runner's static
        inputs (rocdraft/core/step_batch.py ``padding_only_batch``): what capture runs on."""
        return padding_only_batch(shape, bucket, self.scheduler_config.max_blocks_per_seq,
                                  self.device, self.step_inputs)

    def start_workers(self, target: str) -> None:
        """Start the TP workers once rank 0 is built (they load their shards of ``target``
        and allocate their caches for the planned blocks); nothing to do at TP 1."""
        if self.executor is not None:
            cfg = self.scheduler_config
            self.executor.start_workers(worker_spec(
                target, self.executor.tp_size, self.torch_dtype, self.device,
                self.backend.name, cfg.block_size, cfg.num_blocks))

    def close(self) -> None:
        """Stop the tensor-parallel workers (idempotent; nothing to do at TP 1)."""
        if self.executor is not None:
            self.executor.close()

    def clock(self) -> float:
        """Host time; with ``sync_timing`` on a GPU, after the queued work finished (so the
        time split attributes GPU time to the right phase, at the cost of syncs)."""
        if self.sync_timing and self.device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter()

    def work_clock(self) -> float:
        """The clock the draft policy learns step times from. On the CPU this thread's CPU
        time: time the machine's other jobs take from this process does not count, so the
        policy's choices do not follow the machine's load (with several intra-op threads it
        counts this thread's part, which tracks the step's work while torch splits it
        evenly; the issue's figures use 1 thread). On a GPU the host
        clock, as ``clock`` (the GPU's time passes while the host waits)."""
        if self.device == "cpu":
            return time.thread_time()
        return self.clock()

    def build_batch(self, scheduled: list[ScheduledRequest],
                    in_flight: list[InFlight] | None = None) -> StepBatch:
        """The step's inputs on the host and, in one copy, on the device
        (rocdraft/core/step_batch.py); padded to its bucket when the graph runner runs it.
        ``in_flight``: a step launched before the previous one landed, per request an
        ``InFlight`` (rocdraft/engine/overlap.py; ``build_step_batch``)."""
        cfg = self.scheduler_config
        bucket = self.graphs.bucket_for(scheduled, in_flight) if self.graphs is not None \
            else None
        return build_step_batch(scheduled, cfg.max_blocks_per_seq, cfg.block_size,
                                self.device, self.step_inputs, pad_to=bucket,
                                in_flight=in_flight)

    def plan(self, batch: StepBatch):
        """The attention metadata the eager target forward runs ``batch`` with (the backend's
        plan of ``batch.common``), or None for a batch the graph runner replays (its graphs
        hold their own). Built once per step: the head's first forward reuses it where it
        runs the same backend over the same batch (DraftRunner.shares_plan_with)."""
        return None if batch.padded is not None else self.builder.build(batch.common)

    def forward(self, batch: StepBatch, aux_layer_ids: tuple[int, ...] = (), metadata=None):
        """The target forward over ``batch`` (with its image embeddings spliced in, for a
        vision-language target) -> (model output: hidden_states [num_tokens, H] and the
        inputs of ``aux_layer_ids``, logits [B, max_drafts + 1, V] at the sample positions).
        metadata: ``plan(batch)`` when the caller built it, else built here."""
        if batch.padded is not None:  # a uniform batch: its graph (engine/target_graphs.py)
            out = self.graphs.forward(batch, aux_layer_ids)
        else:
            if metadata is None:
                metadata = self.builder.build(batch.common)
            images = {} if batch.target_splice is None else {"splice": batch.target_splice}
            out = self.target(batch.input_ids, batch.positions, self.kv_caches, metadata,
                              aux_layer_ids=aux_layer_ids, **images)
        flat = batch.sample_indices.view(-1)
        logits = self.target.compute_logits(out.hidden_states[flat]).view(
            batch.common.num_reqs, batch.max_drafts + 1, -1)
        return out, logits

    def verify(self, logits: torch.Tensor, batch: StepBatch,
               scheduled: list[ScheduledRequest], ahead: list[int] | None = None
               ) -> tuple[torch.Tensor, TreeVerifyResult | None]:
        """logits [B, max_drafts + 1, V] -> (sampled [B, max_drafts + 1] int64, -1 =
        rejected; the tree walk's result on a tree step, else None). Lossless for greedy
        and random sampling; a seeded row's noise depends on its output length only
        (``ahead``: per request the output tokens sampled but not landed yet, async decode)."""
        sampling = self.sampling_cache.get([s.request.params for s in scheduled], self.device)
        if sampling.any_seeded:
            ahead = ahead or [0] * len(scheduled)
            sampling = sampling.with_position_seeds([
                (s.request.params.seed, len(s.request.output_token_ids) + extra)
                if samples and s.request.params.seed is not None else None
                for s, samples, extra in zip(scheduled, batch.samples, ahead)])
        if batch.draft_parents is None:
            return rejection_sample(logits, batch.draft_token_ids, batch.num_draft_tokens,
                                    batch.num_draft_tokens_cpu, sampling), None
        # A tree step: walk each tree, then move the accepted nodes' K/V onto the path.
        verified_tree = verify_tree_step(logits, batch, sampling, self.tree.depth)
        compact_target_kv(self.kv_caches, batch, verified_tree,
                          self.scheduler_config.block_size, self.executor)
        return verified_tree.sampled, verified_tree
