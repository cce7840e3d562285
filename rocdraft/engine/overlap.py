"""Async scheduling: step n+1 is built and launched before step n's results reach the
host, so on a GPU the host's work of a step (reading the tokens, appending them, stop
checks, building the next inputs) runs while the device computes. Target-only decode
steps, and the speculative steps of a chain config.

    one engine step (``DecodeOverlap.step``), with step n launched by the previous one:
        continuation of n (host: which requests go on, their blocks)
        -> launch n+1: its inputs in one upload, then on the device from n's results
           (``fill_inputs``): each row's input token (the last token n kept) and the drafts
           n made; after a step that verified drafts, positions and seq lens moved by the
           drafts it accepted and the slots recomputed from the block table; forward,
           verification, drafting, a non-blocking copy of the sampled tokens and the drafts
           to pinned host memory
        -> land n: wait for n's copy (n+1 is queued behind it), append the tokens, decide
           EOS / stop ids / max_tokens, store the drafts, free finished requests' blocks,
           the policy observes
        -> n's outputs; n+1 stays in flight

What is known before n lands decides the continuation: the requests of n that sampled and
still run, less those that n surely finishes by length (its one sure token reaches
max_tokens or max_model_len), with blocks for the most n may keep (every draft it
verifies) plus the next step's tokens; then the requests waiting, admitted beside them as
``schedule`` would admit them (``Scheduler.admit``: within the token budget left, blocks
allowing, a long prompt chunked; their rows are built from the host, after the in-flight
rows; at ``max_num_seqs`` a request waits for a request to finish, which frees its slot when
n lands, so it joins one step later than in the synchronous engine). A speculative
continuation also waits for n to land when a running request would be left out of it, a
request is seeded (its noise follows its output length, known on the host only) or has
images (M-RoPE positions), or keeping every draft and drafting again could pass
max_model_len; any continuation waits after a step that computed a prompt chunk without
sampling. Otherwise n lands first and the scheduler plans the next step as in the
synchronous engine. A request that n finishes unforeseen (EOS, a stop id, max_tokens
reached by accepted drafts, an abort between steps) still computes its row in n+1: that row
is dropped when n+1 lands, and its KV writes land in blocks freed after n, which any later
step overwrites in stream order.

n+1's host metadata holds bounds where n's acceptance is unknown: ``seq_lens_cpu`` and
``max_seq_len`` as if n kept every draft (the backends and the head's padded drafting use
them only to size work and pick kernels, and mask by the device seq lens, which are exact;
unpadded drafting, which reads the host's, is refused with async scheduling). A
continuation over the token budget (``max_num_batched_tokens``, where the scheduler would
cut the drafts) waits for n to land too.

The draft policy decides a step's drafts when it is launched, on what had landed by then,
and learns from it when it lands: its step times from ``WorkMarks`` (the CPU time of the
launch and the landing on the CPU; on a GPU the longer of the device's time and the host's,
the one that paced the step). A step's time is recorded at the batch size it ran, rows
dropped after an unforeseen stop included. A tree config's next tree
follows the accepted path on the host, so its steps stay synchronous (EngineArgs refuses
async_scheduling=True there). On the CPU nothing overlaps (torch runs each op to its end),
so the engine schedules synchronously there unless asked; the tests run this path on the
CPU for equality with the synchronous engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rocdraft.core.request import Status
from rocdraft.core.scheduler import Scheduler, ScheduledRequest
from rocdraft.core.step_batch import InFlight, StepBatch
from rocdraft.engine.request_updates import apply_step, has_prefill_tokens
from rocdraft.outputs import GenerationStats


@dataclass
class LaunchedStep:
    """A step on the device whose results have not landed on the host."""

    scheduled: list[ScheduledRequest]
    batch: StepBatch
    sampled: torch.Tensor  # [B, max_drafts + 1] int64 on the device, -1 = rejected
    host: torch.Tensor  # [B, w] sampled (and drafts) on the host (pinned on a GPU)
    copied: object  # a torch.cuda.Event recorded after the copy; None on the CPU
    seconds: dict  # the phases' host seconds: bookkeeping, target_verify, sampler, draft, policy
    drafts: torch.Tensor | None = None  # [B, num_drafts] int64: the next step's drafts
    num_drafts: int = 0  # drafts per request the step made (0: none)
    # its start, the policy's decision's start and end, drafting's end (the policy's clock)
    marks: WorkMarks | None = None


class WorkMarks:
    """Marks on the clock the draft policy learns step times from (``ModelRunner.
    work_clock``'s role): this thread's work clock as the launch runs (on the CPU its CPU
    time: the work itself), and on a GPU also CUDA events on the stream, so a step launched
    ahead is timed by the device's own time too, read after its results landed."""

    def __init__(self, runner) -> None:
        self.runner, self.events = runner, runner.device != "cpu"
        self.host: list[float] = []
        self.device: list = []

    def mark(self) -> None:
        self.host.append(self.runner.work_clock())
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.device.append(event)

    def between(self, first: int, last: int, landing: float = 0.0,
                skip: tuple[int, int] | None = None) -> float:
        """Seconds from mark ``first`` to mark ``last``, plus ``landing`` seconds of host
        work after them, less the span between the two marks of ``skip`` on each clock: on
        the CPU the host's; on a GPU (once the events completed) the longer of the device's
        and the host's, the one that paced the step. (Two events recorded back to back read
        apart only by the time the device sat idle between them, so a skipped host span
        comes off the device's time only where the device waited for it.)"""
        host = self.host[last] - self.host[first] + landing
        if skip is not None:
            host -= self.host[skip[1]] - self.host[skip[0]]
        if not self.events:
            return host
        device = self.device[first].elapsed_time(self.device[last]) / 1e3
        if skip is not None:
            device -= self.device[skip[0]].elapsed_time(self.device[skip[1]]) / 1e3
        return max(device, host)


@dataclass(frozen=True)
class Drafting:
    """What async steps of a speculative engine call: the engine's own drafting
    (rocdraft/engine/llm_engine.py) behind three callables."""

    aux_layer_ids: tuple[int, ...]  # the target layers whose hidden states the head reads
    lookahead: int  # slots a request needs past its tokens for one step's drafts
    num_drafts: Callable[[list], int]  # the step's requests -> drafts per request to make
    # (batch, sampled, target output, num_drafts, target plan) -> [B, num_drafts] int64
    propose: Callable
    # (landed step, its live rows, sampled rows, draft rows, StepResults, whether it
    # computed prompt tokens, (its work seconds, of which drafting)) -> None
    observe: Callable


def fill_inputs(batch: StepBatch, previous_sampled: torch.Tensor,
                previous_drafts: torch.Tensor | None = None, block_size: int = 0) -> None:
    """Write each row's inputs from the previous step's results in row
    ``batch.input_sources[i]`` (views of the static inputs when padded), no host read: its
    input token (the last token it kept) and drafts into ``batch.input_ids`` and
    ``batch.draft_token_ids``, and where the previous step verified drafts (it may have kept
    ``accepted`` more tokens than ``build_step_batch`` assumed) the positions and seq lens
    moved by ``accepted`` and the slots recomputed from the block table. A decode after a
    decode: two device ops.

    Example: previous rows sampled [[5, 6, -1], [7, -1, -1]] (accepted 1 and 0) and drafted
    [[8, 9], [3, 4]]; a batch of both rows gets ids [6, 8, 9, 7, 3, 4], row 0's positions
    one further than built, row 1's as built.
    """
    rows = batch.in_flight_rows or batch.input_sources.shape[0]
    sources = batch.input_sources[:rows]
    if previous_drafts is None and previous_sampled.shape[1] == 1:  # no drafts either side
        batch.input_ids[:rows].copy_(previous_sampled[:, 0].index_select(0, sources))
        return
    kept = (previous_sampled >= 0).sum(dim=1) - 1  # [B_prev] drafts accepted
    accepted = kept.index_select(0, sources)  # [rows]
    last = previous_sampled.gather(1, kept.unsqueeze(1)).squeeze(1).index_select(0, sources)
    query = 1 + (batch.num_draft_tokens_cpu[0] if rows else 0)  # the in-flight rows' own
    tokens = rows * query  # their tokens come first (requests admitted beside them follow)
    ids = batch.input_ids[:tokens].view(rows, query)
    ids[:, 0].copy_(last)
    if query > 1:
        drafts = previous_drafts.index_select(0, sources)[:, :query - 1]
        ids[:, 1:].copy_(drafts)
        batch.draft_token_ids[:rows, :query - 1].copy_(drafts)
    if previous_sampled.shape[1] > 1:  # the previous step verified drafts
        positions = batch.positions[:tokens].view(rows, query)
        positions.add_(accepted.unsqueeze(1))
        seq_lens = batch.common.seq_lens[:rows]
        seq_lens.add_(accepted.to(seq_lens.dtype))
        blocks = batch.common.block_table[:rows].long().gather(1, positions // block_size)
        batch.common.slot_mapping[:tokens].view(rows, query).copy_(
            blocks * block_size + positions % block_size)


def continuation(scheduler: Scheduler, previous: LaunchedStep, max_model_len: int,
                 lookahead: int = 0
                 ) -> tuple[list[ScheduledRequest], list[InFlight]] | None:
    """The step that follows ``previous`` before it lands -> (its requests, per request
    (tokens of it ``previous`` keeps for sure, its row there, how many more it may keep)),
    with the blocks for the most it may need reserved; None when the next step must wait
    for ``previous`` to land (the module docstring). Each request computes one token, and
    verifies the ``previous.num_drafts`` drafts ``previous`` made.

    Example: previous decoded requests a (4 of max_tokens 16 generated) and b (15 of 16):
    b finishes with this token, so the continuation is [a], with in-flight [(1, 0, 0)].
    """
    if not all(previous.batch.samples):
        return None
    drafts = previous.num_drafts
    rows, in_flight, needs, finishing = [], [], [], set()
    for row, item in enumerate(previous.scheduled):
        req = item.request
        if req.status is not Status.RUNNING:  # aborted since
            continue
        verified = item.num_draft_tokens
        kept = item.num_new_tokens - verified  # tokens ``previous`` computes and keeps
        outputs = len(req.output_token_ids)
        # After ``previous`` lands: 1 .. 1 + verified more tokens (outputs).
        if outputs + 1 >= req.params.max_tokens or req.num_tokens + 1 >= max_model_len:
            finishing.add(id(req))  # done by length for sure
            continue
        if (verified or drafts) and (
                req.num_tokens + 1 + verified + 1 + drafts + lookahead > max_model_len
                or req.params.seed is not None or req.images is not None):
            # speculative: the positions of keeping every draft and the next drafts must
            # fit the model; a seeded row's noise follows its output length and M-RoPE
            # positions its image, both known on the host only
            return None
        computed = req.num_computed_tokens + item.num_new_tokens  # the most kept
        rows.append(ScheduledRequest(req, 1 + drafts, drafts))
        in_flight.append(InFlight(kept, row, verified))
        needs.append((req, computed + 1 + drafts))
    going_on = {id(s.request) for s in rows}
    if (drafts or previous.batch.max_drafts) and any(
            id(req) not in finishing and id(req) not in going_on for req in scheduler.running):
        return None  # a request would be left out of the speculative batch
    budget = scheduler.config.max_num_batched_tokens - len(rows) * (1 + drafts)
    if budget < 0:
        return None  # past the token budget: the scheduler cuts the drafts
    if not rows or not scheduler.reserve(needs):
        return None
    admitted = scheduler.admit(budget)  # the queue's requests join as in ``schedule``
    return rows + admitted, in_flight + [None] * len(admitted)


class DecodeOverlap:
    def __init__(self, runner, max_model_len: int, drafting: Drafting | None = None) -> None:
        """``runner``: the engine's ModelRunner (builds, runs and samples the steps);
        ``drafting``: a speculative engine's drafting (None: target-only)."""
        self.runner, self.max_model_len, self.drafting = runner, max_model_len, drafting
        self.pending: LaunchedStep | None = None  # launched, not landed
        self.num_overlapped = 0  # steps launched before their previous step landed

    def step(self, scheduler: Scheduler, stats: GenerationStats) -> list[tuple]:
        """Land one step (launching the next first where it may) -> (request, tokens
        appended) of every request that sampled in the landed step."""
        if self.pending is not None and all(item.request.is_finished
                                            for item in self.pending.scheduled):
            self.pending = None  # every row dropped (stopped or aborted): nothing to land
        if self.pending is None:
            scheduled = scheduler.schedule()
            if not scheduled:
                return []
            self.pending = self._launch(scheduled, None, None)
        landing = self.pending
        lookahead = 0 if self.drafting is None else self.drafting.lookahead
        follow = continuation(scheduler, landing, self.max_model_len, lookahead)
        self.pending = None
        if follow is not None:
            self.pending = self._launch(*follow, landing)
            self.num_overlapped += 1
        return self._land(landing, scheduler, stats)

    def _launch(self, scheduled: list[ScheduledRequest], in_flight, previous
                ) -> LaunchedStep:
        runner, drafting = self.runner, self.drafting
        marks = None
        if drafting is not None:
            marks = WorkMarks(runner)
            marks.mark()
        t0 = runner.clock()
        batch = runner.build_batch(scheduled, in_flight)
        if previous is not None:
            fill_inputs(batch, previous.sampled, previous.drafts,
                        runner.scheduler_config.block_size)
        t1 = runner.clock()
        plan = None if drafting is None else runner.plan(batch)
        out, logits = runner.forward(batch, () if drafting is None else drafting.aux_layer_ids,
                                     plan)
        t2 = runner.clock()
        ahead = None if in_flight is None else [int(entry is not None) for entry in in_flight]
        sampled, _ = runner.verify(logits, batch, scheduled, ahead)
        t3 = runner.clock()
        drafts, num_drafts, deciding = None, 0, 0.0
        if drafting is not None:
            marks.mark()
            num_drafts = drafting.num_drafts(scheduled)
            deciding = runner.clock() - t3  # the policy's part of the draft phase
            marks.mark()
            # (a prompt's step keeps the head's cache in step: a continuation has one where
            # a request was admitted beside it)
            prompts = has_prefill_tokens(scheduled) if in_flight is None \
                else None in in_flight
            if num_drafts or prompts:
                drafts = drafting.propose(batch, sampled, out, num_drafts, plan)
                drafts = drafts[:, :num_drafts] if num_drafts else None
            marks.mark()
        t4 = runner.clock()
        host, copied = _start_copy(sampled if drafts is None
                                   else torch.cat([sampled, drafts], dim=1))
        return LaunchedStep(scheduled, batch, sampled, host, copied,
                            {"bookkeeping": t1 - t0, "target_verify": t2 - t1,
                             "sampler": t3 - t2, "draft": t4 - t3 - deciding,
                             "policy": deciding}, drafts, num_drafts, marks)

    def _land(self, step: LaunchedStep, scheduler: Scheduler, stats: GenerationStats):
        runner = self.runner
        t0, w0 = runner.clock(), runner.work_clock()
        if step.copied is not None:
            step.copied.synchronize()
        rows = step.host.tolist()
        width = step.sampled.shape[1]
        live = [i for i, item in enumerate(step.scheduled) if not item.request.is_finished]
        scheduled = [step.scheduled[i] for i in live]
        sampled = [rows[i][:width] for i in live]
        drafts = None if step.drafts is None else [rows[i][width:] for i in live]
        # as the step was built (before the updates): what the policy learns from
        prefill = self.drafting is not None and has_prefill_tokens(scheduled)
        results = apply_step(scheduler, scheduled, [step.batch.samples[i] for i in live],
                             sampled, drafts, stats, self.max_model_len, step.num_drafts)
        seconds = dict(step.seconds)
        t1 = runner.clock()
        seconds["bookkeeping"] += t1 - t0
        if self.drafting is not None:
            # the step's work: its launch and its landing on the host, or on a GPU the
            # device's time where that was longer (the host then worked beside it)
            # (less the policy's decision, as in the synchronous step: LLMEngine._step)
            landing = runner.work_clock() - w0
            work = (step.marks.between(0, 3, landing, skip=(1, 2)), step.marks.between(2, 3))
            self.drafting.observe(step, live, sampled, drafts, results, prefill, work)
            seconds["policy"] += runner.clock() - t1
        stats.add_step_times(**seconds)
        return results.advanced


def _start_copy(sampled: torch.Tensor) -> tuple[torch.Tensor, object]:
    """A non-blocking copy of ``sampled`` into pinned host memory and the event after it;
    on the CPU the tensor itself (nothing to copy) and no event."""
    if sampled.device.type == "cpu":
        return sampled, None
    host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
    host.copy_(sampled, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied
