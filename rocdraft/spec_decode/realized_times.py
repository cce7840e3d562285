"""Step times per draft count from the engine's own realized steps, and the draft count that
maximises expected tokens per second on them (the chain cost policy's decision).

Why: step costs measured once at start-up on dummy inputs (rocdraft/spec_decode/step_costs.py)
were trusted for the whole run; on a loaded machine one noisy measurement kept the built-in
pair at small d (or none) for good, 0.72x of simply verifying k drafts. Here the start-up
costs are only a prior: every pure decode step of the run is a sample, and what it measured
replaces what was guessed.

A step's time splits in two parts the engine clocks separately (``StepRecord``):
- verify part: schedule, target forward, verification, bookkeeping; it depends on the drafts
  per request the step *verified* (v), so a sample is keyed by v (steps whose requests
  verified different counts are no sample);
- draft part: the head's first forward and its further draft steps; keyed by the drafts per
  request the step *made* (d; d = 0 skips the drafter: about nothing).

In steady state at d, a step verifies d and drafts d, so T(d) = verify[d] + draft[d]. Each
entry is the mean of its last ``RECENT`` samples less the slowest (one slow step, a garbage
collection or another process, moves it little; a lasting change moves it within RECENT
samples), each sample of a count the policy drafts rarely scaled by how much the count it
drafts most has slowed or sped up since (rocdraft/spec_decode/host_level.py). An entry
without samples is its prior times the median ratio realized / prior of the same part's
sampled entries (a start-up measured on a busy machine is scaled back by what the run
measured); without any sample, the prior itself.

One bucket holds several batch sizes (5-8 requests share bucket 8), and at the end of a
batch requests finish at different steps, so a count's last samples were often taken at
5-7 requests; kept as they were, they made that count look cheap for the next full batch
(on the built-in pair at bs 8: d = 3 estimated at 20.5 ms against 27 measured, so the
policy drafted 3 where plain decoding was faster). So a sample is kept as the time at the
bucket's size, its seconds times prior(bucket size) / prior(its batch size) (``prior_times``
of that part and count; unscaled where the prior is 0), and an estimate at B is scaled back
by prior(B) / prior(bucket size): the prior gives the shape in B, the run the level.

Decision, per policy step i of a batch bucket: first a sweep, each count k, k - 1, ..., 0
for two steps (the second verifies what it drafts: a sample of both parts), so that every
count has realized times before the prior's shape decides anything (on the built-in pair at
bs 8 the start-up shape kept d = 4 where d = 1 ran 1.2x faster); then ``best_num_drafts`` on
those times and the acceptance rates, except when another count is due for a probe
(``due_probe``). A probe drafts that count for one step: it refreshes the count's draft time
now and its verify time next step, and a probe of d >= 1 feeds the acceptance of positions
the best count does not verify (a useless head at d = 0 is switched back on once probes see
its drafts accepted).

Probes are priced by what they cost: a probe of d costs ``probe_cost`` = T(d) / T(best) -
E(d) / E(best) of the best count's steps (the time it takes less the time the best count
needs for the same tokens), and d is due ``probe_interval`` = cost / PROBE_BUDGET steps after
it was last drafted (at least MIN_PROBE_INTERVAL), so each other count costs at most
PROBE_BUDGET of the throughput and all k of them together under 2%. Counts close to
the best, whose estimates decide the choice, are re-measured often and cheaply; far ones
rarely. Why: a count's first samples come from the sweep, at the first steps of the engine's
life, the first of them at a row count oneDNN has not made kernels for (``robust_mean``); on
the built-in pair at bs 8 they put d = 1 at 9.6 ms where it runs 8.3, and with one probe
every 64 steps the policy drafted d = 4 (1.61 tokens per ms) instead of d = 1 (1.71) for the
whole run. A stale estimate that is too low corrects itself (the count is chosen, so sampled
every step); one that is too high only by probes. Once a count below the best has been
drafted twice after the sweep, and its probe is no near tie, it is probed RARE_FACTOR times
less often (``due_probe``): every position it drafts is verified at every step of the best,
so only its time can go stale (at bs 1 on the built-in EAGLE-1 pair the probes fell from
5.6% to 1.4% of the steps).

Worked example (k = 2, B = 1): realized verify {2: 12 ms} and draft {2: 4 ms}; prior
StepCosts(10, 1, 0.5, 0.5, 1) ms gives verify 11, 12, 13 and draft 0, 1.5, 3 (``prior_times``):
ratios 12/13 and 4/3, so T = verify 10.15, 11.08, 12 + draft 0, 2, 4 = 10.15, 13.1, 16 ms.
Rates [0.8, 0.8]: E = 1, 1.8, 2.44 and E/T = 0.099, 0.138, 0.153 tokens/ms: d = 2. Those
samples taken at B = 3 instead (bucket 4, prior verify 14, 18, 22 there and 13, 16, 19 at
B = 3) are kept as 12 x 22 / 19 = 13.9 ms for v = 2 at B = 4, and estimate T(2) at B = 3 as
12 ms again.
"""
from __future__ import annotations

import functools
import statistics
from collections import deque
from dataclasses import dataclass, field

from rocdraft.spec_decode.cost_model import StepCosts, batch_bucket, expected_tokens
from rocdraft.spec_decode.host_level import (RecentCounts, Sample, leveled, reference,
                                            robust_mean)

RECENT = 8  # samples kept per entry
REFRESH = 4  # samples of a bucket its step-time table is kept for (a new count's: none)
PROBE_BUDGET = 0.0025  # share of throughput one other count's probes may cost
MIN_PROBE_INTERVAL = 32  # policy steps between probes of one count, at least
# A count below the best, drafted SETTLED times since the sweep, is probed RARE_FACTOR times
# less often (``due_probe``): the best count verifies every position it drafts, so only its
# step time can go stale, and the samples' host level keeps that at the host's speed.
RARE_FACTOR = 8
SETTLED = 2
RARE_COST = 0.05


def best_num_drafts(step_times: list[float], rates: list[float], min_drafts: int = 0) -> int:
    """argmax over d >= ``min_drafts`` of E(d) / T(d) (``expected_tokens``), the smaller d on
    ties (within 1e-9 relative). step_times: T(0), ..., T(k) in seconds (all > 0); rates:
    conditional acceptance per position, at least k of them.

    >>> best_num_drafts([10.0, 12.0, 14.0], [0.8, 0.8])  # E/T = 0.1, 0.15, 0.174
    2
    >>> best_num_drafts([10.0, 12.0, 14.0], [0.1, 0.1])  # E/T = 0.1, 0.092, 0.079
    0
    """
    best, best_rate = min_drafts, 0.0
    for d, tokens in enumerate(expected_all(rates, len(step_times))):
        if d < min_drafts:
            continue
        rate = tokens / step_times[d]
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = d, rate
    return best


def expected_all(rates: list[float], counts: int) -> list[float]:
    """E(0), ..., E(counts - 1) (``expected_tokens``) in one pass.

    >>> [round(e, 2) for e in expected_all([0.8, 0.8], 3)]
    [1.0, 1.8, 2.44]
    """
    out, total, survive = [1.0], 1.0, 1.0
    for alpha in rates[:counts - 1]:
        survive *= alpha
        total += survive
        out.append(total)
    return out


def prior_times(costs: StepCosts, batch_size: int, max_drafts: int
                ) -> tuple[list[float], list[float]]:
    """(verify part, draft part) per d = 0..max_drafts from start-up costs: verify[v] =
    target_fixed + target_per_token * B * (v + 1); draft[d] = the head's first forward over
    B * (d + 1) tokens plus (d - 1) draft steps (d = 0: no drafter, 0)."""
    verify, draft = _prior_times(costs, batch_size, max_drafts)
    return list(verify), list(draft)


@functools.lru_cache(maxsize=1024)
def _prior_times(costs: StepCosts, batch_size: int, max_drafts: int
                 ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``prior_times``, kept (the policy asks for the same few every step)."""
    verify = tuple(costs.time_for_drafts(batch_size, batch_size * v, 0)
                   for v in range(max_drafts + 1))
    draft = tuple(costs.time_for_drafts(batch_size, batch_size * d, d) - verify[d]
                  for d in range(max_drafts + 1))
    return verify, draft


def calibrated(samples: dict[int, deque], prior: list[float]) -> list[float]:
    """Per d: the robust mean of its samples (``robust_mean``), else its prior times the
    median ratio estimate / prior of the sampled entries (1 without any).

    >>> calibrated({1: deque([2.0, 9.0, 4.0])}, [1.0, 1.5, 2.0])  # 3 = 2 x prior
    [2.0, 3.0, 4.0]
    """
    measured = {d: robust_mean(s) for d, s in samples.items() if s and d < len(prior)}
    ratios = [m / prior[d] for d, m in measured.items() if prior[d] > 0]
    scale = statistics.median(ratios) if ratios else 1.0
    return [measured.get(d, p * scale) for d, p in enumerate(prior)]


def rescale(seconds: float, prior_to: float, prior_from: float) -> float:
    """``seconds`` taken where the prior says ``prior_from``, moved to where it says
    ``prior_to``; unchanged where either is 0 (a prior without that part).

    >>> rescale(12.0, 22.0, 19.0), rescale(3.0, 0.0, 2.0)
    (13.894736842105264, 3.0)
    """
    return seconds * prior_to / prior_from if prior_to > 0 and prior_from > 0 else seconds


@dataclass
class _Bucket:
    steps: int = 0  # policy decisions taken in this bucket
    last: dict = field(default_factory=dict)  # d -> the policy step that last drafted it
    drafted: dict = field(default_factory=dict)  # d -> policy steps drafting it, after the sweep
    samples: int = 0  # steps recorded
    version: int = 0  # the kept step times' (``step_times``): moves every REFRESH samples
    step_times: dict = field(default_factory=dict)  # (B, prior, max d) -> (version, times)
    verify: dict = field(default_factory=dict)  # v -> deque of Samples at the bucket's size
    draft: dict = field(default_factory=dict)  # d -> deque of Samples at the bucket's size
    # the verified counts of the last WINDOW samples (the main count, host_level.py)
    recent: RecentCounts = field(default_factory=RecentCounts)


class RealizedStepTimes:
    """Per batch bucket: realized verify and draft seconds per draft count, and the decision
    (the module docstring's rule)."""

    def __init__(self, max_drafts: int, sweep: bool = True, min_drafts: int = 0) -> None:
        """``sweep``: start each bucket with the sweep (not for given step times: nothing
        to measure); ``min_drafts``: the fewest drafts a decision may make (1 for the chains
        of a tree config, whose drafter always runs: rocdraft/spec_decode/draft_shape.py)."""
        self.max_drafts, self.sweep, self.min_drafts = max_drafts, sweep, min_drafts
        self.buckets: dict[int, _Bucket] = {}
        self.probed = False  # the last decision was the sweep's or a probe (``decide``)

    def _bucket(self, batch_size: int) -> _Bucket:
        bucket = self.buckets.get(batch_bucket(batch_size))
        if bucket is None:  # (not setdefault: a _Bucket is built only when new)
            bucket = self.buckets[batch_bucket(batch_size)] = _Bucket()
        return bucket

    def record(self, batch_size: int, verified: int | None, drafted: int,
               verify_seconds: float, draft_seconds: float, prior: StepCosts) -> None:
        """One pure decode step: ``verified`` drafts per request (None: the requests verified
        different counts, no verify sample), ``drafted`` per request made; kept at the
        bucket's size by ``prior``'s shape (the module docstring)."""
        bucket = self._bucket(batch_size)
        bucket.samples += 1
        counts = max(verified or 0, drafted)
        at_bucket = _prior_times(prior, batch_bucket(batch_size), counts)
        here = _prior_times(prior, batch_size, counts)
        # the level when taken: the main count's samples so far (rocdraft/spec_decode/
        # host_level.py)
        ref = reference(bucket.verify, bucket.recent.main())
        new_count = False  # an entry's first or second sample: the table is out of date now
        if verified is not None and verify_seconds > 0:
            kept = bucket.verify.setdefault(verified, deque(maxlen=RECENT))
            kept.append(Sample(
                rescale(verify_seconds, at_bucket[0][verified], here[0][verified]), *ref))
            bucket.recent.add(verified)
            new_count = len(kept) <= 2
        if draft_seconds > 0:
            kept = bucket.draft.setdefault(drafted, deque(maxlen=RECENT))
            kept.append(Sample(
                rescale(draft_seconds, at_bucket[1][drafted], here[1][drafted]), *ref))
            new_count = new_count or len(kept) <= 2
        if new_count or bucket.samples % REFRESH == 0:
            bucket.version += 1

    def step_times(self, batch_size: int, prior: StepCosts, max_drafts: int) -> list[float]:
        """T(0..max_drafts) in seconds at this batch size: realized (calibrated prior where
        unmeasured) at the bucket's size, moved to this size by the prior's shape. Kept
        for REFRESH samples of the bucket, or until a count gets its first or second: each
        entry is a mean of up to RECENT samples, and the table was most of the policy's own
        time (0.1-0.2 ms of a 7-8 ms step on the built-in pair at bs 1, computed every
        step). Samples of counts other than the bucket's main one are re-levelled to the
        host's speed now (rocdraft/spec_decode/host_level.py)."""
        bucket = self._bucket(batch_size)
        key = (batch_size, prior, max_drafts)
        kept = bucket.step_times.get(key)
        if kept is not None and kept[0] == bucket.version:
            return list(kept[1])
        verify, draft = _prior_times(prior, batch_bucket(batch_size), max_drafts)
        verify_here, draft_here = _prior_times(prior, batch_size, max_drafts)
        main, main_mean = reference(bucket.verify, bucket.recent.main())
        times = [rescale(v, vh, vb) + rescale(d, dh, db) for v, d, vb, db, vh, dh in zip(
            calibrated(leveled(bucket.verify, main, main_mean), verify),
            calibrated(leveled(bucket.draft, main, main_mean), draft),
            verify, draft, verify_here, draft_here)]
        bucket.step_times[key] = (bucket.version, tuple(times))
        return times

    def decide(self, batch_size: int, step_times: list[float], rates: list[float],
               min_drafts: int = 0, probe: bool = True) -> int:
        """The drafts per request of this policy step: the sweep, then the best count or
        (``probe``) a due probe (the module docstring), of at least ``min_drafts`` (and the
        constructor's) drafts after the sweep."""
        bucket = self._bucket(batch_size)
        i = bucket.steps
        sweeping = self.in_sweep(batch_size, len(step_times) - 1)
        bucket.steps += 1
        if sweeping:  # the sweep: k, k, k - 1, ..., min, min
            choice = len(step_times) - 1 - i // 2
            self.probed = True  # not the best count: ``DraftPolicy`` does not repeat it
        else:
            fewest = max(self.min_drafts, min_drafts)
            best = best_num_drafts(step_times, rates, fewest)
            since = {d: i - bucket.last.get(d, -1)  # never drafted: as if at step -1
                     for d in range(fewest, len(step_times))}
            settled = {d for d in range(fewest, best) if bucket.drafted.get(d, 0) >= SETTLED}
            due = due_probe(step_times, rates, best, since, fewest, settled) if probe else None
            choice = best if due is None else due
            self.probed = due is not None
            bucket.drafted[choice] = bucket.drafted.get(choice, 0) + 1
        bucket.last[choice] = i
        return choice

    def in_sweep(self, batch_size: int, max_drafts: int) -> bool:
        """Whether this bucket's next decision is still one of the sweep's."""
        return self.sweep and self._bucket(batch_size).steps \
            < 2 * (max_drafts + 1 - self.min_drafts)

    def repeat(self, batch_size: int, choice: int) -> None:
        """A policy step that drafts ``choice`` again without deciding (DraftPolicy's
        DECIDE_EVERY): counted as ``decide`` counts its steps, so probes stay as many steps
        apart."""
        bucket = self._bucket(batch_size)
        bucket.last[choice] = bucket.steps
        bucket.drafted[choice] = bucket.drafted.get(choice, 0) + 1
        bucket.steps += 1


def probe_interval(cost: float, rare: bool = False) -> int:
    """Policy steps between probes of a count whose probe costs ``cost`` steps of the best
    count (``probe_cost``): cost / PROBE_BUDGET, at least MIN_PROBE_INTERVAL; ``rare`` (a
    settled count below the best, ``due_probe``) RARE_FACTOR times that.

    >>> probe_interval(0.0), probe_interval(0.1), probe_interval(1.6), probe_interval(0.1, True)
    (32, 40, 640, 320)
    """
    return max(round(cost / PROBE_BUDGET), MIN_PROBE_INTERVAL) * (RARE_FACTOR if rare else 1)


def probe_cost(step_times: list[float], rates: list[float], best: int, d: int,
               expected: list[float] | None = None) -> float:
    """What drafting ``d`` once instead of ``best`` costs, in steps of ``best``: its step
    (the draft part now, the verify part next step) takes T(d) where the best would have
    made the same E(d) tokens in E(d) / E(best) of its steps.

    >>> round(probe_cost([10.0, 12.0, 14.0], [0.8, 0.8], 2, 0), 3)  # 10/14 - 1/2.44
    0.304
    """
    if expected is None:  # E(0..k), when the caller has not computed them (``due_probe``)
        expected = expected_all(rates, len(step_times))
    return max(step_times[d] / step_times[best] - expected[d] / expected[best], 0.0)


def due_probe(step_times: list[float], rates: list[float], best: int, since: dict[int, int],
              min_drafts: int = 0, settled: set[int] | frozenset = frozenset()) -> int | None:
    """The count to probe now, or None: of the counts other than ``best`` drafted at least
    ``probe_interval(probe_cost)`` policy steps ago (``since[d]``; RARE_FACTOR times that
    for a count in ``settled``), the cheapest to probe (the closest to the best: its
    estimate is the likeliest to change the choice).

    ``settled``: counts below the best whose samples are not only the sweep's (drafted
    SETTLED times since), probed RARE_FACTOR times less often where a probe costs at least
    RARE_COST (not a near tie). A count above the best has positions the best does not
    verify, so its acceptance and its time both go stale; a count below has every position
    verified at every step, and its time is kept at the host's speed (host_level.py): what
    a probe could change is its time alone, and a time the sweep left too high (the
    engine's first steps, ``robust_mean``) has been re-measured by the first SETTLED
    drafts. A good head at bs 1 (tests/test_realized_times.py::
    test_a_good_head_at_bs_1_pays_little_for_probes): 0.987x fixed k with every count
    probed at the usual interval, 0.9945x with the settled ones rare; on a simulated bs-1
    chain of the built-in EAGLE-1 pair's per-position rates, requests of 64 tokens and the
    host's speed drifting, 0.990x -> 0.996x (steady host) and 0.986x -> 0.990x. In the
    engine (the built-in EAGLE-1 pair, bs 1, 8 prompts x 64 tokens, 6 runs) the probes
    fell from 54 to 13 in about 970 steps; at bs 8 17 and 18 (its counts below the best
    are near ties there). The near-tie exemption: all counts below the best rare moved the
    batch simulations of tests/test_batch_finish.py (the built-in pair's spread at bs 8)
    from 1.0014x to 1.0048x the best fixed count's time; with it they do not move.

    >>> # probes of 0 and 1 cost 0.30 and 0.12 steps of d = 2: due after 122 and 48 steps
    >>> due_probe([10.0, 12.0, 14.0], [0.8, 0.8], 2, {0: 130, 1: 50, 2: 0})
    1
    >>> due_probe([10.0, 12.0, 14.0], [0.8, 0.8], 2, {0: 100, 1: 40, 2: 0}) is None
    True
    """
    # a count drafted fewer than MIN_PROBE_INTERVAL steps ago is not due, whatever it costs
    waiting = [d for d in range(min_drafts, len(step_times))
               if d != best and since[d] >= MIN_PROBE_INTERVAL]
    if not waiting:
        return None
    expected = expected_all(rates, len(step_times))
    costs = {d: probe_cost(step_times, rates, best, d, expected) for d in waiting}
    due = [d for d, cost in costs.items()
           if since[d] >= probe_interval(cost, d in settled and cost >= RARE_COST)]
    return min(due, key=lambda d: (costs[d], d)) if due else None
