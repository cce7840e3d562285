"""Continuous batching with a token budget, chunked prefill and recompute preemption.

Each step, running requests are scheduled first (oldest first): a decode request computes
its last sampled token plus the drafts awaiting verification; a request still in prefill
computes the next chunk of its prompt. Waiting requests are admitted while the token budget,
``max_num_seqs`` and free blocks allow. When blocks run out, the most recently admitted
running request is preempted: its blocks are freed and it goes back to the front of the
queue, to be recomputed (prompt + tokens generated so far) later. Nothing it generated is lost.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from rocdraft.core.block_allocator import BlockAllocator
from rocdraft.config import SchedulerConfig
from rocdraft.core.request import Request, Status


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, drafts included
    num_draft_tokens: int  # drafts among them (verified this step)

    @property
    def completes_prefill(self) -> bool:
        """True when this step reaches the request's last token, so a token is sampled."""
        req = self.request
        return req.num_computed_tokens + self.num_new_tokens - self.num_draft_tokens \
            == req.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.allocator = BlockAllocator(config.num_blocks, config.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_for(self, req: Request, num_new_tokens: int) -> int:
        """Extra blocks ``req`` needs to hold its tokens after this step plus the lookahead
        slots the draft steps write (capped at max_model_len: later slots are padding)."""
        cfg = self.config
        total = min(req.num_computed_tokens + num_new_tokens + cfg.num_lookahead_tokens,
                    cfg.max_model_len)
        return max(self.allocator.blocks_needed(total) - len(req.block_ids), 0)

    def _preempt(self, victim: Request) -> None:
        self.allocator.free(victim.block_ids)
        victim.block_ids, victim.num_computed_tokens = [], 0
        victim.clear_drafts()
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(victim)
        self.waiting.appendleft(victim)

    def schedule(self) -> list[ScheduledRequest]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False
        for req in list(self.running):
            if req not in self.running:  # preempted earlier in this loop
                continue
            num_new = req.num_tokens - req.num_computed_tokens
            drafts = req.spec_token_ids if num_new == 1 else []
            num_drafts = min(len(drafts), max(budget - num_new, 0))
            num_new = min(num_new, budget)
            if num_new == 0:
                continue
            while not self.allocator.can_allocate(self._blocks_for(req, num_new + num_drafts)):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            req.block_ids += self.allocator.allocate(self._blocks_for(req, num_new + num_drafts))
            req.keep_drafts(num_drafts)
            scheduled.append(ScheduledRequest(req, num_new + num_drafts, num_drafts))
            budget -= num_new + num_drafts
        if not preempted:
            scheduled += self.admit(budget)
        if not scheduled and self.waiting and not self.running:
            req = self.waiting[0]
            raise RuntimeError(f"request {req.request_id} needs more KV blocks than the cache "
                               f"holds ({self.config.num_blocks} blocks of "
                               f"{self.config.block_size}); raise num_blocks")
        return scheduled

    def admit(self, budget: int) -> list[ScheduledRequest]:
        """Waiting requests admitted (oldest first, blocks allocated, now running) while
        ``budget`` tokens, ``max_num_seqs`` and free blocks allow; a prompt longer than
        what is left of the budget computes a chunk of it. ``schedule`` admits after the
        running requests; async scheduling (rocdraft/engine/overlap.py) beside a step
        launched ahead."""
        admitted = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.allocator.can_allocate(self._blocks_for(req, num_new)):
                break
            self.waiting.popleft()
            req.block_ids += self.allocator.allocate(self._blocks_for(req, num_new))
            req.status = Status.RUNNING
            self.running.append(req)
            admitted.append(ScheduledRequest(req, num_new, 0))
            budget -= num_new
        return admitted

    def reserve(self, needs: list[tuple[Request, int]]) -> bool:
        """Blocks for each request to hold its given number of tokens (plus the lookahead,
        capped at max_model_len), for all of them or none -> whether they were allocated.
        Async decode (rocdraft/engine/overlap.py) reserves a step ahead of ``schedule``."""
        extra = [(req, self._blocks_for(req, tokens - req.num_computed_tokens))
                 for req, tokens in needs]
        if not self.allocator.can_allocate(sum(n for _, n in extra)):
            return False
        for req, n in extra:
            req.block_ids += self.allocator.allocate(n)
        return True

    def finish(self, req: Request) -> None:
        """Release a finished request's blocks."""
        if req in self.running:
            self.running.remove(req)
        if req.block_ids:
            self.allocator.free(req.block_ids)
            req.block_ids = []

    def abort(self, req: Request) -> None:
        """Drop ``req`` wherever it is (waiting or running) and release its blocks."""
        if req in self.waiting:
            self.waiting.remove(req)
        self.finish(req)

    def update_after_step(self, item: ScheduledRequest, num_accepted_drafts: int) -> None:
        """Advance ``num_computed_tokens``: the scheduled tokens minus rejected drafts."""
        rejected = item.num_draft_tokens - num_accepted_drafts
        item.request.num_computed_tokens += item.num_new_tokens - rejected
        item.request.clear_drafts()
