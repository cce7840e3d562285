"""The draft count that finishes a batch soonest, when the batch is all the work left and
every request's end is known (the chain cost policy's objective then; rocdraft/spec_decode/
policy.py).

Why. Per step the policy maximises expected tokens per second, which is right while
finished requests are replaced from a queue. When nothing waits, the batch runs until its
slowest request is done, and requests do not finish together under speculation: their
acceptance differs (on the built-in pair at bs 8, 8 held-out prompts x 64 tokens, fixed
k = 4: the slowest request accepted 2.1 tokens per step against 3.2 on average) and the last
steps run at 1-7 requests, where a step costs most of a full one. Per step, d = 1..4 lay
within 6% there; end to end fixed 1 ran at 1.0x target-only and fixed 4 at 0.85x.

The model. Request i has r_i tokens left and its own acceptance scale rho_i (the share of
the draft positions it verified that it accepted, shrunk towards the running rates' pooled
share by PRIOR_POSITIONS positions, over that pooled share; ``RequestAcceptance``): it
accepts position j
with probability min(rho_i * alpha_j, 1), so it makes m_i(d) tokens per step with variance
v_i(d) (``tokens_per_step``) and needs N_i(d) = r_i / m_i(d) steps at d, give or take
s_i(d) = sqrt(r_i v_i / m_i^3 + (r_i m_i' sigma_i / m_i^2)^2): a renewal count's spread, and
that of the scale's own error sigma_i (``RequestAcceptance.scale_sd``; m_i' = dm_i / drho)
moved to steps. A step of b requests takes
T(b, d) = c0(d) + c1(d) * b (the step times at the batch's size B and at 1 request, on a
line), so holding d until the batch is done takes

    time(d) = c0(d) * max_i (N_i(d) + g_B s_i(d)) + c1(d) * sum_i N_i(d)

(every step until the slowest request is done pays c0, and the slowest of B lags its mean by
about g_B = E max of B standard normals, ``expected_max_normal``; each request pays c1 per
step it runs). Larger d separates the requests both ways: by their acceptance (rho) and by
chance (v grows with d). The scale's error matters at a batch's start: a request that has
verified no draft reads rho = 1 with sigma = sqrt(p (1 - p) / PRIOR_POSITIONS) / p, the
spread of scales the shrinkage assumes (0.18 at p = 0.8). Without it eight new requests
looked alike, the slowest of them only chance behind, and on the built-in pair's bs 8 step
times (T(8, d) = 5.4, 8.1, 11.3, 12.8, 15.3 ms, rates 0.82, 0.78, 0.86, 0.85) a batch's
first steps drafted 3 where every later one, on the requests' own acceptance, drafted 1;
with it they draft 1 (``test_a_new_batchs_unknown_scales_spread_its_finish``).

The policy's decision maximises E(d) / T(d) on the running rates; it is handed T'(d) =
time(d) * E(d) / sum_i r_i instead, so that E(d) / T'(d) = sum_i r_i / time(d): the same
decision and the same priced probes (rocdraft/spec_decode/realized_times.py), now on the
batch's finish time. With every request alike and no spread
(d = 0), max_i N_i = mean_i N_i and T'(d) = T(B, d) / B: the per-step objective. A request
alone (B = 1), or the slow ones of a tail, is decided on its own recent acceptance against
the running rates as they are now (rho is decayed as they are, so a request the running
rates have come to describe reads about 1, and one the finished fast requests still weigh
on reads below it).

Why d = 0 is decided on hopeful scales. The outlook may prefer d = 0 where the per-step
objective drafts (a slow request makes every drafting step wait for it). But a d = 0 step
verifies nothing, so the scales that chose it are never corrected: on the built-in pair at
bs 8 one request read rho = 0.64 after 4 steps (it accepted about 0.75 of the pooled rate
over the whole run), the outlook put d = 0 1.5% ahead of d = 1, and the policy decoded
without drafts for the remaining 45 steps, at 0.84-0.91x of fixed d = 1 where the per-step
times favoured d = 1 by 16%. So the outlook stops drafting only when d = 0 also wins with
every scale STOP_OPTIMISM standard errors higher (``RequestAcceptance.scale``); until
then it chooses among d >= 1, whose steps keep measuring. A request the head truly cannot
draft for is found once its standard error has shrunk (one that rejects every draft of d = 1
steps among seven that accept all: after 10-20 steps,
``test_the_outlook_stops_drafting_only_on_scales_it_can_trust``), which costs the simulated
batches with two such requests about 3% (1.09x the best fixed count's time against 1.056x
before, tests/test_batch_finish.py).

Worked example (k = 1, rates [0.8]; T(1, d) = 5, 7 ms and T(2, d) = 6, 10 ms, so c0 = 4, 4
and c1 = 1, 3): two requests with 10 tokens left, rho 1 and 0.5 (m = 1.8 and 1.4, v = 0.16
and 0.24; g_2 = 0.59): d = 0 takes 4 * 10 + 1 * 20 = 60 ms; d = 1 takes
4 * (7.14 + 0.59 * 0.94) + 3 * (5.56 + 7.14) = 30.8 + 38.1 = 68.9 ms, so plain decoding
finishes first; per step d = 1 looked ahead (2 * 1.8 / 10 = 0.36 tokens per ms against
2 / 6 = 0.33).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from statistics import NormalDist

from rocdraft.spec_decode.cost_model import RATE_DECAY, expected_tokens
from rocdraft.spec_decode.realized_times import best_num_drafts, expected_all

PRIOR_POSITIONS = 8.0  # positions of shrinkage towards the batch's rates (rho = 1)
SCALE_STEPS = 32  # requests whose scales round alike (to 1/32) are counted as one group
MAX_TRACKED = 4096  # requests tracked at most (then only those of the step at hand)
SLOPE_STEP = 0.05  # of a scale: the step of dm / drho's central difference
TIE_SHARE = 0.01  # of the mean's gain the slowest keeps where the spread says it gains none
STOP_OPTIMISM = 1.0  # standard errors added to each scale before the outlook stops drafting


@dataclass(frozen=True)
class BatchOutlook:
    """The step's requests, in batch order: their keys and the tokens each has left. Built
    by the engine only when the batch is all the work left (no request waits) and every
    request ends at a known length (EOS ignored, no stop token): otherwise None."""

    keys: tuple
    remaining: tuple[int, ...]


class RequestAcceptance:
    """Per request: its drafts accepted and the draft positions it verified, both decayed
    per step it verifies as the running rates are (RATE_DECAY: a request's acceptance
    drifts too, and a request alone must read as the running rates read it); ``scale`` ->
    rho against the running rates' pooled rate (the module docstring)."""

    def __init__(self) -> None:
        self.counts: dict = {}  # key -> [accepted, positions verified]

    def observe(self, keys: list, verified: list[int], accepted: list[int]) -> None:
        """One step's chains: request ``keys[i]`` verified ``verified[i]`` drafts and accepted
        ``accepted[i]``, so it verified positions 1 .. min(accepted + 1, verified)."""
        keep = 1.0 - RATE_DECAY
        if len(self.counts) > MAX_TRACKED:  # requests that left without finishing (aborted,
            # a client gone) are never forgotten: keep only this step's
            self.counts = {key: self.counts[key] for key in keys if key in self.counts}
        for key, v, a in zip(keys, verified, accepted):
            entry = self.counts.setdefault(key, [0.0, 0.0])
            entry[0] = keep * entry[0] + a
            entry[1] = keep * entry[1] + min(a + 1, v)

    def seen_all(self, keys) -> bool:
        """Every request of ``keys`` has verified a draft (its scale is more than the
        prior's)."""
        counts = self.counts
        return all(key in counts for key in keys)

    def _share(self, key, pooled_rate: float) -> tuple[float, float]:
        """(p, its standard error): the request's accepted share of the positions it
        verified, shrunk towards ``pooled_rate`` by PRIOR_POSITIONS positions, and
        sqrt(p (1 - p) / (positions + PRIOR_POSITIONS))."""
        accepted, positions = self.counts.get(key, (0, 0))
        shrunk = (accepted + PRIOR_POSITIONS * pooled_rate) / (positions + PRIOR_POSITIONS)
        return shrunk, math.sqrt(max(shrunk * (1.0 - shrunk), 0.0)
                                 / (positions + PRIOR_POSITIONS))

    def scale_sd(self, key, pooled_rate: float) -> float:
        """The standard error of ``scale`` (that of the shrunk share over ``pooled_rate``;
        a request not seen: the spread of scales the shrinkage assumes).

        >>> round(RequestAcceptance().scale_sd("new", 0.8), 3)  # sqrt(0.8 * 0.2 / 8) / 0.8
        0.177
        """
        if pooled_rate <= 0.0:
            return 0.0
        return self._share(key, pooled_rate)[1] / pooled_rate

    def scales_and_sds(self, keys, pooled_rate: float) -> tuple[list[float], list[float]]:
        """(``scale``, ``scale_sd``) of each of ``keys``: both from one share per request.

        >>> acc = RequestAcceptance()
        >>> acc.observe(["a"], [4], [0])
        >>> [[round(x, 3) for x in xs] for xs in acc.scales_and_sds(["a", "b"], 0.8)]
        [[0.889, 1.0], [0.189, 0.177]]
        """
        if pooled_rate <= 0.0:
            return [1.0] * len(keys), [0.0] * len(keys)
        shares = [self._share(key, pooled_rate) for key in keys]
        return [p / pooled_rate for p, _ in shares], [e / pooled_rate for _, e in shares]

    def forget(self, keys) -> None:
        """Finished requests."""
        for key in keys:
            self.counts.pop(key, None)

    def scale(self, key, pooled_rate: float, optimism: float = 0.0) -> float:
        """rho: the request's accepted share of the positions it verified, shrunk towards
        ``pooled_rate`` (the running rates' accepted share, every request's) by
        PRIOR_POSITIONS positions, plus ``optimism`` standard errors of that share
        (sqrt(p (1 - p) / (positions + PRIOR_POSITIONS))), over ``pooled_rate``; without
        optimism 1 for a request not seen.

        Against the running rates *now*, not when each draft was verified: at the end of a
        batch the running rates drift towards the requests still running, and a request
        alone (or the slow ones of a tail) is then scaled by about 1, not counted twice.

        >>> acc = RequestAcceptance()
        >>> acc.observe(["a"], [4], [0])  # 1 position verified, none accepted
        >>> round(acc.scale("a", 0.8), 3), acc.scale("b", 0.8)  # (0 + 6.4) / 9 / 0.8
        (0.889, 1.0)
        >>> round(acc.scale("a", 0.8, 1.0), 3)  # (0.711 + sqrt(0.711 * 0.289 / 9)) / 0.8
        1.078
        """
        if pooled_rate <= 0.0:
            return 1.0
        shrunk, error = self._share(key, pooled_rate)
        return (shrunk + optimism * error) / pooled_rate


def finish_step_times(times_full: list[float], times_one: list[float], batch_size: int,
                      rates: list[float], remaining: list[int], scales: list[float],
                      scale_sds: list[float] | None = None) -> list[float]:
    """T'(0..k) (the module docstring): step times that make the per-step decision finish
    the batch soonest. times_full: T(B, d) at ``batch_size`` B; times_one: T(1, d) (for
    B = 1 the same: time(d) = T(1, d) * r / E_1(d), the request's own tokens per second);
    remaining, scales: r_i > 0 and rho_i per request; scale_sds: sigma_i per request (None:
    every scale taken as exact). m_i' is a central difference of SLOPE_STEP.

    >>> t = finish_step_times([6.0, 10.0], [5.0, 7.0], 2, [0.8], [10, 10], [1.0, 0.5])
    >>> [round(x, 2) for x in t]  # time(d) = 60, 68.9 ms; E = 1, 1.8; 20 tokens
    [3.0, 6.2]
    """
    total = sum(remaining)
    spread = expected_max_normal(batch_size)
    # Requests grouped by their scale (to 1 / SCALE_STEPS): per group the tokens left in
    # all (the sum term) and the most (its slowest request), so a step costs O(B + groups
    # * k) and not O(B * k) (1.4 ms at B = 256 per request, about 0.1 ms grouped).
    groups: dict[tuple[float, float], list[int]] = {}
    for r, rho, sd in zip(remaining, scales, scale_sds or [0.0] * len(scales)):
        group = groups.setdefault((round(rho * SCALE_STEPS) / SCALE_STEPS,
                                   round(sd * SCALE_STEPS) / SCALE_STEPS), [0, 0])
        group[0] += r
        group[1] = max(group[1], r)
    k = len(times_full) - 1
    # Per group and d: its requests' steps (the sum term), and its slowest request's steps
    # with its spread and without; then per d the sum and the maxima over the groups.
    shares, lags, lag_means = [], [], []
    for (rho, sd), (left, most) in groups.items():
        means, variances, slopes = _group_moments(rates, k, rho, sd)
        shares.append([left / mean for mean in means])
        lags.append([most / mean + spread * math.sqrt(
            most * var / mean ** 3 + (most * slope / mean ** 2) ** 2)
            for mean, var, slope in zip(means, variances, slopes)])
        lag_means.append([most / mean for mean in means])
    out, before, mean_before = [], math.inf, math.inf
    expected = expected_all(rates, k + 1)  # E(0..k)
    for full, one, steps, slowest, slowest_mean, tokens in zip(
            times_full, times_one, map(sum, zip(*shares)), map(max, zip(*lags)),
            map(max, zip(*lag_means)), expected):
        per_request = max(full - one, 0.0) / (batch_size - 1) if batch_size > 1 else 0.0
        fixed = max(one - per_request, 0.0)
        # One more draft never makes a request slower (on the same acceptance draws it
        # accepts at least as many tokens per step), so never the slowest; the normal spread
        # may say otherwise where drafts are seldom accepted and few tokens are left (the
        # steps' distribution is far from normal there). Where it does, the slowest gains
        # TIE_SHARE of what its mean gains: the tie goes to the larger d.
        slowest = min(slowest, before - TIE_SHARE * (mean_before - slowest_mean))
        before, mean_before = slowest, slowest_mean
        time = fixed * slowest + per_request * steps
        out.append(time * tokens / total)
    return out


def _group_moments(rates: list[float], k: int, rho: float, sd: float
                   ) -> tuple[list[float], list[float], list[float]]:
    """(means, variances, slopes) per d = 0..k for requests of scale ``rho`` with scale error
    ``sd``: ``tokens_per_step`` at rates ``min(rho * alpha, 1)``, and sd times dm / drho by a
    central difference of SLOPE_STEP (all 0 when sd is 0), in one pass over the rates for
    rho and rho +- SLOPE_STEP (the outlook runs this for every request group at every fresh
    decision: 0.1 ms a call in the engine at bs 8 with three passes, docs/draft-policy.md,
    eleventh session).

    >>> _group_moments([0.5, 0.5], 2, 1.0, 0.0)
    ([1.0, 1.5, 1.75], [0.0, 0.25, 0.6875], [0.0, 0.0, 0.0])
    >>> [round(x, 3) for x in _group_moments([0.5, 0.5], 2, 1.0, 0.1)[2]]  # 0.1 * (0.5, 1.0)
    [0.0, 0.05, 0.1]
    """
    survive, first, second = 1.0, 0.0, 0.0
    means, variances, slopes = [1.0], [0.0], [0.0]
    high, low, width = rho + SLOPE_STEP, max(rho - SLOPE_STEP, 0.0), 2 * SLOPE_STEP
    up_survive, up_first, down_survive, down_first = 1.0, 0.0, 1.0, 0.0
    for j, alpha in enumerate(rates[:k], start=1):
        rate = rho * alpha  # min / max spelled out below: this loop runs per request group
        survive *= 1.0 if 1.0 < rate else rate  # at every fresh decision (the same results)
        first += survive
        second += (2 * j - 1) * survive
        means.append(1.0 + first)
        spread = second - first * first
        variances.append(0.0 if 0.0 > spread else spread)  # max(spread, 0.0)
        if sd > 0.0:
            rate = high * alpha
            up_survive *= 1.0 if 1.0 < rate else rate
            up_first += up_survive
            rate = low * alpha
            down_survive *= 1.0 if 1.0 < rate else rate
            down_first += down_survive
            slopes.append(((1.0 + up_first) - (1.0 + down_first)) / width * sd)
        else:
            slopes.append(0.0)
    return means, variances, slopes


def outlook_step_times(per_step: list[float], one: list[float], batch_size: int,
                       rates: list[float], outlook: BatchOutlook,
                       acceptance: RequestAcceptance, pooled_rate: float,
                       verified: int) -> tuple[list[float], int]:
    """(T'(0..k) to decide on, the fewest drafts the decision may make) for ``outlook``'s
    batch (``finish_step_times`` on each request's tokens left after this step, which
    verifies ``verified`` drafts per request; per_step, one: T(B, d) and T(1, d)).

    Each scale's standard error (a request not seen yet: the spread of requests' scales the
    shrinkage assumes) widens the slowest request's spread, but not on the hopeful scales
    that decide stopping: d = 0 has no spread, so the error would favour it. d = 0 is
    allowed only when it wins on scales STOP_OPTIMISM standard errors higher too (the module
    docstring: d = 0 verifies nothing, so the scales it was chosen on would never be
    corrected); otherwise fewest is 1 where the outlook alone would stop.
    """
    keys = outlook.keys
    scales, scale_sds = acceptance.scales_and_sds(keys, pooled_rate)
    remaining = left_after_this_step(outlook.remaining, scales, rates, verified)
    times = finish_step_times(per_step, one, batch_size, rates, remaining, scales, scale_sds)
    fewest = 0
    if best_num_drafts(per_step, rates) > 0 and best_num_drafts(times, rates) == 0:
        hopeful = finish_step_times(per_step, one, batch_size, rates, remaining,
                                    [acceptance.scale(key, pooled_rate, STOP_OPTIMISM)
                                     for key in keys])
        if best_num_drafts(hopeful, rates) > 0:
            fewest = 1
    return times, fewest


def left_after_this_step(remaining, scales: list[float], rates: list[float],
                         verified: int) -> list[float]:
    """Per request, the tokens it is expected to have left once this step's are counted
    (this step verifies ``verified`` drafts per request, and its tokens are not yet on the
    host when the next step's drafts are decided): r_i - m_i(verified) at its own scale,
    at least 1.

    >>> left_after_this_step((10, 3), [1.0, 0.5], [0.8, 0.8], 2)  # m = 2.44 and 1.56
    [7.56, 1.44]
    """
    means: dict[float, float] = {}
    out = []
    for r, rho in zip(remaining, scales):
        m = means.get(rho)
        if m is None:
            m = means[rho] = expected_tokens([min(rho * a, 1.0) for a in rates], verified)
        out.append(max(r - m, 1.0))
    return out


def useful_drafts(outlook: BatchOutlook) -> int:
    """The most drafts per request that can still yield a token: this step samples at least
    one token of each request, and the next step, which verifies the drafts made now, at
    most its drafts + 1, so a request with r tokens left (before this step's) has use for
    r - 2. Drafts past that cost their step time for nothing (a lone request decided per
    step drafted k on its last step: 1 of about 20 steps per 64-token request on the
    built-in pair).

    >>> useful_drafts(BatchOutlook(("a", "b"), (3, 9))), useful_drafts(BatchOutlook(("a",), (1,)))
    (7, 0)
    """
    return max(max(outlook.remaining) - 2, 0)


def tokens_per_step(rates: list[float], max_drafts: int) -> tuple[list[float], list[float]]:
    """Per d = 0..max_drafts, the (means, variances) of the tokens one request makes per
    step verifying d drafts accepted with conditional ``rates``: 1 + A with P(A >= j) =
    rates[0] * ... * rates[j - 1], so E A = sum_{j<=d} P(A >= j) and E A^2 =
    sum_{j<=d} (2j - 1) P(A >= j).

    The outlook computes them with its slopes in one pass (``_group_moments``, of which
    this is the scale-1 case).

    >>> tokens_per_step([0.5, 0.5], 2)  # d = 2: A = 0, 1, 2 with 1/2, 1/4, 1/4
    ([1.0, 1.5, 1.75], [0.0, 0.25, 0.6875])
    """
    means, variances, _ = _group_moments(rates, max_drafts, 1.0, 0.0)
    return means, variances


@functools.lru_cache(maxsize=256)
def expected_max_normal(count: int) -> float:
    """About E max of ``count`` standard normals (Blom's approximation): how far the slowest
    of ``count`` requests lags the mean in standard deviations.

    >>> [round(expected_max_normal(n), 2) for n in (1, 2, 8, 64)]  # exact: 0, .56, 1.42, 2.41
    [0.0, 0.59, 1.43, 2.34]
    """
    return NormalDist().inv_cdf((count - 0.375) / (count + 0.25))
