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
from rocdraft.spec_decode.policy import DraftPolicy
from rocdraft.spec_decode.step_record import StepRecord
from rocdraft.spec_decode.realized_times import (RARE_COST, RARE_FACTOR, SETTLED,
                                                 RealizedStepTimes, best_num_drafts, calibrated,
                                                 due_probe, prior_times, probe_cost,
                                                 probe_interval)

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
    assert at_three.buckets[4].verify[2][0].seconds == pytest.approx(0.012 * 22 / 19)
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
    # the sweep's two samples of a count, the first on a new shape (oneDNN makes its
    # kernels then): the second decides
    assert calibrated({1: deque([9.6, 8.3])}, [1.0, 2.0]) == [4.15, 8.3]


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


def test_probes_cost_under_2_percent_and_close_counts_are_probed_more_often():
    """Fixed estimates (no samples change them): after the sweep, each other count is
    drafted every probe_interval(probe_cost) steps, so what the probes cost in all (each
    probe's cost in steps of the best count, over the steps) is under 2%; the count
    closest to the best is probed most often, the farthest least, and every count is."""
    times = RealizedStepTimes(K)
    step_times, rates = [1.0, 1.1, 1.25, 1.4, 1.5], [0.9] * K
    choices = [times.decide(1, step_times, rates) for _ in range(10 + 2000)]
    assert choices[:10] == [4, 4, 3, 3, 2, 2, 1, 1, 0, 0]  # the sweep: each count twice
    choices = choices[10:]
    counts = Counter(choices)
    assert counts.most_common(1)[0][0] == 4
    cost = sum(probe_cost(step_times, rates, 4, d) for d in choices if d != 4)
    assert 0 < cost / len(choices) < 0.02
    assert counts[3] > counts[2] > counts[1] >= counts[0] > 0, counts
    for d in (0, 1, 2, 3):  # each count below the best costs over RARE_COST a probe here
        cost = probe_cost(step_times, rates, 4, d)
        assert cost >= RARE_COST
        # its first SETTLED probes come probe_interval(cost) steps apart (the sweep drafted
        # it twice, and the first probe is due probe_interval steps after); once settled,
        # RARE_FACTOR times as far
        at = [i for i, c in enumerate(choices) if c == d]
        gaps = [b - a for a, b in zip(at, at[1:])]
        assert gaps[0] == probe_interval(cost), (d, gaps)
        assert set(gaps[SETTLED - 1:]) == {probe_interval(cost, rare=True)}, (d, gaps)


def test_only_settled_dear_counts_below_the_best_are_probed_rarely():
    """``due_probe``'s rare probes: a count below the best, drafted SETTLED times since the
    sweep, whose probe costs at least RARE_COST (its positions are verified at every step
    of the best; what a probe could still change is its time alone). A count above the
    best (positions the best does not verify) and a count close to the best (a near tie:
    d = 0 against d = 1 at bs 8 on the built-in pair) keep the usual interval."""
    step_times, rates = [1.0, 1.1, 1.25, 1.8, 2.4], [0.9] * K
    assert best_num_drafts(step_times, rates) == 2
    cost = {d: probe_cost(step_times, rates, 2, d) for d in range(K + 1)}
    assert cost[0] >= RARE_COST and cost[4] >= RARE_COST  # 0 below 2, 4 above
    just_due = {d: probe_interval(cost[d]) for d in range(K + 1)}
    since = {d: just_due[d] for d in (0, 4)} | {1: 0, 2: 0, 3: 0}
    assert due_probe(step_times, rates, 2, {**since, 4: 0}) == 0  # not settled: due
    assert due_probe(step_times, rates, 2, {**since, 4: 0}, settled={0}) is None
    assert due_probe(step_times, rates, 2, {**since, 0: RARE_FACTOR * just_due[0], 4: 0},
                     settled={0}) == 0
    assert due_probe(step_times, rates, 2, {**since, 0: 0}, settled={0}) == 4  # above
    # a near tie below the best: d = 0 at 1 token per unit of time against d = 1's 1.012
    near, near_rates = [1.0, 1.8, 2.7], [0.82, 0.5]
    assert best_num_drafts(near, near_rates) == 1
    assert probe_cost(near, near_rates, 1, 0) < RARE_COST
    tie = probe_interval(probe_cost(near, near_rates, 1, 0))
    assert due_probe(near, near_rates, 1, {0: tie, 1: 0, 2: 0}, settled={0}) == 0


def test_a_good_head_at_bs_1_pays_little_for_probes():
    """A good head at bs 1, four streams (noise 5% and 15% per step, acceptance 0.85 and
    0.9; k = 4 best): the policy runs at 0.9945x fixed k on average, steps at d <= 1 under
    1%. With every count below the best probed at the usual interval (RARE_FACTOR 1) 0.987x
    (0.981-0.990), with 2.3% of steps at d <= 1."""
    ratios = []
    for alpha in (0.85, 0.9):
        for noise in (0.05, 0.15):
            rate, shares = run_policy(Machine(noise=noise), lambda step, a=alpha: a, 3000, 1,
                                      7, TRUE_PRIOR)
            best, best_rate = best_fixed(Machine(noise=noise), lambda step, a=alpha: a,
                                         3000, 1, 7)
            assert best == K
            assert (shares[0] + shares[1]) / 3000 < 0.01, shares
            ratios.append(rate / best_rate)
    assert sum(ratios) / len(ratios) >= 0.991, ratios


def test_a_count_whose_first_samples_were_slow_is_probed_back_into_use():
    """The built-in pair at bs 8: the sweep's samples of d = 1..3 came from the engine's
    first steps and put them 10-15% above what they run; d = 1 is the best count, but the
    policy saw d = 4 (re-measured every step) ahead. Probes of the close count d = 1
    re-measure it, and it takes over after the first."""
    machine = Machine(a=0.00394, b=0.000183, h=0.0013, g=0.00001, s=0.0013)  # the pair at bs 8
    rates = [0.77, 0.74, 0.82, 0.89]
    true = [sum(machine.parts(8, d, d, random.Random(0))) for d in range(K + 1)]
    assert best_num_drafts(true, rates) == 1
    times = RealizedStepTimes(K)
    rng = random.Random(0)
    choices = []
    for step in range(60):
        d = times.decide(8, times.step_times(8, TRUE_PRIOR, K), rates)
        choices.append(d)
        verified = choices[-2] if step else K
        verify, draft = machine.parts(8, verified, d, rng)
        slow = lambda count: 1.2 if step < 10 and count in (1, 2, 3) else 1.0  # noqa: E731
        # the sweep's samples of d = 3, 2, 1 (both of each) ran slow
        times.record(8, verified, d, verify * slow(verified), draft * slow(d), TRUE_PRIOR)
    assert choices[10:20] == [4] * 10  # the slow samples decide first
    # d = 1 first probed at step 23 here, and chosen from then on; one probe every 64 steps
    # (the policy before) kept d = 4 to step 63
    assert Counter(choices[30:]).most_common(1)[0][0] == 1, choices


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
    # the same bound for one decision (the outlook's, rocdraft/spec_decode/policy.py):
    # past the sweep, neither the choice nor a probe drafts 0
    times = RealizedStepTimes(K)
    choices = [times.decide(1, plain_fastest, [0.5] * K, min_drafts=1) for _ in range(256)]
    assert choices[:10] == [4, 4, 3, 3, 2, 2, 1, 1, 0, 0]  # the sweep is the bucket's own
    assert min(choices[10:]) == 1
    assert times.decide(1, plain_fastest, [0.5] * K) == 0


def test_a_step_with_prompt_tokens_never_probes():
    """A prefill step is no time sample, so its decision is the best count, never a probe
    (``probe=False``; DraftPolicy passes it for steps with prompt tokens)."""
    step_times, rates = [0.010, 0.011, 0.012, 0.013, 0.014], [0.8] * K
    best = best_num_drafts(step_times, rates)
    probing, plain = RealizedStepTimes(K), RealizedStepTimes(K)
    with_probes = [probing.decide(1, step_times, rates) for _ in range(300)]
    without = [plain.decide(1, step_times, rates, probe=plain.buckets.get(1) is None
                            or plain.buckets[1].steps < 2 * (K + 1)) for _ in range(300)]
    assert with_probes[:10] == without[:10]  # the sweep is the sweep either way
    assert set(with_probes[10:]) != {best} and set(without[10:]) == {best}


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
             policy: DraftPolicy | None = None, trace: list | None = None):
    """Run ``num_steps`` decode steps; ``choose(step) -> d``; ``alpha(step) -> rate`` of every
    position. Returns (tokens / second, Counter of d); ``trace`` gets (tokens, seconds) per
    step."""
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
        if trace is not None:
            trace.append((produced, verify_s + draft_s))
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


class SlowSpells(Machine):
    """The machine with the host's slow spells: every ``period`` steps, ``length`` steps
    run ``factor`` times slower (both parts; another process, a shared VM)."""

    def __init__(self, period: int, length: int, factor: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.period, self.length, self.factor, self.step = period, length, factor, 0

    def parts(self, batch_size: int, verified: int, drafted: int, rng: random.Random):
        verify, draft = super().parts(batch_size, verified, drafted, rng)
        slow = self.factor if self.step % self.period < self.length else 1.0
        self.step += 1
        return verify * slow, draft * slow


@pytest.mark.parametrize("stream", list(STREAMS))
def test_slow_spells_of_the_host_do_not_stick_to_the_counts_drafted_in_them(stream):
    """40 steps in every 300 run 1.5x slow. A count probed (or drafted) in a spell kept the
    spell's samples until its next probe, tens to hundreds of steps on. Mean of 4 seeds,
    against the best fixed count: with the samples re-levelled to the host's speed now
    (rocdraft/spec_decode/host_level.py) 0.981, 0.982, 1.052 and 0.985 on these streams;
    as taken 0.979, 0.968 (stationary 0.5 fails), 1.042 and 0.979 (the module before the
    level, without REFRESH either: 0.973, 0.969, 1.054, 0.970)."""
    alpha, steps, ratios = STREAMS[stream], 3000, []
    for seed in range(4):
        rate, _ = run_policy(SlowSpells(300, 40, 1.5, noise=0.1), alpha, steps, 1, seed,
                             TRUE_PRIOR)
        fixed = [simulate(lambda _, d=d: d, SlowSpells(300, 40, 1.5, noise=0.1), alpha, steps,
                          1, seed)[0] for d in range(K + 1)]
        ratios.append(rate / max(fixed))
    assert sum(ratios) / len(ratios) >= 0.975, ratios


def rate_of(trace: list) -> float:
    return sum(t for t, _ in trace) / sum(s for _, s in trace)


def test_a_perfect_head_settles_on_k():
    """Almost every step drafts k, and what the probes of the other counts cost is under 2%
    of fixed k's throughput on the same stream."""
    rate, shares = run_policy(Machine(noise=0.1), lambda step: 1.0, 2000, 1, 3, NOISY_PRIOR)
    fixed_k, _ = simulate(lambda _: K, Machine(noise=0.1), lambda step: 1.0, 2000, 1, 3)
    assert shares[K] / 2000 > 0.9, shares
    assert rate >= 0.98 * fixed_k, (rate / fixed_k, shares)


@pytest.mark.parametrize("batch_size, machine", [
    # d = 1 costs 13% more than d = 0 here, a useless head's rate estimate stays at its
    # floor (0.7 / 21 = 3%)
    (1, Machine(noise=0.1)),
    (8, Machine(b=0.002, noise=0.1)),  # d = 1 costs 1.6x: d = 0 on all but probes
])
def test_a_useless_head_settles_on_0_and_speculation_returns_when_the_head_becomes_good(
        batch_size, machine):
    """While the head is useless, 90% of steps skip the drafter and the probes cost under
    2% of plain decoding's throughput; once it is good, 90% of steps speculate again and
    the policy runs within 3% of the best fixed count."""
    config = SpeculativeConfig("eagle3", K)
    policy = DraftPolicy(config, None)
    for bucket in (1, 2, 4, 8):
        policy.add_costs(True, bucket, TRUE_PRIOR)
    switch, steps = 3000, 6000
    alpha = lambda step: 0.0 if step < switch else 0.9  # noqa: E731
    chosen, trace = [], []

    def choose(step):
        chosen.append(policy.num_drafts(batch_size))
        return chosen[-1]

    simulate(choose, machine, alpha, steps, batch_size, 5, policy, trace)
    fixed = {}
    for d in range(K + 1):
        fixed[d] = []
        simulate(lambda _, d=d: d, machine, alpha, steps, batch_size, 5, trace=fixed[d])
    useless = Counter(chosen[switch // 2:switch])
    assert useless[0] / (switch // 2) > 0.9, useless
    assert rate_of(trace[switch // 2:switch]) >= 0.98 * rate_of(fixed[0][switch // 2:switch])
    good = Counter(chosen[-1000:])
    assert good[0] / 1000 < 0.1, good  # speculating again (which d: the machine's)
    best = max(rate_of(f[-1000:]) for f in fixed.values())
    assert rate_of(trace[-1000:]) >= 0.97 * best, (rate_of(trace[-1000:]) / best, good)


def test_the_modules_examples():
    import doctest

    from rocdraft.spec_decode import realized_times

    assert doctest.testmod(realized_times).failed == 0
