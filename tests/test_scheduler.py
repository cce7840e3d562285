"""Scheduler: chunked prefill, max_num_seqs, finishing, preemption, drafts under the token
budget, lookahead blocks. A driver loop simulates generation without a model and checks the
scheduler's invariants after every step."""
from __future__ import annotations

import random

import pytest

from rocdraft.config import SamplingParams, SchedulerConfig
from rocdraft.core.request import Request, Status
from rocdraft.core.scheduler import Scheduler


def make_request(rid: int, prompt_len: int, max_tokens: int = 4) -> Request:
    return Request(rid, [100 + rid] * prompt_len,
                   SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


class Driver:
    """Runs the scheduler like the engine does, with random acceptance of drafts."""

    def __init__(self, config: SchedulerConfig, requests: list[Request], k: int = 0,
                 seed: int = 0) -> None:
        self.config, self.k = config, k
        self.sched = Scheduler(config)
        self.rng = random.Random(seed)
        self.requests = list(requests)
        for req in requests:
            self.sched.add(req)
        self.finish_order: list[int] = []
        self.preempted_seen: list[int] = []
        self.steps = 0

    def step(self):
        before = {r.request_id: (r.status, list(r.output_token_ids), list(r.block_ids))
                  for r in self.requests}
        scheduled = self.sched.schedule()
        self.steps += 1
        # (request id, num_new_tokens, num_draft_tokens, completes_prefill) before updates
        self.last = [(s.request.request_id, s.num_new_tokens, s.num_draft_tokens,
                      s.completes_prefill) for s in scheduled]
        check_invariants(self.sched, scheduled, self.requests)
        for r in self.requests:
            status, outputs, _ = before[r.request_id]
            # Scheduling never changes what a request generated.
            assert r.output_token_ids == outputs
            if status is Status.RUNNING and r.status is Status.WAITING:
                self.preempted_seen.append(r.request_id)
                assert r.num_computed_tokens == 0 and r.block_ids == [] \
                    and r.spec_token_ids == []
                assert r.num_preemptions >= 1
                assert r in self.sched.waiting
        for item in scheduled:
            req = item.request
            if not item.completes_prefill:
                self.sched.update_after_step(item, 0)
                continue
            drafts = list(req.spec_token_ids)
            accepted = self.rng.randint(0, item.num_draft_tokens)
            tokens = drafts[:accepted] + [self.rng.randint(0, 999)]
            self.sched.update_after_step(item, accepted)
            req.append_tokens(tokens, self.config.max_model_len)
            if req.is_finished:
                self.sched.finish(req)
                self.finish_order.append(req.request_id)
            elif self.k:
                room = self.config.max_model_len - req.num_tokens
                req.spec_token_ids = [self.rng.randint(0, 999)
                                      for _ in range(max(min(self.k, room), 0))]
            # K/V of every token but the last sampled one is computed.
            if not req.is_finished:
                assert req.num_computed_tokens == req.num_tokens - 1
        return scheduled

    def run(self, max_steps: int = 500):
        while self.sched.has_unfinished:
            self.step()
            assert self.steps < max_steps, "scheduler made no progress"
        return self


def check_invariants(sched: Scheduler, scheduled, requests) -> None:
    cfg = sched.config
    assert sum(s.num_new_tokens for s in scheduled) <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    ids = [s.request.request_id for s in scheduled]
    assert len(ids) == len(set(ids)), "a request was scheduled twice in one step"
    owners: dict[int, int] = {}
    for req in sched.running:
        assert req.status is Status.RUNNING
        for b in req.block_ids:
            assert b not in owners, f"block {b} owned by {owners[b]} and {req.request_id}"
            owners[b] = req.request_id
    for req in requests:
        if req.status is not Status.RUNNING:
            assert req.block_ids == [], f"request {req.request_id} ({req.status}) holds blocks"
            assert req not in sched.running
    assert len(owners) + sched.allocator.num_free_blocks == cfg.num_blocks
    for item in scheduled:
        req = item.request
        assert req in sched.running
        assert item.num_new_tokens > 0
        assert 0 <= item.num_draft_tokens <= item.num_new_tokens - 1
        if item.num_draft_tokens:  # drafts only ride on a decode step
            assert req.num_tokens - req.num_computed_tokens == 1
            assert len(req.spec_token_ids) == item.num_draft_tokens
        assert req.num_computed_tokens + item.num_new_tokens - item.num_draft_tokens \
            <= req.num_tokens
        # Blocks hold every token computed this step plus the lookahead slots.
        needed = min(req.num_computed_tokens + item.num_new_tokens + cfg.num_lookahead_tokens,
                     cfg.max_model_len)
        needed = max(needed, req.num_computed_tokens + item.num_new_tokens)
        assert len(req.block_ids) * cfg.block_size >= needed


def config(**kw) -> SchedulerConfig:
    base = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=4,
                num_blocks=64)
    base.update(kw)
    return SchedulerConfig(**base)


# --- chunked prefill ------------------------------------------------------------------------

def test_chunked_prefill_under_a_small_budget():
    req = make_request(0, prompt_len=10, max_tokens=2)
    d = Driver(config(max_num_batched_tokens=4), [req])
    chunks = []
    while d.sched.has_unfinished:
        d.step()
        chunks.append([(n, done) for _, n, _, done in d.last])
    assert chunks == [[(4, False)], [(4, False)], [(2, True)], [(1, True)]]
    assert len(req.output_token_ids) == 2 and req.finish_reason == "length"


def test_budget_is_shared_oldest_first():
    a, b, c = make_request(0, 6), make_request(1, 6), make_request(2, 6)
    d = Driver(config(max_num_batched_tokens=8), [a, b, c])
    first = d.step()
    assert [(s.request.request_id, s.num_new_tokens) for s in first] == [(0, 6), (1, 2)]
    second = d.step()
    # a decodes (1 token), b continues its prefill (4 left), c gets the remaining 3.
    assert [(s.request.request_id, s.num_new_tokens) for s in second] == [(0, 1), (1, 4), (2, 3)]
    d.run()


# --- max_num_seqs and finishing -------------------------------------------------------------

def test_max_num_seqs_is_respected():
    reqs = [make_request(i, 3, max_tokens=2 + i) for i in range(5)]
    d = Driver(config(max_num_seqs=2), reqs)
    max_running = 0
    while d.sched.has_unfinished:
        scheduled = d.step()
        assert len(scheduled) <= 2
        max_running = max(max_running, len(d.sched.running))
    assert max_running == 2
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs)


def test_requests_finish_at_different_times():
    reqs = [make_request(0, 5, max_tokens=7), make_request(1, 2, max_tokens=1),
            make_request(2, 8, max_tokens=3)]
    d = Driver(config(), reqs).run()
    assert d.finish_order == [1, 2, 0]
    for r in reqs:
        assert r.is_finished and len(r.output_token_ids) == r.params.max_tokens
        assert r.block_ids == []
    assert d.sched.allocator.num_free_blocks == d.config.num_blocks
    assert not d.sched.running and not d.sched.waiting


def test_finish_at_max_model_len():
    req = make_request(0, 6, max_tokens=100)
    Driver(config(max_model_len=9), [req]).run()
    assert req.num_tokens == 9 and req.finish_reason == "length"


# --- preemption -----------------------------------------------------------------------------

def test_preemption_when_blocks_run_out():
    # 6 blocks of 4 = 24 slots; three requests that each grow to 4 + 8 = 12 tokens.
    reqs = [make_request(i, 4, max_tokens=8) for i in range(3)]
    d = Driver(config(num_blocks=6), reqs).run()
    assert d.sched.num_preemptions > 0 and d.preempted_seen
    assert sum(r.num_preemptions for r in reqs) == d.sched.num_preemptions
    for r in reqs:
        assert len(r.output_token_ids) == 8
    assert d.sched.allocator.num_free_blocks == 6


def test_preempted_request_keeps_its_outputs_and_recomputes_them():
    a, b = make_request(0, 4, max_tokens=6), make_request(1, 4, max_tokens=6)
    d = Driver(config(num_blocks=3), [a, b])  # 12 slots
    while not d.preempted_seen:
        d.step()
    victim = a if a.request_id in d.preempted_seen else b
    survivor = b if victim is a else a
    assert victim is b, "the most recently admitted request is the victim"
    assert victim.output_token_ids, "preempted after generating something"
    kept = list(victim.output_token_ids)
    assert victim.status is Status.WAITING and d.sched.waiting[0] is victim
    assert survivor.status is Status.RUNNING
    # When it comes back it recomputes prompt + outputs, then continues.
    while victim.status is Status.WAITING:
        d.step()
    assert victim.output_token_ids[:len(kept)] == kept
    d.run()
    assert len(victim.output_token_ids) == 6 and len(survivor.output_token_ids) == 6


def run_random_workload(seed: int) -> int:
    """Random mixes under a tight cache (every request fits alone, not all together);
    returns the number of preemptions."""
    rng = random.Random(seed)
    k = rng.choice([0, 2, 4])
    block_size, max_model_len = rng.choice([2, 4]), 32
    reqs = [make_request(i, rng.randint(1, 12), max_tokens=rng.randint(1, 14))
            for i in range(rng.randint(3, 8))]
    need = max(-(-min(len(r.prompt_token_ids) + r.params.max_tokens + k, max_model_len)
                 // block_size) for r in reqs)
    cfg = config(max_num_seqs=rng.randint(2, 6), max_num_batched_tokens=rng.randint(6, 20),
                 max_model_len=max_model_len, block_size=block_size,
                 num_blocks=need + rng.randint(0, 4), num_lookahead_tokens=k)
    d = Driver(cfg, reqs, k=k, seed=seed).run(max_steps=3000)
    for r in reqs:
        want = min(r.params.max_tokens, cfg.max_model_len - len(r.prompt_token_ids))
        assert len(r.output_token_ids) == want
    assert d.sched.allocator.num_free_blocks == cfg.num_blocks
    return d.sched.num_preemptions


def test_random_workloads_keep_invariants():
    preemptions = [run_random_workload(seed) for seed in range(12)]
    # The invariant checks are only meaningful if preemption actually happens.
    assert sum(p > 0 for p in preemptions) >= 6


# --- speculative drafts ---------------------------------------------------------------------

def test_drafts_are_verified_with_the_decode_token():
    req = make_request(0, 4, max_tokens=20)
    d = Driver(config(num_lookahead_tokens=3), [req], k=3)
    d.step()  # prefill
    assert len(req.spec_token_ids) == 3
    d.step()
    assert d.last == [(0, 4, 3, True)]


def test_drafts_trimmed_by_budget():
    a, b = make_request(0, 3, max_tokens=20), make_request(1, 3, max_tokens=20)
    d = Driver(config(max_num_batched_tokens=7, num_lookahead_tokens=4), [a, b], k=4)
    d.step()  # both prefills: 3 + 3 tokens
    assert len(a.spec_token_ids) == len(b.spec_token_ids) == 4
    items = d.sched.schedule()
    # a: 1 + 4 drafts = 5; b: 1 + 1 draft (the budget has 2 left).
    assert [(s.num_new_tokens, s.num_draft_tokens) for s in items] == [(5, 4), (2, 1)]
    assert len(b.spec_token_ids) == 1  # the drafts it will verify
    check_invariants(d.sched, items, [a, b])


def test_no_drafts_when_budget_only_fits_the_decode_token():
    a, b = make_request(0, 3, max_tokens=20), make_request(1, 3, max_tokens=20)
    d = Driver(config(max_num_batched_tokens=6, num_lookahead_tokens=4), [a, b], k=4)
    d.step()
    items = d.sched.schedule()
    assert [(s.num_new_tokens, s.num_draft_tokens) for s in items] == [(5, 4), (1, 0)]
    assert b.spec_token_ids == []


def test_drafts_are_ignored_during_prefill():
    req = make_request(0, 10, max_tokens=2)
    req.spec_token_ids = [1, 2, 3]  # stale drafts must not ride on a prefill chunk
    sched = Scheduler(config(max_num_batched_tokens=4))
    sched.add(req)
    item, = sched.schedule()
    assert (item.num_new_tokens, item.num_draft_tokens) == (4, 0)
    sched.update_after_step(item, 0)
    req.spec_token_ids = [1, 2, 3]
    item, = sched.schedule()
    assert (item.num_new_tokens, item.num_draft_tokens) == (4, 0)


def test_rejected_drafts_are_not_counted_as_computed():
    req = make_request(0, 4, max_tokens=20)
    sched = Scheduler(config(num_lookahead_tokens=3))
    sched.add(req)
    item, = sched.schedule()
    sched.update_after_step(item, 0)
    req.append_tokens([7], 64)
    req.spec_token_ids = [1, 2, 3]
    item, = sched.schedule()
    sched.update_after_step(item, 1)  # 1 of 3 drafts accepted
    assert req.num_computed_tokens == 4 + 1 + 1
    assert req.spec_token_ids == []


def test_speculative_workload_with_preemption():
    reqs = [make_request(i, 5, max_tokens=10) for i in range(4)]
    d = Driver(config(num_blocks=12, num_lookahead_tokens=4, max_num_batched_tokens=16),
               reqs, k=4, seed=3).run()
    assert d.sched.num_preemptions > 0
    assert all(len(r.output_token_ids) == 10 for r in reqs)


# --- lookahead ------------------------------------------------------------------------------

def test_lookahead_blocks_are_allocated():
    req = make_request(0, 4, max_tokens=5)
    sched = Scheduler(config(num_lookahead_tokens=3))
    sched.add(req)
    sched.schedule()
    assert len(req.block_ids) == 2  # 4 prompt tokens + 3 lookahead slots = 7 -> 2 blocks
    no_lookahead = make_request(1, 4, max_tokens=5)
    sched2 = Scheduler(config())
    sched2.add(no_lookahead)
    sched2.schedule()
    assert len(no_lookahead.block_ids) == 1


def test_lookahead_is_capped_at_max_model_len():
    req = make_request(0, 8, max_tokens=5)
    sched = Scheduler(config(max_model_len=9, num_lookahead_tokens=8))
    sched.add(req)
    sched.schedule()
    assert len(req.block_ids) == 3  # min(8 + 8, 9) = 9 tokens -> 3 blocks of 4


# --- requests that can never fit ------------------------------------------------------------

def test_request_larger_than_the_cache_raises():
    sched = Scheduler(config(num_blocks=2, max_num_batched_tokens=64))
    sched.add(make_request(7, 12))
    with pytest.raises(RuntimeError, match=r"request 7 .*2 blocks of 4"):
        sched.schedule()


def test_request_larger_than_the_cache_raises_with_chunked_prefill():
    req = make_request(3, 20)
    d = Driver(config(num_blocks=3, max_num_batched_tokens=4), [req])
    with pytest.raises(RuntimeError, match="request 3"):
        for _ in range(20):
            d.step()


def test_request_outgrowing_the_cache_while_decoding_raises():
    req = make_request(5, 6, max_tokens=20)
    d = Driver(config(num_blocks=2), [req])
    with pytest.raises(RuntimeError, match="request 5"):
        d.run()
    assert len(req.output_token_ids) >= 1
