"""How many drafts to verify per request in the next step: the count that maximises expected
tokens per second, from measured step costs and running per-position acceptance rates.

The model. With conditional acceptance rates ``alpha_1 .. alpha_k`` (``alpha_j``: probability
that draft j is accepted given drafts 1..j-1 were), a request that verifies d drafts emits

    E(d) = 1 + sum_{j=1..d} prod_{i<=j} alpha_i          (the 1 is the bonus / corrected token)

tokens per step. For a batch of B requests one step costs (``StepCosts``):

    T(0) = target_fixed + target_per_token * B                    (the drafter is skipped)
    T(d) = target_fixed + head_fixed + (target_per_token + head_per_token) * B * (d + 1)
           + (d - 1) * draft_step                                  for d >= 1

(the head's first forward runs over every target token of the step; each further draft is
one single-token head step). Throughput is B * E(d) / T(d); B is fixed within a step, so the
policy picks ``argmax_d E(d) / T(d)`` over d = 0..k by direct search (k + 1 candidates, no
tensors), ties going to the smaller d. Speculating at all (d >= 1) must beat plain decoding
by ``SPECULATION_MARGIN`` (5%): near the break-even point the costs' noise decides, and
plain decoding is then the safe side. With ``explore`` (the engine sets it every
``EXPLORE_EVERY`` steps) a d >= 1 choice is raised by one so that the next position's
acceptance keeps being observed.

Worked example (k = 4, alpha = 0.8 at every position, B = 1): E = 1, 1.8, 2.44, 2.95, 3.36.
With target_fixed 10 ms, target_per_token 0.5 ms, no head fixed cost, head_per_token
0.1 ms and draft_step 2 ms: T = 10.5, 11.2, 13.8, 16.4, 19.0 ms, so E/T = 0.095, 0.161,
0.177, 0.180, 0.177 tokens/ms: d = 3. With target_per_token 8 ms instead (a large batch on
a matmul-bound device; B = 1 for the arithmetic) T = 18, 26.2, 36.3, 46.4, 56.5 ms and
E/T = 0.056, 0.069, 0.067, 0.064, 0.059: d = 1. With alpha = 0.2 everywhere and those
costs E = 1, 1.2, 1.24, ... and E/T = 0.056, 0.046, ...: d = 0 (plain decoding).

Determinism: the choice is a pure function of (costs, rates, B, k). Measured costs carry
timing noise, so the chosen d may differ between runs on one machine; greedy outputs do not
(every verified token is the target's own), only the speed does. ``SpeculativeConfig
(draft_costs=...)`` fixes the costs (tests, reproducible benchmarks).

A chain config's cost policy decides on realized step times instead, these costs its prior
(rocdraft/spec_decode/realized_times.py); ``choose_num_drafts`` still picks the chains a
tree config drafts.

A d = 0 step skips the drafter, so the head's KV cache misses that step's tokens and later
drafts attend to zeros there. Measured on the built-in pair (k = 4, 8 held-out prompts x 64
tokens, greedy, 1 thread), that costs no acceptance: with 2 of every 6 steps at d = 0 the
acceptance length was 3.297 with the head's first forward run on those steps and 3.299
without; with 16 of every 24, 3.505 and 3.604. Running it cost 0.6 s of draft time in a
5.8 s run, and a useless head at d = 0 would pay it on every step: so it is skipped
(docs/draft-policy.md).
"""
from __future__ import annotations

from dataclasses import dataclass

# Weight of the newest step in the running acceptance estimate (per-step decay 1 - RATE_DECAY),
# and the prior's weight, in observed drafts, that unobserved positions drift back to.
RATE_DECAY = 0.05
PRIOR_WEIGHT = 1.0  # (4 kept a useless head's rate near 0.12: d = 1 looked worth it)
SPECULATION_MARGIN = 1.05
EXPLORE_EVERY = 16


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one step at one batch bucket (the formula in the module docstring)."""

    target_fixed: float
    target_per_token: float
    head_fixed: float
    head_per_token: float
    draft_step: float

    def step_time(self, batch_size: int, num_drafts: int) -> float:
        """T(d): every request verifies d drafts, then the head drafts d per request."""
        return self.time_for_drafts(batch_size, batch_size * num_drafts, num_drafts)

    def time_for_drafts(self, batch_size: int, num_verified: int, num_steps: int) -> float:
        """A step whose batch verifies ``num_verified`` drafts in all (any split over its
        requests) and whose head then runs its first forward and ``num_steps - 1`` further
        draft steps (chain steps, or tree level forwards); ``num_steps`` 0: no drafter."""
        tokens = batch_size + num_verified
        time = self.target_fixed + self.target_per_token * tokens
        if num_steps:
            time += (self.head_fixed + self.head_per_token * tokens
                     + (num_steps - 1) * self.draft_step)
        return time

    @staticmethod
    def from_timings(batch_size: int, num_speculative_tokens: int, target_1: float,
                     target_k: float, head_1: float, head_k: float, draft_k: float,
                     tokens_per_request: int | None = None) -> "StepCosts":
        """Fit from measured seconds at batch ``batch_size``: target forward over 1 and
        ``tokens_per_request`` (default k + 1) tokens per request, head first forward over
        the same, and the k - 1 single-token draft steps (``draft_k``). Negative slopes
        (noise) are clipped to 0; with a single token count (tokens_per_request 1) the
        whole cost counts as per token (the pessimistic side for speculation)."""
        k = num_speculative_tokens
        q = k + 1 if tokens_per_request is None else tokens_per_request
        if q > 1:
            target_per_token = max(target_k - target_1, 0.0) / (batch_size * (q - 1))
            head_per_token = max(head_k - head_1, 0.0) / (batch_size * (q - 1))
        else:
            target_per_token, head_per_token = target_1 / batch_size, head_1 / batch_size
        return StepCosts(
            target_fixed=max(target_1 - target_per_token * batch_size, 0.0),
            target_per_token=target_per_token,
            head_fixed=max(head_1 - head_per_token * batch_size, 0.0),
            head_per_token=head_per_token,
            draft_step=max(draft_k, 0.0) / (k - 1) if k > 1 else 0.0)


def expected_tokens(rates: list[float], num_drafts: int) -> float:
    """E(d): expected tokens emitted by one request verifying ``num_drafts`` drafts."""
    total, survive = 1.0, 1.0
    for alpha in rates[:num_drafts]:
        survive *= alpha
        total += survive
    return total


def choose_num_drafts(costs: StepCosts, rates: list[float], batch_size: int,
                      max_drafts: int, explore: bool = False) -> int:
    """argmax over d in [0, max_drafts] of E(d) / T(d); the smaller d on ties (within 1e-9
    relative); d >= 1 only when it beats d = 0 by SPECULATION_MARGIN; with ``explore`` a
    d >= 1 is raised by one (up to max_drafts). rates: conditional acceptance per position,
    at least max_drafts of them."""
    best, best_rate = 0, 0.0
    for d in range(1, max_drafts + 1):
        rate = expected_tokens(rates, d) / costs.step_time(batch_size, d)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = d, rate
    plain = 1.0 / costs.step_time(batch_size, 0)
    if best_rate <= plain * SPECULATION_MARGIN:
        return 0
    return min(best + 1, max_drafts) if explore else best


class AcceptanceTracker:
    """Running conditional acceptance rate per draft position: decayed counts of (accepted,
    verified given the previous drafts were accepted), shrunk towards ``prior``."""

    def __init__(self, num_positions: int, prior: float) -> None:
        self.prior = prior
        self.accepted = [0.0] * num_positions
        self.verified = [0.0] * num_positions
        self._rates: list[float] | None = None  # ``rates``, until the next update

    def update(self, num_drafts: list[int], num_accepted: list[int]) -> None:
        """One step's verifications: per request, drafts verified and how many were accepted."""
        keep = 1.0 - RATE_DECAY
        self._rates = None
        accepted, verified = self.accepted, self.verified
        for j in range(len(accepted)):
            accepted[j] *= keep
            verified[j] *= keep
        for d, a in zip(num_drafts, num_accepted):
            # Position j (0-based) is verified when d > j and the first j drafts were
            # accepted (j <= a), and accepted when j < a.
            for j in range(min(d, a + 1, len(accepted))):
                verified[j] += 1
                if j < a:
                    accepted[j] += 1

    @property
    def pooled_rate(self) -> float:
        """Accepted over verified drafts, every position pooled (the prior's weight as in
        ``rates``): the share of verified positions accepted."""
        return (sum(self.accepted) + PRIOR_WEIGHT * self.prior) / (sum(self.verified)
                                                                   + PRIOR_WEIGHT)

    @property
    def rates(self) -> list[float]:
        """Per position: (decayed accepted + PRIOR_WEIGHT x prior) / (decayed verified +
        PRIOR_WEIGHT). A new list each time (callers may keep it)."""
        if self._rates is None:
            self._rates = [(a + PRIOR_WEIGHT * self.prior) / (v + PRIOR_WEIGHT)
                           for a, v in zip(self.accepted, self.verified)]
        return list(self._rates)


def batch_bucket(batch_size: int) -> int:
    """The power of two at or above ``batch_size``: costs are measured once per bucket."""
    return 1 << (batch_size - 1).bit_length() if batch_size > 1 else 1
