"""A guard on the cost policy from realized throughput: speculation is vetoed in a batch
bucket while the speculative steps measured there emit fewer tokens per second than plain
decoding steps measured there.

Why: the cost policy (rocdraft/spec_decode/cost_model.py) decides from step costs fitted on dummy inputs
at start-up and a linear cost model. What it leaves out (prompt lengths unlike the dummy
context, kernels whose speed jumps with the row count, the speculative step's own host
work, a machine busier than at start-up) can make speculation lose where the model says it
wins: measured on the built-in pair at batch 8 on a 2-core CPU, the model expected 1.6x and
the engine got 0.94-0.96x. The issue's rule is that speculation must never be slower than
target-only by more than noise; the guard enforces it with the engine's own clock.

Samples, per batch bucket (``batch_bucket``), exponentially averaged (weight ``SAMPLE_WEIGHT``
for the newest): tokens emitted per second of whole steps (schedule to bookkeeping) of one
pure mode, without prompt tokens in the batch: a plain step (verified no draft and drafted
none) or a speculative step (verified drafts and drafted again). Steps that switch modes are
not samples.

Decision (``decide``), per policy step of a bucket, numbered i = 0, 1, ...:
- i % PLAIN_EVERY in PLAIN_PROBE: plain decoding (d = 0), so the plain rate is known and
  stays current (2 steps in 64: the head's cache then misses those tokens, which costs
  acceptance for a few steps, never correctness);
- vetoed (both rates known and speculative < plain): plain decoding, except when i %
  EXPLORE_EVERY < SPEC_PROBE_STEPS, which speculate to re-measure speculation;
- else the cost policy's choice.

Example: bucket 8, plain 600 tok/s, speculative 560 tok/s -> vetoed: steps 16-18, 32-34, ...
speculate, the rest decode plainly, until a speculative sample lifts its average above 600.
Greedy outputs never depend on it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rocdraft.spec_decode.cost_model import EXPLORE_EVERY, batch_bucket

SAMPLE_WEIGHT = 0.2
PLAIN_EVERY = 64
PLAIN_PROBE = (4, 5)  # policy steps (mod PLAIN_EVERY) that decode plainly: one pure sample
SPEC_PROBE_STEPS = 3  # consecutive speculative steps of an exploration: one pure sample


@dataclass
class _Bucket:
    steps: int = 0  # policy decisions taken in this bucket
    rates: dict = field(default_factory=dict)  # "plain" / "spec" -> tokens per second


class ThroughputGuard:
    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}

    def _bucket(self, batch_size: int) -> _Bucket:
        return self.buckets.setdefault(batch_bucket(batch_size), _Bucket())

    def vetoed(self, batch_size: int) -> bool:
        """Speculation measured slower than plain decoding in this batch's bucket."""
        rates = self._bucket(batch_size).rates
        return "plain" in rates and "spec" in rates and rates["spec"] < rates["plain"]

    def decide(self, batch_size: int, policy_choice: int, max_drafts: int) -> int:
        """The drafts per request for this step given the cost policy's ``policy_choice``
        (the module docstring's rule)."""
        bucket = self._bucket(batch_size)
        i = bucket.steps
        bucket.steps += 1
        if i % PLAIN_EVERY in PLAIN_PROBE:
            return 0
        if self.vetoed(batch_size):
            return max(policy_choice, 1) if i % EXPLORE_EVERY < SPEC_PROBE_STEPS \
                and max_drafts > 0 else 0
        return policy_choice

    def record(self, batch_size: int, mode: str, num_tokens: int, seconds: float) -> None:
        """One pure step of ``mode`` ("plain" | "spec") that emitted ``num_tokens``."""
        if mode not in ("plain", "spec"):
            raise ValueError(f"mode must be 'plain' or 'spec', got {mode!r}")
        average_rate(self._bucket(batch_size).rates, mode, num_tokens, seconds)


def average_rate(rates: dict, key: str, num_tokens: int, seconds: float,
                 weight: float = SAMPLE_WEIGHT) -> None:
    """Fold one step's ``num_tokens / seconds`` into ``rates[key]``: the sample itself when
    it is the first, else the exponential average with ``weight`` for the newest. A step that
    emitted nothing or took no time is no sample."""
    if seconds <= 0 or num_tokens <= 0:
        return
    rate = num_tokens / seconds
    rates[key] = rate if key not in rates else (1 - weight) * rates[key] + weight * rate
