"""Tree or chain: with a tree config under the cost policy, each batch bucket drafts the shape
that measured more tokens per second there, the configured tree or a chain.

Why: a tree verifies more tokens per request than a chain (16 or 25 against 5) and drafts a
frontier of top_k nodes per level. Where the target forward is cheap per extra token (a GPU
at small batches) the tree's longer acceptance wins; where verification cost grows with the
tokens (a CPU, larger batches) the chain wins. Measured on the built-in pair at batch 8 on a
CPU core: chain 1.08x target-only, dynamic tree 0.85x, static tree 0.68x; on an H200 in bf16
the trees won at batch 1 and 8. The dynamic tree's node budget (rocdraft/tree_budget.py)
cuts trees from a cost model fitted on dummy inputs, which misjudged full trees both ways;
this chooser decides from the engine's own clock instead, so a tree config is never slower
than the chain by more than its probes.

The chain is drafted by the chain drafter (``EagleProposer.propose``, k =
min(num_speculative_tokens, tree depth)) and verified as a one-child-per-level tree (parents
-1, 0, 1, ...), so the tree's verification, sampling and KV compaction run unchanged: the
tree sampler on a chain is standard speculative sampling with deterministic drafts, so the
output distribution is the target's either way (rocdraft/tree_sampler.py says why).

Samples, per batch bucket (``batch_bucket``), exponentially averaged (``SAMPLE_WEIGHT`` for
the newest): tokens emitted per second of whole steps without prompt tokens that verified
drafts of one shape and drafted that shape again. A step that switches shape is no sample.

Decision (``decide``), per step of a bucket numbered i = 0, 1, ...:
- until both shapes have a rate: the shape of i // PROBE_STEPS (even: tree, odd: chain),
  i.e. runs of PROBE_STEPS steps, which hold PROBE_STEPS - 1 pure samples each;
- then the faster shape, except the last PROBE_STEPS steps of every EXPLORE_EVERY, which
  draft the other one so that its rate stays current.

Example: bucket 8, tree 540 tok/s, chain 690 tok/s -> steps 29-31, 61-63, ... draft trees,
the rest chains. Greedy outputs never depend on it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rocdraft.draft_policy import batch_bucket
from rocdraft.throughput_guard import average_rate

SHAPES = ("tree", "chain")
SAMPLE_WEIGHT = 0.2
PROBE_STEPS = 3  # a run of one shape: PROBE_STEPS - 1 pure samples
EXPLORE_EVERY = 32  # steps between probes of the slower shape


@dataclass
class _Bucket:
    steps: int = 0  # decisions taken in this bucket
    rates: dict = field(default_factory=dict)  # shape -> tokens per second


class DraftShapeChooser:
    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}

    def _bucket(self, batch_size: int) -> _Bucket:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return self.buckets.setdefault(batch_bucket(batch_size), _Bucket())

    def faster(self, batch_size: int) -> str | None:
        """The shape measured faster in this batch's bucket, None before both were measured."""
        rates = self._bucket(batch_size).rates
        if len(rates) < len(SHAPES):
            return None
        return "chain" if rates["chain"] > rates["tree"] else "tree"

    def decide(self, batch_size: int) -> str:
        """The shape to draft now for a batch of ``batch_size`` (the module docstring's rule)."""
        bucket = self._bucket(batch_size)
        i = bucket.steps
        bucket.steps += 1
        best = self.faster(batch_size)
        if best is None:
            return SHAPES[(i // PROBE_STEPS) % 2]
        if i % EXPLORE_EVERY >= EXPLORE_EVERY - PROBE_STEPS:
            return SHAPES[1 - SHAPES.index(best)]
        return best

    def record(self, batch_size: int, shape: str, num_tokens: int, seconds: float) -> None:
        """One pure step of ``shape`` that emitted ``num_tokens`` in ``seconds``."""
        if shape not in SHAPES:
            raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
        average_rate(self._bucket(batch_size).rates, shape, num_tokens, seconds, SAMPLE_WEIGHT)
