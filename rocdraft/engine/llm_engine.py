"""``LLMEngine``: continuous batching one step at a time over requests that join
(``add_request``) and leave (``abort_request``, or when they finish) between any two steps.

It builds three parts and a scheduler, and passes each step's data between them:
- ``ModelRunner`` (rocdraft/engine/model_runner.py): the target, its KV cache and backend,
  the target forward and the verification of the drafts a batch carried;
- ``DraftRunner`` (rocdraft/spec_decode/draft_runner.py): the EAGLE head, its cache and the
  proposer, which drafts the next step's chains or trees;
- ``DraftPolicy`` (rocdraft/spec_decode/policy.py): how many drafts, tree or chain, the tree
  budget; it learns from one ``observe`` per step.

The engine is not thread-safe: one thread calls add/abort/step (rocdraft/serve runs it in
its own loop thread). ``LLM`` (rocdraft/engine/llm.py) is the offline front end.
"""
from __future__ import annotations

import logging
import time

from rocdraft.config import SamplingParams
from rocdraft.core.kv_budget import head_cache_spec
from rocdraft.core.multimodal import image_prompt_error, read_multimodal_prompt
from rocdraft.core.prompts import prompt_error, tokenize_prompt
from rocdraft.core.request import Request
from rocdraft.core.scheduler import Scheduler, ScheduledRequest
from rocdraft.drafter.tree_spec import draft_lookahead
from rocdraft.engine.args import EngineArgs, async_speculation_error
from rocdraft.engine.loading import load_draft_runner
from rocdraft.engine.model_runner import ModelRunner
from rocdraft.engine.overlap import DecodeOverlap, Drafting
from rocdraft.engine.target_graphs import config_shapes
from rocdraft.engine.request_updates import (HostStep, apply_step, batch_outlook,
                                             has_prefill_tokens, read_step, step_record)
from rocdraft.errors import RocdraftError
from rocdraft.outputs import GenerationStats, RequestOutput
from rocdraft.spec_decode.cost_model import batch_bucket
from rocdraft.spec_decode.policy import DraftPolicy
from rocdraft.spec_decode.step_costs import EngineParts, measure_step_costs

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, *args, **kwargs) -> None:
        """The arguments of ``EngineArgs`` (rocdraft/engine/args.py), validated before
        anything loads. Call ``close()`` (or use the engine as a context manager) to stop
        tensor-parallel workers."""
        self._build(EngineArgs(*args, **kwargs))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        engine = cls.__new__(cls)
        engine._build(args)
        return engine

    def _build(self, args: EngineArgs) -> None:
        self.args, self.config = args, args.config
        spec = args.speculative_config
        self.tree = spec.draft_tree() if spec is not None else None
        # Slots a request needs past its tokens for the drafts of one step.
        lookahead = 0 if spec is None else draft_lookahead(self.tree) \
            if self.tree is not None else spec.num_speculative_tokens
        head_specs = [head_cache_spec(args.head_dir, spec.method)] if spec else []
        self.model_runner = ModelRunner(args, head_specs, lookahead, self.tree)
        self.policy = DraftPolicy(spec, self.tree) if spec else None
        if self.policy is not None:  # folded a few steps at a time (DraftPolicy.observe);
            self.policy.defer_observations = True  # all of them once the work is done
        # A tree config whose policy may draft chains (its tree-or-chain chooser).
        chains_in_tree_mode = self.policy is not None and self.policy.shape_chooser is not None
        self.draft_runner = load_draft_runner(
            args, self.model_runner, self.tree, chains_in_tree_mode) if spec else None
        self.model_runner.capture_target_graphs(
            config_shapes(spec, self.tree, chains_in_tree_mode),
            self.draft_runner.aux_layer_ids if self.draft_runner is not None else ())
        if self.draft_runner is not None:  # after the target's: it reads their outputs
            self.draft_runner.capture_first_forward(self.model_runner.graphs,
                                                    self.model_runner.padding_batch)
        self.scheduler = Scheduler(self.model_runner.scheduler_config)
        # Async decode (rocdraft/engine/overlap.py): None where steps run synchronously.
        self.overlap = DecodeOverlap(self.model_runner, self.max_model_len,
                                     self._drafting(lookahead) if spec else None) \
            if _async_scheduling(args, self.model_runner) else None
        self.requests: dict = {}  # request id -> Request, in flight (added, not yet reported done)
        # Counters over every step this engine ran (generate() also keeps its own call's);
        # positions are chain positions, or tree depths.
        self.stats = GenerationStats(num_speculative_tokens=self._num_positions())
        self.last_stats = GenerationStats()
        self.model_runner.start_workers(args.target)

    def close(self) -> None:
        """Stop the tensor-parallel workers (SHUTDOWN, join, kill leftovers); idempotent,
        nothing to do at TP 1. Also run at interpreter exit and on garbage collection."""
        self.model_runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- what front ends read ----------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.model_runner.tokenizer

    @property
    def model_config(self):
        """The target's ModelConfig (vocabulary, layers, heads; models/config.py)."""
        return self.model_runner.target.config

    @property
    def max_model_len(self) -> int:
        return self.model_runner.max_model_len

    @property
    def device(self) -> str:
        return self.model_runner.device

    @property
    def backend(self):
        """The target's attention backend class."""
        return self.model_runner.backend

    @property
    def draft_backend(self):
        """The head's attention backend class (None without speculation)."""
        return self.draft_runner.backend if self.draft_runner is not None else None

    @property
    def executor(self):
        """The tensor-parallel executor (None at TP 1): the server watches its workers'
        health through it."""
        return self.model_runner.executor

    @property
    def kv_cache_plan(self):
        return self.model_runner.kv_cache_plan

    @property
    def scheduler_config(self):
        return self.model_runner.scheduler_config

    def graph_memory(self) -> dict[str, int]:
        """Bytes the captured graphs reserved in their shared pool (each capture's growth of
        the reserved memory, summed): ``target`` (the target forward's keys) and ``draft``
        (the head's first forward, the chain loop and tree levels); 0 where nothing was
        captured (the CPU, eager)."""
        graphs, drafter = self.model_runner.graphs, self.draft_runner
        proposer = drafter.proposer if drafter is not None else None
        loops = [getattr(proposer, name, None) for name in ("graph_runner", "tree_runner")]
        loops.append(drafter.first_graphs if drafter is not None else None)
        return {"target": sum(graphs.capture_bytes.values()) if graphs is not None else 0,
                "draft": sum(sum(loop.capture_bytes.values()) for loop in loops
                             if loop is not None)}

    # --- the step API ----------------------------------------------------------------------

    def add_request(self, request_id, prompt, params: SamplingParams | None = None) -> None:
        """Queue a request (it joins the batch at the next step). prompt: a string (needs a
        tokenizer), token ids, or for a vision-language target a dict with images
        (rocdraft/core/multimodal.py). A RocdraftError naming the bad value for a duplicate id, a
        prompt that cannot run or bad params; the engine is then unchanged."""
        if request_id in self.requests:
            raise RocdraftError(f"request id {request_id!r} is already in flight")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RocdraftError(f"params for request {request_id!r} is a "
                                f"{type(params).__name__}, not a SamplingParams")
        req = self.make_request(request_id, prompt, params)
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
            outputs.append(step_output(req, new_tokens))
        return outputs

    def make_request(self, request_id, prompt, params: SamplingParams) -> Request:
        """A Request for ``prompt`` (not queued); one that cannot run is already finished
        with "error" and says why."""
        target = self.model_runner.target
        cfg, images = target.config, None
        if isinstance(prompt, dict):  # {"prompt" | "prompt_token_ids", "images"}
            ids, images, error = read_multimodal_prompt(prompt, target, self.tokenizer)
        else:
            ids, error = tokenize_prompt(prompt, self.tokenizer)
        req = Request(request_id, ids, params, eos_token_ids=tuple(cfg.eos_token_ids),
                      images=images)
        error = error or image_prompt_error(ids, images, target, self.max_model_len) \
            or prompt_error(ids, cfg.vocab_size, self.max_model_len)
        if error:
            req.finish("error", error)
        return req

    def measure_step_costs(self) -> None:
        """Measure the cost policy's step costs of every batch bucket up to max_num_seqs now
        (about 0.6 s for buckets 1-8 of the built-in pair on a CPU core), so that no request
        pays for it: ``rocdraft serve`` calls it before it accepts requests. Otherwise each
        bucket is measured when a batch first needs it. A no-op without the cost policy,
        with given costs, or while requests hold KV blocks."""
        if self.draft_runner is not None:
            self._ensure_step_costs(self.scheduler, self.scheduler_config.max_num_seqs)

    # --- one step --------------------------------------------------------------------------

    def _step(self, scheduler: Scheduler, stats: GenerationStats
              ) -> list[tuple[Request, list[int]]]:
        """One step over ``scheduler``'s batch -> (request, tokens appended) of every request
        that sampled:

            schedule -> target forward -> verify (sampled [B, k+1]) -> propose next drafts
            -> one host read -> request updates -> the policy observes the step"""
        runner, drafter, policy = self.model_runner, self.draft_runner, self.policy
        if drafter is not None and not scheduler.running:
            self._ensure_step_costs(scheduler)
        if self.overlap is not None:
            advanced = self.overlap.step(scheduler, stats)
            if policy is not None and not scheduler.has_unfinished:
                policy.flush()
            return advanced
        t0, w0 = runner.clock(), runner.work_clock()
        scheduled = scheduler.schedule()
        batch = runner.build_batch(scheduled)
        t1 = runner.clock()
        plan = runner.plan(batch)  # the step's attention plan, once
        out, logits = runner.forward(batch, drafter.aux_layer_ids if drafter else (), plan)
        t2 = runner.clock()
        sampled, verified_tree = runner.verify(logits, batch, scheduled)
        t3, w3 = runner.clock(), runner.work_clock()
        has_prefill = has_prefill_tokens(scheduled)
        num_drafts, outlook, tree_choice, deciding, w_decided = 0, None, None, 0.0, w3
        if policy is not None:
            outlook = batch_outlook(scheduled, scheduler, self.max_model_len) \
                if policy.wants_outlook else None
            num_drafts = policy.num_drafts(len(scheduled), outlook, prefill=has_prefill)
            tree_choice = self._tree_choice(len(scheduled), outlook) \
                if self.tree is not None else None
            deciding = runner.clock() - t3  # the policy's part of the draft phase
            w_decided = runner.work_clock()
        drafts, shape = None, None
        if num_drafts or (drafter is not None and has_prefill):
            drafts, shape = self._propose(batch, sampled, out, verified_tree, num_drafts,
                                          plan if drafter.shares_plan_with(runner.backend)
                                          else None, tree_choice)
        t4, w4 = runner.clock(), runner.work_clock()
        host = read_step(sampled, drafts, verified_tree, scheduled, policy)
        results = apply_step(scheduler, scheduled, batch.samples, host.sampled, host.drafts,
                             stats, self.max_model_len, num_drafts, host.tree_paths)
        t5, w5 = runner.clock(), runner.work_clock()
        observing = 0.0
        if policy is not None:  # step times on the work clock (ModelRunner.work_clock),
            # less the decision's: what the policy's own call costs depends on whether it
            # decided afresh (most often on a probe and the step after it), not on the count
            # it chose (at bs 16 on the built-in pair a fresh decision took 0.3 ms, and every
            # d = 0 probe read 4% slower than its step ran)
            policy.observe(step_record(scheduled, batch.samples, batch.draft_parents is not None,
                                       host, results, has_prefill,
                                       (w5 - w0) - (w_decided - w3),
                                       num_drafts if drafts is not None else 0, w4 - w_decided,
                                       shape=shape))
            if not scheduler.has_unfinished:
                policy.flush()
            observing = runner.clock() - t5
        stats.add_step_times(bookkeeping=(t1 - t0) + (t5 - t4), target_verify=t2 - t1,
                             sampler=t3 - t2, draft=t4 - t3 - deciding,
                             policy=deciding + observing)
        return results.advanced

    def _drafting(self, lookahead: int) -> Drafting:
        """This engine's drafting for async speculative steps (rocdraft/engine/overlap.py):
        a chain config's (args.py refuses trees). The policy decides each step's drafts when
        it is launched, on what had landed by then (its outlook counts a request's tokens
        in flight as still to come), and learns from each step when it lands."""
        runner, drafter, policy = self.model_runner, self.draft_runner, self.policy

        def num_drafts(scheduled) -> int:
            return policy.num_drafts(len(scheduled), batch_outlook(
                scheduled, self.scheduler, self.max_model_len)
                if policy.wants_outlook else None, prefill=has_prefill_tokens(scheduled))

        def propose(batch, sampled, out, num_drafts: int, plan):
            shared = plan if drafter.shares_plan_with(runner.backend) else None
            return self._propose(batch, sampled, out, None, num_drafts, shared)[0].tokens

        def observe(step, live, sampled, drafts, results, prefill: bool,
                    work: tuple[float, float]) -> None:
            seconds, draft_seconds = work
            # timed at the size it ran: rows dropped after an unforeseen stop computed too
            policy.observe(step_record(
                [step.scheduled[i] for i in live], [step.batch.samples[i] for i in live],
                step.batch.draft_parents is not None, HostStep(sampled, drafts, None, None),
                results, prefill, seconds, step.num_drafts if drafts is not None else 0,
                draft_seconds, shape=None, batch_size=len(step.scheduled)))

        return Drafting(drafter.aux_layer_ids, lookahead, num_drafts, propose, observe)

    def _tree_choice(self, batch_size: int, outlook) -> tuple[str, int | None]:
        """A tree config's policy's picks for this step: ("chain", its drafts) or ("tree",
        the batch node budget or None); its chains read the batch's ``outlook``
        (rocdraft/engine/request_updates.py ``batch_outlook``). Decided with the policy's
        other calls, before the drafting: their time is the policy's, not the shape's."""
        policy = self.policy
        shape = policy.shape(batch_size)
        if shape == "chain":
            return shape, policy.chain_drafts_in_tree_mode(batch_size, outlook)
        return shape, policy.tree_budget(batch_size)

    def _propose(self, batch, sampled, out, verified_tree, num_drafts: int, target_plan,
                 tree_choice: tuple[str, int | None] | None = None):
        """The next step's drafts -> (ChainDrafts or TreeDrafts, the shape a tree config
        drafted or None): a chain config drafts max(num_drafts, 1) (a prompt-only step
        still runs the head's first forward, which keeps its cache in step with the
        target's); a tree config what ``tree_choice`` (``_tree_choice``) says.
        target_plan: the target's attention plan of ``batch`` for the head to reuse, or
        None."""
        drafter = self.draft_runner
        hidden = drafter.head_features(out)
        graphs = self.model_runner.graphs
        if self.tree is None:
            return drafter.propose_chain(batch, sampled, hidden, max(num_drafts, 1),
                                         target_plan=target_plan, target_graphs=graphs), None
        shape, count = tree_choice
        if shape == "chain":
            return drafter.propose_chain(batch, sampled, hidden, count, verified_tree,
                                         target_plan, graphs), shape
        return drafter.propose_tree(batch, sampled, hidden, verified_tree, count, target_plan,
                                    graphs), shape

    def _ensure_step_costs(self, scheduler: Scheduler, batch_size: int | None = None) -> None:
        """Measure the step costs the policy still lacks for each batch bucket up to
        ``batch_size`` (default: the largest batch this scheduler's queue can form), while no
        request holds KV blocks (the dummy forwards may then write anywhere in the caches)."""
        cfg = self.scheduler_config
        if scheduler.running or scheduler.allocator.num_free_blocks != cfg.num_blocks:
            return
        wanted = len(scheduler.waiting) if batch_size is None else batch_size
        todo = self.policy.costs_to_measure(
            batch_bucket(min(max(wanted, 1), cfg.max_num_seqs)))
        start = time.perf_counter()
        for chain, bucket in todo:
            self.policy.add_costs(chain, bucket,
                                  measure_step_costs(self._engine_parts(chain), bucket))
        if todo:
            log.info("draft policy: measured step costs of batch buckets %s in %.2f s",
                     sorted({bucket for _, bucket in todo}), time.perf_counter() - start)

    def _engine_parts(self, chain: bool) -> EngineParts:
        """What a cost measurement runs; ``chain``: the chain's steps even in a tree config."""
        runner, drafter = self.model_runner, self.draft_runner
        tree = self.tree if self.policy.tree_acceptance is not None and not chain else None
        return EngineParts(runner.target, runner.builder, runner.kv_caches,
                           drafter.aux_layer_ids, drafter.proposer, drafter.kv_caches,
                           runner.scheduler_config, runner.max_model_len,
                           self.config.speculative.num_speculative_tokens, runner.device, tree)

    def _num_positions(self) -> int:
        """Acceptance statistics positions: the chain length, or the tree's depth."""
        spec = self.config.speculative
        if spec is None:
            return 0
        return self.tree.depth if self.tree is not None else spec.num_speculative_tokens


def _async_scheduling(args: EngineArgs, runner: ModelRunner) -> bool:
    """EngineArgs.async_scheduling resolved: its value, or by default on a GPU at
    tensor-parallel size 1 for a target-only engine or a chain config (args.py refused True
    elsewhere)."""
    if args.async_scheduling is not None:
        return args.async_scheduling
    return runner.device != "cpu" and runner.executor is None \
        and async_speculation_error(args.speculative_config) is None


def step_output(req: Request, new_tokens: list[int]) -> RequestOutput:
    """One step's output of ``req`` (no text: a server decodes incrementally). The prompt
    list is shared, not copied."""
    return RequestOutput(req.prompt_token_ids, list(req.output_token_ids), None,
                         req.finish_reason, req.error, request_id=req.request_id,
                         new_token_ids=new_tokens, finished=req.is_finished,
                         num_verify_steps=req.num_verify_steps,
                         num_accepted_drafts=req.num_accepted_drafts)
