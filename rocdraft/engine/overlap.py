"""Async scheduling of target-only decode steps: step n+1 is built and launched before step
n's results reach the host, so on a GPU the host's work of a step (reading the tokens,
appending them, stop checks, building the next inputs) runs while the device computes.

    one engine step (``DecodeOverlap.step``), with step n launched by the previous one:
        continuation of n (host: which requests go on, their blocks)
        -> launch n+1: its inputs in one upload, each input token gathered on the device
           from n's sampled tokens (``fill_inputs``), forward, sampling, a non-blocking
           copy of the sampled tokens to pinned host memory
        -> land n: wait for n's copy (n+1 is queued behind it), append the tokens, decide
           EOS / stop ids / max_tokens, free finished requests' blocks
        -> n's outputs; n+1 stays in flight

What is known before n lands decides the continuation: the requests of n that sampled and
still run, less those that n's token finishes by length (max_tokens, max_model_len); no
request waiting that the scheduler could admit now (below ``max_num_seqs`` it is admitted
after n lands; at ``max_num_seqs`` it waits for a request to finish either way, and joins
one step later than in the synchronous engine); blocks for one more token each. Otherwise
n lands first and the scheduler plans the next step as in the synchronous engine. A
request that n finishes by EOS or a stop id (or that is aborted between steps) still
computes one token in n+1: that row is dropped when n+1 lands, and its KV write lands in
blocks freed after n, which any later step overwrites in stream order.

Speculative steps stay synchronous: their next inputs (positions, slots, the drafts'
count) depend on how many drafts the step accepts. Launching them ahead would need the
next step's positions (``num_computed + 1 + accepted + arange(d + 1)``), slots (through the
block table) and seq lens computed on the device from the accepted counts, blocks reserved
for the most the step can accept, and every backend's host metadata (``seq_lens_cpu``,
``max_seq_len``) used only as a bound; not built. On the CPU nothing overlaps (torch runs
each op to its end), so the engine schedules synchronously there unless asked; the tests run
this path on the CPU for equality with the synchronous engine.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rocdraft.core.request import Status
from rocdraft.core.scheduler import Scheduler, ScheduledRequest
from rocdraft.core.step_batch import StepBatch
from rocdraft.engine.request_updates import apply_step
from rocdraft.outputs import GenerationStats


@dataclass
class LaunchedStep:
    """A step on the device whose results have not landed on the host."""

    scheduled: list[ScheduledRequest]
    batch: StepBatch
    sampled: torch.Tensor  # [B, 1] int64 on the device
    host: torch.Tensor  # [B, 1] its copy on the host (pinned on a GPU, filled in order)
    copied: object  # a torch.cuda.Event recorded after the copy; None on the CPU
    seconds: dict  # the phases' host seconds: bookkeeping, target_verify, sampler


def fill_inputs(batch: StepBatch, previous_sampled: torch.Tensor) -> None:
    """Write each row's input token, the token the previous step sampled in row
    ``batch.input_sources[i]``, into ``batch.input_ids`` (a view of the static inputs when
    padded): two device ops, no host read."""
    batch.input_ids.copy_(previous_sampled[:, 0].index_select(0, batch.input_sources))


def continuation(scheduler: Scheduler, previous: LaunchedStep, max_model_len: int
                 ) -> tuple[list[ScheduledRequest], list[tuple[int, int]]] | None:
    """The decode step that follows ``previous`` before it lands -> (its requests, per
    request (tokens of it ``previous`` computes, its row there)), with the blocks for one
    more token each reserved; None when the next step must wait for ``previous`` to land
    (the module docstring).

    Example: previous decoded requests a (4 of max_tokens 16 generated) and b (15 of 16):
    b finishes with this token, so the continuation is [a], with in-flight [(1, 0)].
    """
    admits = scheduler.waiting and len(scheduler.running) < scheduler.config.max_num_seqs
    if admits or previous.batch.max_drafts or not all(previous.batch.samples):
        return None
    rows, in_flight, needs = [], [], []
    for row, item in enumerate(previous.scheduled):
        req = item.request
        if req.status is not Status.RUNNING:  # aborted since
            continue
        # After ``previous`` lands: one more output token, item.num_new_tokens more computed.
        if len(req.output_token_ids) + 1 >= req.params.max_tokens \
                or req.num_tokens + 1 >= max_model_len:
            continue
        computed = req.num_computed_tokens + item.num_new_tokens
        rows.append(ScheduledRequest(req, 1, 0))
        in_flight.append((item.num_new_tokens, row))
        needs.append((req, computed + 1))
    if not rows or not scheduler.reserve(needs):
        return None
    return rows, in_flight


class DecodeOverlap:
    def __init__(self, runner, max_model_len: int) -> None:
        """``runner``: the engine's ModelRunner (builds, runs and samples the steps)."""
        self.runner, self.max_model_len = runner, max_model_len
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
        follow = continuation(scheduler, landing, self.max_model_len)
        self.pending = None
        if follow is not None:
            self.pending = self._launch(*follow, landing)
            self.num_overlapped += 1
        return self._land(landing, scheduler, stats)

    def _launch(self, scheduled: list[ScheduledRequest], in_flight, previous
                ) -> LaunchedStep:
        runner = self.runner
        t0 = runner.clock()
        batch = runner.build_batch(scheduled, in_flight)
        if previous is not None:
            fill_inputs(batch, previous.sampled)
        t1 = runner.clock()
        _, logits = runner.forward(batch)
        t2 = runner.clock()
        ahead = None if in_flight is None else [1] * len(scheduled)
        sampled, _ = runner.verify(logits, batch, scheduled, ahead)
        host, copied = _start_copy(sampled)
        t3 = runner.clock()
        return LaunchedStep(scheduled, batch, sampled, host, copied,
                            {"bookkeeping": t1 - t0, "target_verify": t2 - t1,
                             "sampler": t3 - t2})

    def _land(self, step: LaunchedStep, scheduler: Scheduler, stats: GenerationStats):
        runner = self.runner
        t0 = runner.clock()
        if step.copied is not None:
            step.copied.synchronize()
        sampled = step.host.tolist()
        live = [i for i, item in enumerate(step.scheduled) if not item.request.is_finished]
        scheduled = [step.scheduled[i] for i in live]
        results = apply_step(scheduler, scheduled, [step.batch.samples[i] for i in live],
                             [sampled[i] for i in live], None, stats, self.max_model_len)
        seconds = dict(step.seconds)
        seconds["bookkeeping"] += runner.clock() - t0
        stats.add_step_times(draft=0.0, **seconds)
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
