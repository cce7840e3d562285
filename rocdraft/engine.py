"""The engine. ``LLMEngine`` loads the target (and an EAGLE head), picks attention backends
through the registry, allocates the paged KV caches, and runs continuous batching one step
at a time over requests that join (``add_request``) and leave (``abort_request``, or when
they finish) between any two steps:

    schedule -> target forward -> rejection sampler -> request updates -> drafter

With a tree config (static or EAGLE-2 dynamic), a step verifies each request's draft tree in
the same target forward (``spec_mask``), walks it with the tree sampler, compacts the target
KV cache to the accepted path and drafts the next tree level by level (rocdraft/tree_step.py,
drafter/tree_draft.py).

``LLM`` is the offline front end: ``generate`` adds a batch and steps until it is done.
The engine is not thread-safe: one thread calls add/abort/step (rocdraft/serve runs it in
its own loop thread).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from rocdraft import envs
from rocdraft.backends import registry
from rocdraft.backends.base import Feature
from rocdraft.backends.kv_cache import allocate_kv_cache
from rocdraft.config import (EngineConfig, SamplingParams, SchedulerConfig, SpeculativeConfig,
                             check_int)
from rocdraft.distributed.engine_setup import start_tensor_parallel, worker_spec
from rocdraft.distributed.group import DEFAULT_TIMEOUT_S
from rocdraft.draft_policy import (EXPLORE_EVERY, AcceptanceTracker, StepCosts, batch_bucket,
                                   choose_num_drafts)
from rocdraft.drafter.eagle import EagleProposer
from rocdraft.drafter.graphs import DraftLoopRunner, capture_buckets, graph_capture_refusal
from rocdraft.drafter.tree_graphs import TreeLoopRunner
from rocdraft.drafter.tree_index import host_depths
from rocdraft.drafter.tree_spec import DynamicTree, StaticTree, draft_lookahead
from rocdraft.errors import RocdraftError
from rocdraft.kv_budget import (check_sizing, head_cache_spec, kv_bytes_per_block,
                                plan_kv_cache)
from rocdraft.loading import load_draft_head, load_target_model
from rocdraft.models.compiled_regions import compile_backend, compiled_regions
from rocdraft.models.rope import reserve_positions
from rocdraft.outputs import GenerationStats, RequestOutput
from rocdraft.platform import detect_platform
from rocdraft.prompts import prompt_error, tokenize_prompt
from rocdraft.rejection_sampler import rejection_sample
from rocdraft.request import Request
from rocdraft.sampler import SamplingTensorCache
from rocdraft.scheduler import Scheduler, ScheduledRequest
from rocdraft.step_batch import StepBatch, build_step_batch
from rocdraft.step_costs import EngineParts, measure_step_costs
from rocdraft.throughput_guard import ThroughputGuard
from rocdraft.draft_shape import DraftShapeChooser, chain_on_tree_step
from rocdraft.tree_budget import TreeAcceptanceEstimate, choose_nodes_per_request
from rocdraft.tree_step import compact_target_kv, head_inputs_after_tree, verify_tree_step

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine:
    def __init__(self, target: str, draft: str | None = None,
                 speculative_config: SpeculativeConfig | None = None, dtype: str = "float32",
                 device: str | None = None, attention_backend: str | None = None,
                 draft_attention_backend: str | None = None, block_size: int = 16,
                 num_kv_blocks: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 kv_cache_memory: int | float | str | None = None,
                 gpu_memory_utilization: float | None = None, tensor_parallel_size: int = 1,
                 distributed_backend: str | None = None,
                 distributed_timeout_s: float = DEFAULT_TIMEOUT_S,
                 compile: bool | str = False) -> None:
        """KV-cache size (``rocdraft.kv_budget``): ``num_kv_blocks``, or ``kv_cache_memory``
        bytes ("2GiB"), or ``gpu_memory_utilization`` (a fraction of the free GPU memory), or
        by default what ``max_num_seqs`` x ``max_model_len`` needs, capped (256 MiB on the
        CPU); the draft head's cache shares the same budget (per rank under tensor
        parallelism: each rank's caches hold its KV heads).

        ``tensor_parallel_size`` N > 1 runs the target sharded over N processes (this one is
        rank 0; rocdraft/distributed/executor.py starts the others, or torchrun did);
        ``distributed_backend`` gloo | nccl (default nccl on GPUs, gloo on the CPU);
        ``distributed_timeout_s`` bounds every collective. Call ``close()`` (or use the
        engine as a context manager) to stop the workers.

        ``compile`` True (inductor) or a backend name ("inductor", "aot_eager", "eager")
        runs the dense halves of every target and head block through ``torch.compile``
        (models/compiled_regions.py: off by default, it lost on the CPU)."""
        self.executor = None
        for name, value in (("max_num_seqs", max_num_seqs), ("block_size", block_size),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("num_kv_blocks", num_kv_blocks), ("max_model_len", max_model_len)):
            check_int(name, value, minimum=1, optional=name in ("num_kv_blocks",
                                                                "max_model_len"))
        envs.check_switches()
        self.compile_backend = compile_backend(compile)
        if self.compile_backend is not None and tensor_parallel_size != 1:
            raise RocdraftError(f"compile={compile!r} with tensor_parallel_size "
                                f"{tensor_parallel_size} is not supported (the compiled block "
                                f"tail would hold the row-parallel all-reduce); drop one")
        if draft and speculative_config is None:
            raise RocdraftError("a draft head was given without speculative_config; pass "
                                "SpeculativeConfig(method='eagle' or 'eagle3', ...)")
        platform = detect_platform()
        device = device or platform.device
        if device.startswith("cuda") and not platform.is_gpu:
            raise RocdraftError(f"device {device!r} requested but no GPU is visible; use cpu")
        check_sizing(num_kv_blocks, kv_cache_memory, gpu_memory_utilization,
                     on_gpu=device != "cpu")
        spec = speculative_config
        self.tree = spec.draft_tree() if spec is not None else None
        if self.tree is not None:
            _check_tree(spec, self.tree, attention_backend, draft_attention_backend,
                        max_num_batched_tokens, max_model_len)
        self.config = EngineConfig(target=target, draft=draft, speculative=speculative_config,
                                   dtype=dtype, device=device,
                                   attention_backend=attention_backend,
                                   draft_attention_backend=draft_attention_backend)
        self.device, self.torch_dtype = device, _DTYPES[dtype]
        kind = "cpu" if device == "cpu" else platform.kind
        tree_features = (Feature.TREE_DRAFTING,) if self.tree is not None else ()
        if tensor_parallel_size != 1:  # refusals before any weight loads
            self.executor = start_tensor_parallel(target, tensor_parallel_size,
                                                  distributed_backend, device,
                                                  distributed_timeout_s)
        executor = self.executor
        self.target, self.tokenizer, self.backend = load_target_model(
            target, self.torch_dtype, device, kind, block_size,
            attention_backend or envs.checked_backend(envs.ATTENTION_BACKEND,
                                                      registry.registered_names()),
            tree_features, executor and executor.group, executor and executor.counter)
        if executor is not None:
            self.target = executor.wrap_target(self.target)
        if self.compile_backend is not None:
            self.target.regions = compiled_regions(self.compile_backend)
        cfg = self.target.config
        self.max_model_len = min(max_model_len if max_model_len is not None
                                 else cfg.max_position_embeddings, cfg.max_position_embeddings)
        if cfg.sliding_window:  # attention here is full: stay where that equals the window's
            self.max_model_len = min(self.max_model_len, cfg.sliding_window)
        self.builder = self.backend.builder_cls(device)
        if device != "cpu" and isinstance(self.target, torch.nn.Module):
            reserve_positions(self.target, self.max_model_len + 1)  # RoPE rows looked up
        self.head, self.draft_backend, self.proposer = None, None, None
        self.tree_acceptance = None  # the dynamic tree's cost-based budget (_setup_drafter)
        self.throughput_guard = None  # the cost policy's realized-throughput veto (idem)
        self.shape_chooser = None  # a tree config's tree-or-chain choice per bucket (idem)
        self.drafted_shape: str | None = None  # what the last step drafted: "tree" | "chain"
        self.aux_layer_ids: tuple[int, ...] = ()  # target layers whose inputs EAGLE-3 reads
        self.draft_graph_refusal: str | None = "no speculative decoding"
        k = spec.num_speculative_tokens if spec else 0
        # Slots a request needs past its tokens for the drafts of one step.
        lookahead = draft_lookahead(self.tree) if self.tree is not None else k
        cache_specs = [self.target.kv_cache_spec()]
        if spec:
            cache_specs.append(head_cache_spec(self.config.draft, spec.method))
        self.kv_cache_plan = plan_kv_cache(
            block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
            num_lookahead_tokens=lookahead, bytes_per_block=kv_bytes_per_block(
                block_size, self.torch_dtype.itemsize, cache_specs),
            num_kv_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            free_device_memory=None if device == "cpu" else torch.cuda.mem_get_info(device)[0])
        num_blocks = self.kv_cache_plan.num_blocks
        log.info("KV cache: %s", self.kv_cache_plan.describe())
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len, block_size=block_size, num_blocks=num_blocks,
            num_lookahead_tokens=lookahead)
        num_layers, num_kv_heads, head_dim = self.target.kv_cache_spec()
        self.kv_caches = allocate_kv_cache(num_layers, num_blocks, block_size, num_kv_heads,
                                           head_dim, self.torch_dtype, device)
        if spec:
            self._setup_drafter(spec, kind, block_size, num_blocks, max_num_seqs,
                                max_num_batched_tokens)
        self.scheduler = Scheduler(self.scheduler_config)
        self.requests: dict = {}  # request id -> Request, in flight (added, not yet reported done)
        # Counters over every step this engine ran (generate() also keeps its own call's);
        # positions are chain positions, or tree depths.
        self.stats = GenerationStats(num_speculative_tokens=self._num_positions())
        self.last_stats = GenerationStats()
        self.sampling_cache = SamplingTensorCache()  # a batch's sampling tensors, kept across steps
        # True: synchronise a GPU at each phase boundary so the time split is exact (bench).
        self.sync_timing = False
        if executor is not None:
            executor.start_workers(worker_spec(self, block_size, num_blocks))

    def close(self) -> None:
        """Stop the tensor-parallel workers (SHUTDOWN, join, kill leftovers); idempotent,
        nothing to do at TP 1. Also run at interpreter exit and on garbage collection."""
        if self.executor is not None:
            self.executor.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _setup_drafter(self, spec: SpeculativeConfig, kind: str, block_size: int,
                       num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        # The registry picks the head's backend: the argument, else the env var, else the
        # target's when it can run the draft loop (captured on a GPU), else the first that can.
        arch = detect_platform().arch if kind != "cpu" else None
        # Under tensor parallelism the head runs on this rank alone, over whole copies of the
        # target's vocabulary tables: its draft loop holds no collective
        # (rocdraft/distributed/head_tables.py says why).
        vocab_source = self.target
        if self.executor is not None:
            from rocdraft.distributed.head_tables import load_vocab_tables

            vocab_source = load_vocab_tables(self.config.target, self.target.config,
                                             self.torch_dtype, self.device)
        self.head, draft_selection = load_draft_head(
            self.config.draft, vocab_source, spec.method, self.torch_dtype, self.device, kind,
            block_size, self.backend.name, self.config.draft_attention_backend,
            spec.num_speculative_tokens, need_graphs=kind != "cpu" and not spec.enforce_eager,
            arch=arch, features=(Feature.TREE_DRAFTING,) if self.tree is not None else ())
        if self.compile_backend is not None:
            self.head.regions = compiled_regions(self.compile_backend)
        if self.device != "cpu":
            reserve_positions(self.head, self.max_model_len + 1)
        self.draft_backend, self.draft_backend_reason = draft_selection.backend, \
            draft_selection.reason
        log.info("draft attention backend %s: %s", self.draft_backend.name,
                 self.draft_backend_reason)
        if spec.num_speculative_tokens > 1:
            registry.require(self.draft_backend.name, Feature.MULTI_TOKEN_DRAFTING,
                             f"drafting {spec.num_speculative_tokens} tokens per step")
        self.aux_layer_ids = self.head.aux_layer_ids(self.target.config.num_hidden_layers)
        # Draft-count policy state: running acceptance per position, step costs per bucket.
        self.acceptance = AcceptanceTracker(spec.num_speculative_tokens, spec.acceptance_prior)
        self.step_costs: dict[int, StepCosts] = {}
        # A tree config's chains (rocdraft/draft_shape.py): the chain's costs per bucket.
        self.chain_step_costs: dict[int, StepCosts] = {}
        self.given_step_costs = StepCosts(*spec.draft_costs) if spec.draft_costs else None
        self.policy_steps = 0  # steps the cost policy chose for (drives its exploration)
        # Chains under the cost policy with measured costs: speculation is vetoed where it is
        # measured slower than plain decoding (rocdraft/throughput_guard.py).
        self.throughput_guard = ThroughputGuard() if spec.draft_policy == "cost" \
            and spec.draft_costs is None and self.tree is None else None
        # A dynamic tree under the cost policy without a fixed budget: the batch budget of
        # each step comes from the step costs and measured acceptance (rocdraft/tree_budget.py).
        self.tree_acceptance = TreeAcceptanceEstimate(self.tree.num_nodes) \
            if isinstance(self.tree, DynamicTree) and spec.draft_policy == "cost" \
            and spec.max_draft_tokens_per_step is None else None
        num_layers, num_kv_heads, head_dim = self.head.kv_cache_spec()
        self.draft_kv_caches = allocate_kv_cache(num_layers, num_blocks, block_size,
                                                 num_kv_heads, head_dim, self.torch_dtype,
                                                 self.device)
        self.proposer = EagleProposer(
            self.head, self.draft_backend, spec.num_speculative_tokens,
            max_num_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len, block_size=block_size,
            vocab_size=self.target.config.vocab_size, device=self.device, tree=self.tree)
        self.proposer.validate_kv_caches(self.draft_kv_caches)
        self.draft_graph_refusal = graph_capture_refusal(self.draft_backend, self.device,
                                                         spec.enforce_eager)
        # A tree config under the cost policy drafts per batch bucket the tree or a chain of
        # at most min(k, depth) drafts, whichever measured faster (rocdraft/draft_shape.py);
        # on a GPU both the tree levels and the chain's loop are captured.
        self.shape_chooser = DraftShapeChooser() if self.tree is not None \
            and spec.draft_policy == "cost" and spec.draft_costs is None else None
        if self.draft_graph_refusal is None and self.tree is not None:
            if self.proposer.tree_drafter.level_ends:  # a depth-1 tree has no level loop
                self.proposer.tree_runner = TreeLoopRunner(
                    self.proposer.tree_drafter, self.draft_kv_caches,
                    self.head.config.hidden_size, self.scheduler_config.max_blocks_per_seq,
                    capture_buckets(max_num_seqs), use_graphs=True)
        # A tree config's chains are at most min(k, depth) long: the captured k-draft loop
        # serves them only when the tree is at least k deep.
        if self.draft_graph_refusal is None and spec.num_speculative_tokens > 1 \
                and (self.tree is None or (self.shape_chooser is not None
                                           and self.tree.depth >= spec.num_speculative_tokens)):
            self.proposer.graph_runner = DraftLoopRunner(
                self.proposer, self.draft_kv_caches, self.head.config.hidden_size,
                self.scheduler_config.max_blocks_per_seq, capture_buckets(max_num_seqs),
                use_graphs=True)
        if self.draft_graph_refusal is not None:
            log.info("draft loop runs eagerly: %s", self.draft_graph_refusal)

    # --- the step API ----------------------------------------------------------------------

    def add_request(self, request_id, prompt, params: SamplingParams | None = None) -> None:
        """Queue a request (it joins the batch at the next step). prompt: a string (needs a
        tokenizer) or token ids. A RocdraftError naming the bad value for a duplicate id, a
        prompt that cannot run or bad params; the engine is then unchanged."""
        if request_id in self.requests:
            raise RocdraftError(f"request id {request_id!r} is already in flight")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RocdraftError(f"params for request {request_id!r} is a "
                                f"{type(params).__name__}, not a SamplingParams")
        req = self._make_request(request_id, prompt, params)
        if req.is_finished:
            raise RocdraftError(f"request {request_id!r}: {req.error}")
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id) -> bool:
        """Stop a request now and free its target and draft KV blocks (they share one block
        table). False when no such request is in flight."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(req)
        req.finish("abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_blocks(self) -> int:
        return self.scheduler_config.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.allocator.num_free_blocks

    def step(self) -> list[RequestOutput]:
        """Run one engine step -> the outputs of the requests that advanced: their new tokens
        (several with speculation), ``finished`` and ``finish_reason``. Finished requests
        leave the engine."""
        if not self.scheduler.has_unfinished:
            return []
        preemptions = self.scheduler.num_preemptions
        advanced = self._step(self.scheduler, self.stats)
        self.stats.num_preemptions += self.scheduler.num_preemptions - preemptions
        outputs = []
        for req, new_tokens in advanced:
            if req.is_finished:
                self.requests.pop(req.request_id, None)
            self.stats.generated_tokens += len(new_tokens)
            outputs.append(self._step_output(req, new_tokens))
        return outputs

    # --- internals -------------------------------------------------------------------------

    def _make_request(self, request_id, prompt, params: SamplingParams) -> Request:
        """A Request for ``prompt``; one that cannot run is already finished with "error"."""
        cfg = self.target.config
        ids, error = tokenize_prompt(prompt, self.tokenizer)
        req = Request(request_id, ids, params, eos_token_ids=tuple(cfg.eos_token_ids))
        error = error or prompt_error(ids, cfg.vocab_size, self.max_model_len)
        if error:
            req.finish("error", error)
        return req

    def _output(self, req: Request) -> RequestOutput:
        """The final output of a finished request, with its text."""
        text = None
        if self.tokenizer is not None and req.finish_reason != "error":
            text = self.tokenizer.decode(req.output_token_ids)
        return RequestOutput(list(req.prompt_token_ids), list(req.output_token_ids), text,
                             req.finish_reason or "length", req.error,
                             request_id=req.request_id, finished=True,
                             num_verify_steps=req.num_verify_steps,
                             num_accepted_drafts=req.num_accepted_drafts)

    @staticmethod
    def _step_output(req: Request, new_tokens: list[int]) -> RequestOutput:
        """One step's output of ``req`` (no text: a server decodes incrementally). The prompt
        list is shared, not copied."""
        return RequestOutput(req.prompt_token_ids, list(req.output_token_ids), None,
                             req.finish_reason, req.error, request_id=req.request_id,
                             new_token_ids=new_tokens, finished=req.is_finished,
                             num_verify_steps=req.num_verify_steps,
                             num_accepted_drafts=req.num_accepted_drafts)

    def _clock(self) -> float:
        """Host time; with ``sync_timing`` on a GPU, after the queued work finished (so the
        time split attributes GPU time to the right phase, at the cost of syncs)."""
        if self.sync_timing and self.device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter()

    def _step(self, scheduler: Scheduler, stats: GenerationStats
              ) -> list[tuple[Request, list[int]]]:
        """One step over ``scheduler``'s batch -> (request, tokens appended) of every request
        that sampled this step."""
        if self.proposer is not None and not scheduler.running:
            self._ensure_step_costs(scheduler)
        t0 = self._clock()
        scheduled = scheduler.schedule()
        batch = build_step_batch(scheduled, self.scheduler_config.max_blocks_per_seq,
                                 self.scheduler_config.block_size, self.device)
        t1 = self._clock()
        metadata = self.builder.build(batch.common)
        out = self.target(batch.input_ids, batch.positions, self.kv_caches, metadata,
                          aux_layer_ids=self.aux_layer_ids)
        flat = batch.sample_indices.view(-1)
        logits = self.target.compute_logits(out.hidden_states[flat]).view(
            len(scheduled), batch.max_drafts + 1, -1)
        t2 = self._clock()
        sampling = self.sampling_cache.get([s.request.params for s in scheduled], self.device)
        if sampling.any_seeded:  # a seeded row's noise depends on its output length
            sampling = sampling.with_position_seeds([
                (s.request.params.seed, len(s.request.output_token_ids))
                if samples and s.request.params.seed is not None else None
                for s, samples in zip(scheduled, batch.samples)])
        verified_tree, tree_scores = None, None
        if batch.draft_parents is not None:  # a tree step: walk, then compact the target KV
            verified_tree = verify_tree_step(logits, batch, sampling, self.tree.depth)
            sampled = verified_tree.sampled
            compact_target_kv(self.kv_caches, batch, verified_tree,
                              self.scheduler_config.block_size, self.executor)
        else:
            sampled = rejection_sample(logits, batch.draft_token_ids, batch.num_draft_tokens,
                                       batch.num_draft_tokens_cpu, sampling)
        t3 = self._clock()
        drafts, num_drafts = None, 0
        if self.proposer is not None:
            num_drafts = self._choose_num_drafts(scheduled)
        has_prefill = self._has_prefill(scheduled)
        shape = None
        if num_drafts or (self.proposer is not None and has_prefill):
            hidden = out.aux_hidden_states if self.aux_layer_ids else out.hidden_states
            if self.tree is not None:
                shape = self.shape_chooser.decide(len(scheduled)) \
                    if self.shape_chooser is not None else "tree"
                drafts, tree_scores = self._propose_tree(batch, sampled, hidden, verified_tree,
                                                         shape)
            else:
                drafts = self._propose(batch, sampled, hidden, max(num_drafts, 1))
        t4 = self._clock()
        sampled_cpu = sampled.tolist()  # the one device-to-host sync of a step
        drafts_cpu = drafts.tolist() if drafts is not None else None
        if shape == "tree" and drafts_cpu is not None:  # (tokens, parents, scores)
            width = self.tree.num_nodes
            # Node scores feed only the cost-based tree budget.
            scores_cpu = tree_scores.tolist() \
                if tree_scores is not None and self.tree_acceptance is not None \
                else [[]] * len(drafts_cpu)
            drafts_cpu = [(row[:int(row[-1])], row[width:width + int(row[-1])],
                           scores[:int(row[-1])]) for row, scores in zip(drafts_cpu, scores_cpu)]
        paths = verified_tree.accepted_nodes.tolist() if verified_tree is not None and (
            self.tree_acceptance is not None or self.shape_chooser is not None) else None
        chain_tokens = 0
        if self.shape_chooser is not None and paths is not None:  # the chain on this step
            chain = chain_on_tree_step(
                [s.request.spec_parents[:s.num_draft_tokens] for s in scheduled], paths,
                batch.samples, self.tree.ranks if isinstance(self.tree, StaticTree) else None,
                self._chain_policy_drafts(len(scheduled)), self._chain_cap(),
                self.acceptance.rates)
            chain_tokens = chain.tokens
            if chain.verified:
                self.acceptance.update(chain.verified, chain.accepted)
        advanced = self._update_requests(scheduler, scheduled, batch, sampled_cpu, drafts_cpu,
                                         stats, num_drafts, paths)
        t5 = self._clock()
        # Tokens the step produced, counted before a stop or max_tokens cut them short (a
        # request's last step would otherwise make its shape look slow).
        produced = sum(sum(t >= 0 for t in row)
                       for row, samples in zip(sampled_cpu, batch.samples) if samples)
        if self.throughput_guard is not None and not has_prefill:
            verified = any(s.num_draft_tokens for s in scheduled)
            drafted = drafts is not None and num_drafts > 0
            if verified == drafted:  # a pure step of one mode: a sample
                self.throughput_guard.record(len(scheduled), "spec" if drafted else "plain",
                                             produced, t5 - t0)
        if self.shape_chooser is not None:
            # A pure step of one shape (a tree step's sample needs a verified tree: a batch
            # of only the chains another step drafted verifies none).
            if not has_prefill and shape is not None and shape == self.drafted_shape \
                    and any(s.num_draft_tokens for s in scheduled) \
                    and (shape == "chain" or verified_tree is not None):
                self.shape_chooser.record(len(scheduled), shape, t5 - t0, produced,
                                          chain_tokens)
            self.drafted_shape = shape
        stats.num_steps += 1
        stats.time_s["bookkeeping"] += (t1 - t0) + (t5 - t4)
        stats.time_s["target_verify"] += t2 - t1
        stats.time_s["sampler"] += t3 - t2
        stats.time_s["draft"] += t4 - t3
        return advanced

    def drafts_per_request(self, batch_size: int) -> int:
        """The most drafts each request may verify next step: k, or fewer when
        ``max_draft_tokens_per_step`` caps the batch's total (0: plain decoding). The draft
        policy picks at most this many (``_choose_num_drafts``)."""
        spec = self.config.speculative
        if spec.max_draft_tokens_per_step is None:
            return spec.num_speculative_tokens
        return min(spec.num_speculative_tokens, spec.max_draft_tokens_per_step // batch_size)

    @staticmethod
    def _has_prefill(scheduled: list[ScheduledRequest]) -> bool:
        """Some request computes prompt tokens this step: the head must see them too."""
        return any(s.num_new_tokens - s.num_draft_tokens > 1 or not s.completes_prefill
                   or not s.request.output_token_ids for s in scheduled)

    def _choose_num_drafts(self, scheduled: list[ScheduledRequest]) -> int:
        """Drafts per request to make now (verified next step): the cap, or with
        ``draft_policy="cost"`` the count maximising expected tokens per second
        (rocdraft/draft_policy.py). 0: the drafter is skipped unless a prompt is in the step."""
        spec = self.config.speculative
        if self.tree is not None:  # the tree's own shape (and batch budget) decide
            return self.tree.num_nodes
        batch_size = len(scheduled)
        cap = self.drafts_per_request(batch_size)
        if spec.draft_policy == "fixed" or cap == 0:
            return cap
        costs = self._costs_for(batch_size)
        if costs is None:  # nothing measured yet (a step run outside generate): the cap
            return cap
        self.policy_steps += 1
        choice = choose_num_drafts(costs, self.acceptance.rates, batch_size, cap,
                                   explore=self.policy_steps % EXPLORE_EVERY == 0)
        if self.throughput_guard is not None:
            choice = self.throughput_guard.decide(batch_size, choice, cap)
        return choice

    def _costs_for(self, batch_size: int, measured: dict | None = None) -> StepCosts | None:
        """The given costs, else those of the batch's bucket in ``measured`` (default
        ``step_costs``), else the nearest measured."""
        if self.given_step_costs is not None:
            return self.given_step_costs
        measured = self.step_costs if measured is None else measured
        if not measured:
            return None
        bucket = batch_bucket(batch_size)
        if bucket in measured:
            return measured[bucket]
        below = [b for b in measured if b <= bucket]
        return measured[max(below) if below else min(measured)]

    def _chain_cap(self) -> int:
        """The longest chain a tree config drafts: min(k, tree depth)."""
        return min(self.config.speculative.num_speculative_tokens, self.tree.depth)

    def _chain_policy_drafts(self, batch_size: int, explore: bool = False) -> int:
        """Drafts of a chain a tree config would draft for this batch (rocdraft/
        draft_shape.py): at most ``_chain_cap``, under the cost policy the count maximising
        expected tokens per second from the chain's measured costs and acceptance (at least
        1); ``explore`` as in ``choose_num_drafts``."""
        costs = self._costs_for(batch_size, self.chain_step_costs)
        if costs is None:
            return self._chain_cap()
        return max(1, choose_num_drafts(costs, self.acceptance.rates, batch_size,
                                        self._chain_cap(), explore=explore))

    def _chain_drafts_in_tree_mode(self, batch_size: int) -> int:
        """``_chain_policy_drafts`` for the chain drafted now, exploring every
        EXPLORE_EVERY-th policy step (the step counter is shared with the tree budget: a
        tree config runs one of the two policies per step)."""
        self.policy_steps += 1
        return self._chain_policy_drafts(batch_size,
                                         explore=self.policy_steps % EXPLORE_EVERY == 0)

    def measure_step_costs(self) -> None:
        """Measure the cost policy's step costs of every batch bucket up to max_num_seqs now
        (about 0.6 s for buckets 1-8 of the built-in pair on a CPU core), so that no request
        pays for it: ``rocdraft serve`` calls it before it accepts requests. Otherwise each
        bucket is measured when a batch first needs it. A no-op without the cost policy,
        with given costs, or while requests hold KV blocks."""
        if self.proposer is not None:
            self._ensure_step_costs(self.scheduler, self.scheduler_config.max_num_seqs)

    def _ensure_step_costs(self, scheduler: Scheduler, batch_size: int | None = None) -> None:
        """Measure the step costs of each batch bucket (once per engine) up to
        ``batch_size`` (default: the largest batch this scheduler's queue can form), while no
        request holds KV blocks (the dummy forwards may then write anywhere in the caches)."""
        spec = self.config.speculative
        # What is measured, (table, chain steps?): a chain config's costs or a dynamic tree's
        # (its batch budget), and the chains a tree config may draft.
        tables = []
        if self.tree is None or self.tree_acceptance is not None:
            tables.append((self.step_costs, self.tree is None))
        if self.tree is not None and self.shape_chooser is not None:
            tables.append((self.chain_step_costs, True))
        if spec.draft_policy != "cost" or self.given_step_costs is not None or not tables \
                or scheduler.running \
                or scheduler.allocator.num_free_blocks != self.scheduler_config.num_blocks:
            return
        wanted = len(scheduler.waiting) if batch_size is None else batch_size
        largest = batch_bucket(min(max(wanted, 1), self.scheduler_config.max_num_seqs))
        start, measured = time.perf_counter(), set()
        for table, chain in tables:
            for bucket in (1 << i for i in range(largest.bit_length())):
                if bucket not in table:
                    table[bucket] = measure_step_costs(self._engine_parts(chain), bucket)
                    measured.add(bucket)
        if measured:
            log.info("draft policy: measured step costs of batch buckets %s in %.2f s",
                     sorted(measured), time.perf_counter() - start)

    def _engine_parts(self, chain: bool = False) -> EngineParts:
        """The measured parts; ``chain``: the chain's steps even in a tree config."""
        tree = self.tree if self.tree_acceptance is not None and not chain else None
        return EngineParts(self.target, self.builder, self.kv_caches, self.aux_layer_ids,
                           self.proposer, self.draft_kv_caches, self.scheduler_config,
                           self.max_model_len, self.config.speculative.num_speculative_tokens,
                           self.device, tree)

    def _propose(self, batch: StepBatch, sampled: torch.Tensor, hidden,
                 num_drafts: int | None = None) -> torch.Tensor:
        """Drafts [batch_size, num_drafts] for every row (rows that did not sample are
        discarded); num_drafts >= 1 (the first draft forward also keeps the head's KV
        cache in step with the target's), default the cap ``drafts_per_request``."""
        if num_drafts is None:
            num_drafts = max(self.drafts_per_request(batch.common.num_reqs), 1)
        args, rejected = self._head_inputs(batch, sampled, hidden)
        return self.proposer.propose(*args, num_rejected=rejected, num_drafts=num_drafts)

    def _propose_tree(self, batch: StepBatch, sampled: torch.Tensor, hidden,
                      verified_tree, shape: str = "tree"
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft each row's next tree -> ([B, 2N + 1] int64: tokens, parents, node count;
        the nodes' scores [B, N] float32 for dynamic trees, else None). After a tree step
        the batch is first reordered root + accepted path first, which makes the head's
        first forward the chain's (padded, or unpadded on the host). The batch budget: the
        configured one, or under the cost policy ``_tree_budget``'s. shape "chain": chain
        drafts [B, n <= min(k, depth)] (``_chain_drafts_in_tree_mode``) and no scores,
        verified next step as a chain."""
        if verified_tree is not None:
            batch, hidden = head_inputs_after_tree(batch, hidden, verified_tree)
        args, rejected = self._head_inputs(batch, sampled, hidden)
        if shape == "chain":
            return self.proposer.propose(
                *args, num_rejected=rejected,
                num_drafts=self._chain_drafts_in_tree_mode(batch.common.num_reqs)), None
        budget = self.config.speculative.max_draft_tokens_per_step
        if self.tree_acceptance is not None:
            budget = self._tree_budget(batch.common.num_reqs)
        trees = self.proposer.propose_tree(*args, budget)
        packed = torch.cat([trees.tokens, trees.parents, trees.num_nodes.view(-1, 1)], dim=1)
        return packed, trees.scores

    def _tree_budget(self, batch_size: int) -> int | None:
        """The batch node budget of the trees drafted now (rocdraft/tree_budget.py): B * n*,
        or None (the full tree) when it would not cut, before the first full trees were
        seen, without measured costs, and every EXPLORE_EVERY-th step (exploration)."""
        self.policy_steps += 1
        costs, accepted = self._costs_for(batch_size), self.tree_acceptance.accepted
        if costs is None or accepted is None or self.policy_steps % EXPLORE_EVERY == 0:
            return None
        n = choose_nodes_per_request(accepted, costs, batch_size, self.tree)
        return None if n >= self.tree.num_nodes else batch_size * n

    def _head_inputs(self, batch: StepBatch, sampled: torch.Tensor, hidden
                     ) -> tuple[tuple, torch.Tensor | None]:
        """The head's first-forward inputs -> ((token ids, positions, hidden, next token ids,
        last token indices, metadata, draft KV caches), num_rejected [B] on the padded path
        else None). Padded: rejected tokens stay as padding, no host sync; unpadded: they are
        dropped on the host."""
        proposer = self.proposer
        if self.config.speculative.padded_drafting:
            next_ids, _, indices, rejected = proposer.prepare_padded(
                sampled, batch.discard_request, batch.backup_next_token_ids, batch.common,
                batch.num_draft_tokens)
            return (batch.input_ids, batch.positions, hidden, next_ids, indices, batch.common,
                    self.draft_kv_caches), rejected
        sampled_cpu = sampled.tolist()
        next_ids = proposer.prepare_next_token_ids_cpu(
            sampled_cpu, batch.discard_request.tolist(), batch.backup_next_token_ids.tolist())
        num_rejected = torch.tensor([
            d + 1 - sum(t >= 0 for t in row) if d > 0 else 0
            for d, row in zip(batch.num_draft_tokens_cpu, sampled_cpu)], dtype=torch.int32)
        common, kept = proposer.prepare_inputs(batch.common, num_rejected)
        hidden = tuple(h[kept] for h in hidden) if isinstance(hidden, tuple) else hidden[kept]
        last = (common.query_start_loc[1:] - 1).long()
        return (batch.input_ids[kept], batch.positions[..., kept], hidden,
                torch.tensor(next_ids, device=self.device), last, common,
                self.draft_kv_caches), None

    def _num_positions(self) -> int:
        """Acceptance statistics positions: the chain length, or the tree's depth."""
        spec = self.config.speculative
        if spec is None:
            return 0
        return self.tree.depth if self.tree is not None else spec.num_speculative_tokens

    def _update_requests(self, scheduler: Scheduler, scheduled: list[ScheduledRequest],
                         batch: StepBatch, sampled_cpu, drafts_cpu, stats: GenerationStats,
                         per_request: int = 0, verified_tree_paths: list | None = None
                         ) -> list[tuple[Request, list[int]]]:
        """Append the step's tokens, advance the scheduler, keep ``per_request`` drafts per
        request for the next step and feed the acceptance estimates (``verified_tree_paths``:
        the accepted node indices per request of a verified dynamic tree, for the tree
        budget) -> (request, tokens appended) per request that sampled."""
        verified, accepted, advanced = [], [], []
        tree_rows = []  # (scores, accepted path) of verified dynamic trees: the tree budget's
        accepted_nodes = verified_tree_paths or []
        for row, item in enumerate(scheduled):
            req = item.request
            if not batch.samples[row]:  # partial prefill: nothing sampled yet
                scheduler.update_after_step(item, 0)
                continue
            tokens = [t for t in sampled_cpu[row] if t >= 0]
            num_accepted = len(tokens) - 1
            if item.num_draft_tokens:
                positions = item.num_draft_tokens
                if req.spec_parents:  # a tree: its depth is the positions it could accept
                    positions = host_depths(req.spec_parents)[-1]
                    stats.num_tree_verify_steps += 1
                stats.record_verification(positions, num_accepted, item.num_draft_tokens)
                req.num_verify_steps += 1
                req.num_accepted_drafts += num_accepted
                if not req.spec_parents:  # a chain (also in tree mode): chain acceptance
                    verified.append(item.num_draft_tokens)
                    accepted.append(num_accepted)
                if req.spec_scores:  # stored only for the cost-based tree budget
                    tree_rows.append((req.spec_scores[:item.num_draft_tokens],
                                      accepted_nodes[row][:num_accepted]))
            scheduler.update_after_step(item, num_accepted)
            before = len(req.output_token_ids)
            req.append_tokens(tokens, self.max_model_len)
            advanced.append((req, req.output_token_ids[before:]))
            if req.is_finished:
                scheduler.finish(req)
            elif drafts_cpu is not None and per_request:
                room = max(min(self.max_model_len - req.num_tokens, per_request), 0)
                if isinstance(drafts_cpu[row], tuple):  # a BFS prefix of a tree is a tree
                    tokens, parents, scores = drafts_cpu[row]
                    req.spec_token_ids, req.spec_parents = tokens[:room], parents[:room]
                    req.spec_scores = scores[:room]
                else:  # a chain (also one drafted in tree mode: verified as a chain)
                    req.spec_token_ids = drafts_cpu[row][:room]
        if verified:
            self.acceptance.update(verified, accepted)
        if tree_rows:
            self.tree_acceptance.observe(tree_rows)
        return advanced


class LLM(LLMEngine):
    """The offline front end: ``generate`` runs a batch of prompts to completion."""

    def generate(self, prompts: list, sampling_params: SamplingParams | list | None = None,
                 on_tokens=None) -> list[RequestOutput]:
        """prompts: strings (need a tokenizer) or lists of token ids; one SamplingParams for
        all or one per prompt. A bad request fails alone (finish_reason "error").
        ``on_tokens(index, new_token_ids, finish_reason)`` is called after each step for
        each prompt that advanced (finish_reason None while it runs; ``rocdraft generate``
        streams text with it)."""
        if not isinstance(prompts, (list, tuple)):
            raise RocdraftError(f"prompts must be a list of strings or of token-id lists, got "
                                f"{type(prompts).__name__}")
        params = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif not isinstance(params, (list, tuple)):
            raise RocdraftError(f"sampling_params must be a SamplingParams or a list of them "
                                f"(one per prompt), got {type(params).__name__}")
        if len(params) != len(prompts):
            raise RocdraftError(f"{len(params)} sampling params for {len(prompts)} prompts")
        for i, sp in enumerate(params):  # refused before any request runs: nothing is lost
            if not isinstance(sp, SamplingParams):
                raise RocdraftError(f"sampling_params[{i}] is a {type(sp).__name__}, not a "
                                    f"SamplingParams")
        if self.requests:
            raise RocdraftError(f"generate() called while {len(self.requests)} requests added "
                                f"with add_request are in flight; step them to completion first")
        stats = GenerationStats(num_speculative_tokens=self._num_positions())
        # Ids private to this call: an int index per prompt wrapped so no user id collides.
        requests = [self._make_request(_BatchIndex(i), p, sp)
                    for i, (p, sp) in enumerate(zip(prompts, params))]
        preemptions_before = self.scheduler.num_preemptions
        for req in requests:
            if not req.is_finished:
                self.requests[req.request_id] = req
                self.scheduler.add(req)
        try:
            while self.scheduler.has_unfinished:
                for req, new_tokens in self._step(self.scheduler, stats):
                    if req.is_finished:
                        self.requests.pop(req.request_id, None)
                    if on_tokens is not None:
                        on_tokens(req.request_id.index, new_tokens, req.finish_reason)
        finally:
            for req in requests:  # an exception mid-run: nothing stays queued or holds blocks
                if self.requests.pop(req.request_id, None) is not None:
                    self.scheduler.abort(req)
            stats.num_preemptions = self.scheduler.num_preemptions - preemptions_before
            stats.generated_tokens = sum(len(r.output_token_ids) for r in requests)
            self.stats.merge(stats)
        self.last_stats = stats
        return [self._output(r) for r in requests]


def _check_tree(spec: SpeculativeConfig, tree, attention_backend: str | None,
                draft_attention_backend: str | None, max_num_batched_tokens: int,
                max_model_len: int | None) -> None:
    """Refuse a tree config before any weight loads: a named target or draft backend without
    TREE_DRAFTING (verification and per-level drafting need the tree mask; the error names
    the backends that have it), or a tree larger than the verification buffers."""
    for role, name in (("target", attention_backend or envs.attention_backend()),
                       ("draft", draft_attention_backend or envs.draft_attention_backend())):
        if name:
            registry.require(name, Feature.TREE_DRAFTING, f"{spec.tree_kind} tree drafting "
                             f"needs a tree mask in the {role} backend")
    verified = tree.num_nodes + 1
    for name, limit in (("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_model_len", max_model_len)):
        if limit is not None and verified > limit:
            raise RocdraftError(f"the {spec.tree_kind} tree verifies {verified} tokens per "
                                f"request (root + {tree.num_nodes} nodes), more than {name} "
                                f"{limit}; use a smaller tree or raise {name}")


@dataclass(frozen=True)
class _BatchIndex:
    """A request id of ``LLM.generate``: the prompt's index, distinct from any user id."""

    index: int

    def __str__(self) -> str:
        return str(self.index)
