"""Realized step times and the chain cost policy's decision (rocdraft/spec_decode/
realized_times.py), through the whole DraftPolicy fed StepRecords by a simulated engine: no
model. Synthetic step-time models (a linear verify part and draft part, with noise) and
acceptance streams (stationary, drifting, noisy; a perfect head, a useless one that becomes
good); the policy's realized throughput against every fixed draft count run on the same
stream (common random numbers: step i draws the same acceptance and noise for every run)."""
from __future__ import annotations

import random
from collections import Counter, deque

import pytest
from hypothesis import example, given, strategies as st

from rocdraft.config import SpeculativeConfig
from rocdraft.spec_decode.cost_model import StepCosts
from rocdraft.spec_decode.policy import DraftPolicy, StepRecord
from rocdraft.spec_decode.realized_times import (PROBE_EVERY, RealizedStepTimes, best_num_drafts,
                                                 calibrated, prior_times)

K = 4


def test_docstring_worked_example():
    prior = StepCosts(0.010, 0.001, 0.0, 0.0, 0.001)  # head_per_token 0: first forward 0
    verify, draft = prior_times(prior, 1, 2)
    assert verify == pytest.approx([0.011, 0.012, 0.013])
    assert draft == pytest.approx([0.0, 0.0, 0.001])
    prior = StepCosts(0.010, 0.001, 0.0005, 0.0005, 0.001)
    verify, draft = prior_times(prior, 1, 2)  # the docstring's
    assert verify == pytest.approx([0.011, 0.012, 0.013])
    assert draft == pytest.approx([0.0, 0.0015, 0.003])
    times = RealizedStepTimes(2)
    times.record(1, 2, 2, 0.012, 0.004, prior)
    t = times.step_times(1, prior, 2)
    assert t == pytest.approx([0.011 * 12 / 13, 0.012 * 12 / 13 + 0.002, 0.016])
    assert best_num_drafts(t, [0.8, 0.8]) == 2
    at_three = RealizedStepTimes(2)  # the same samples at B = 3: kept at bucket 4's size
    at_three.record(3, 2, 2, 0.012, 0.004, prior)
    assert at_three.buckets[4].verify[2][0] == pytest.approx(0.012 * 22 / 19)
    assert at_three.step_times(3, prior, 2)[2] == pytest.approx(0.016)


def test_samples_at_smaller_batches_do_not_make_a_count_look_cheap_at_the_full_batch():
    """The end of a batch: requests finish at different steps, so the last d = 3 samples of
    bucket 8 come from 5-7 requests. On a machine whose costs have the prior's shape (exact,
    no noise), the estimate at 8 requests is the true time at 8, not the smaller batches'."""
    machine = Machine()
    times = RealizedStepTimes(K)
    for batch_size in (8, 8, 7, 6, 6, 5, 5, 5, 5):  # the last RECENT samples: 5-7 requests
        verify, draft = machine.parts(batch_size, 3, 3, random.Random(0))
        times.record(batch_size, 3, 3, verify, draft, TRUE_PRIOR)
    verify, draft = machine.parts(8, 0, 0, random.Random(0))
    times.record(8, 0, 0, verify, draft, TRUE_PRIOR)
    estimate = times.step_times(8, TRUE_PRIOR, K)
    for d in (0, 3):
        assert estimate[d] == pytest.approx(sum(machine.parts(8, d, d, random.Random(0))))


def test_calibrated_uses_the_median_of_recent_samples():
    assert calibrated({}, [1.0, 2.0]) == [1.0, 2.0]  # nothing realized: the prior
    assert calibrated({0: deque([5.0, 100.0, 5.0])}, [1.0, 2.0]) == [5.0, 10.0]  # spike dropped


@given(st.lists(st.floats(0.01, 10.0), min_size=2, max_size=8),
       st.lists(st.floats(0.0, 1.0), min_size=8, max_size=8))
@example(times=[0.75, 0.75], rates=[1e-09] + [0.0] * 7)  # rates 1e-9 apart: a tie
def test_best_num_drafts_is_the_argmax_of_a_naive_loop(times, rates):
    from rocdraft.spec_decode.cost_model import expected_tokens

    d = best_num_drafts(times, rates)
    rate = [expected_tokens(rates, n) / t for n, t in enumerate(times)]
    # ties (within 1e-9 relative) go to the smaller d; 2e-9 here for the rounding of both
    assert rate[d] >= max(rate) * (1 - 2e-9)
    assert all(r <= rate[d] * (1 + 2e-9) for r in rate[:d])


def test_probes_are_under_2_percent_and_cycle_the_other_counts():
    times = RealizedStepTimes(K)
    choices = [times.decide(1, [1.0, 0.9, 0.8, 0.7, 0.6], [0.9] * K) for _ in range(64 * 10)]
    assert choices[:10] == [4, 4, 3, 3, 2, 2, 1, 1, 0, 0]  # the sweep: each count twice
    choices = choices[10:]
    best = Counter(choices).most_common(1)[0][0]
    probes = [c for c in choices if c != best]
    assert best == 4 and len(probes) / len(choices) < 0.02
    # the runner-up (3), then k, k - 1, ... without the best, in turn
    assert probes[:8] == [3, 3, 3, 2, 3, 1, 3, 0]


def test_min_drafts_bounds_the_sweep_the_choice_and_the_probes():
    """A tree config's chains (min_drafts 1): the drafter always runs, so 0 is never drafted
    even where plain decoding would be fastest."""
    times = RealizedStepTimes(K, min_drafts=1)
    plain_fastest = [0.1, 1.0, 2.0, 3.0, 4.0]
    choices = [times.decide(1, plain_fastest, [0.5] * K) for _ in range(64 * 4)]
    assert choices[:8] == [4, 4, 3, 3, 2, 2, 1, 1]  # the sweep stops at 1
    assert min(choices) == 1 and Counter(choices[8:]).most_common(1)[0][0] == 1
    assert best_num_drafts(plain_fastest, [0.5] * K) == 0
    assert best_num_drafts(plain_fastest, [0.5] * K, min_drafts=1) == 1


# --- the simulated engine -------------------------------------------------------------------

class Machine:
    """True step times: verify part a + b * B * (v + 1), draft part (d = 0: none)
    h + g * B * (d + 1) + s * (d - 1), each times a per-step noise factor."""

    def __init__(self, a=0.010, b=0.0005, h=0.0005, g=0.0002, s=0.0012, noise=0.0):
        self.a, self.b, self.h, self.g, self.s, self.noise = a, b, h, g, s, noise

    def parts(self, batch_size: int, verified: int, drafted: int, rng: random.Random):
        factor = lambda: max(0.3, 1 + self.noise * rng.gauss(0, 1))  # noqa: E731
        verify = (self.a + self.b * batch_size * (verified + 1)) * factor()
        draft = (self.h + self.g * batch_size * (drafted + 1)
                 + self.s * max(drafted - 1, 0)) * factor() if drafted else 0.0
        return verify, draft


def simulate(choose, machine: Machine, alpha, num_steps: int, batch_size: int, seed: int,
             policy: DraftPolicy | None = None):
    """Run ``num_steps`` decode steps; ``choose(step) -> d``; ``alpha(step) -> rate`` of every
    position. Returns (tokens / second, Counter of d)."""
    rng = random.Random(seed)
    tokens, seconds, verified, shares = 0, 0.0, 0, Counter()
    for step in range(num_steps):
        d = choose(step)
        shares[d] += 1
        step_rng = random.Random(rng.random())  # common random numbers per step
        a = alpha(step)
        # per request: the drafts it would accept (geometric with rate a), cut at verified
        runs = []
        for _ in range(batch_size):
            n = 0
            while n < K and step_rng.random() < a:
                n += 1
            runs.append(min(n, verified))
        verify_s, draft_s = machine.parts(batch_size, verified, d, step_rng)
        produced = sum(r + 1 for r in runs)
        tokens, seconds = tokens + produced, seconds + verify_s + draft_s
        if policy is not None:
            policy.observe(StepRecord(
                batch_size=batch_size, has_prefill=False, seconds=verify_s + draft_s,
                produced=produced, any_verified=verified > 0, drafted=d > 0, shape=None,
                verified_tree=False, samples=[True] * batch_size,
                chain_verified=[verified] * batch_size if verified else [],
                chain_accepted=runs if verified else [], num_drafts=d, draft_seconds=draft_s))
        verified = d
    return tokens / seconds, shares


def run_policy(machine, alpha, num_steps, batch_size, seed, prior: StepCosts):
    config = SpeculativeConfig("eagle3", K)
    policy = DraftPolicy(config, None)
    for bucket in (1, 2, 4, 8):
        policy.add_costs(True, bucket, prior)
    return simulate(lambda _: policy.num_drafts(batch_size), machine, alpha, num_steps,
                    batch_size, seed, policy)


def best_fixed(machine, alpha, num_steps, batch_size, seed):
    rates = {d: simulate(lambda _, d=d: d, machine, alpha, num_steps, batch_size, seed)[0]
             for d in range(K + 1)}
    best = max(rates, key=rates.get)
    return best, rates[best]


TRUE_PRIOR = StepCosts(0.010, 0.0005, 0.0005, 0.0002, 0.0012)  # the machine's own costs
# a start-up measured on a busy machine: the head 4x too dear, the target 2x
NOISY_PRIOR = StepCosts(0.020, 0.001, 0.002, 0.0008, 0.0048)
# the opposite: drafting looked free
CHEAP_PRIOR = StepCosts(0.010, 0.0001, 0.0, 0.0, 0.0)

STREAMS = {
    "stationary 0.8": lambda step: 0.8,
    "stationary 0.5": lambda step: 0.5,
    "drifting 0.9 -> 0.2": lambda step: 0.9 - 0.7 * min(step / 3000, 1.0),
    "noisy 0.3 / 0.9 every 50 steps": lambda step: 0.3 if (step // 50) % 2 else 0.9,
}


@pytest.mark.parametrize("stream", list(STREAMS))
@pytest.mark.parametrize("batch_size, machine", [
    (1, Machine(noise=0.15)),
    (8, Machine(b=0.002, noise=0.15)),  # verification dear: a large batch on a busy device
])
@pytest.mark.parametrize("prior", [TRUE_PRIOR, NOISY_PRIOR, CHEAP_PRIOR],
                         ids=["true-prior", "noisy-start", "cheap-start"])
def test_policy_is_within_3_percent_of_the_best_fixed_count_in_hindsight(
        stream, batch_size, machine, prior):
    alpha, steps = STREAMS[stream], 3000
    rate, shares = run_policy(machine, alpha, steps, batch_size, 7, prior)
    best, best_rate = best_fixed(machine, alpha, steps, batch_size, 7)
    assert rate >= 0.97 * best_rate, (rate / best_rate, best, dict(shares))


def test_a_perfect_head_settles_on_k():
    rate, shares = run_policy(Machine(noise=0.1), lambda step: 1.0, 2000, 1, 3, NOISY_PRIOR)
    assert shares[K] / 2000 > 0.95, shares


@pytest.mark.parametrize("batch_size, machine, settled", [
    # d = 1 costs 13% more than d = 0 here, a useless head's rate estimate stays at its
    # floor (0.7 / 21 = 3%)
    (1, Machine(noise=0.1), 0.95),
    (8, Machine(b=0.002, noise=0.1), 0.97),  # d = 1 costs 1.6x: d = 0 on all but probes
])
def test_a_useless_head_settles_on_0_and_speculation_returns_when_the_head_becomes_good(
        batch_size, machine, settled):
    config = SpeculativeConfig("eagle3", K)
    policy = DraftPolicy(config, None)
    for bucket in (1, 2, 4, 8):
        policy.add_costs(True, bucket, TRUE_PRIOR)
    switch, steps = 3000, 6000
    chosen = []

    def choose(step):
        chosen.append(policy.num_drafts(batch_size))
        return chosen[-1]

    simulate(choose, machine, lambda step: 0.0 if step < switch else 0.9, steps, batch_size,
             5, policy)
    useless = Counter(chosen[switch // 2:switch])
    assert useless[0] / (switch // 2) > settled, useless
    good = Counter(chosen[-1000:])
    assert good[0] / 1000 < 0.03, good  # speculating again (which d: the machine's)
