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

Samples, per batch bucket (``batch_bucket``): tokens emitted per second of whole steps
without prompt tokens that verified drafts of one shape and drafted that shape again (a step
that switches shape is no sample). A shape's rate is the median of its last ``SAMPLES``:
one-time costs (a Triton kernel compiled for a new query shape, a graph captured, caches
warming) make single steps hundreds of times slower, and an average of such a sample kept a
faster shape from being chosen for dozens of steps in a first H200 run.

Where it runs: only where the draft loop runs eagerly (the CPU, ``enforce_eager``). On a GPU
the tree's levels are captured in graphs while the chain drafted in tree mode would run
eagerly, and on the H200 the trees beat the chain at batch 1 and 8 without a chooser.

Decision (``decide``), per step of a bucket numbered i = 0, 1, ...:
- until both shapes have a rate: the shape of i // PROBE_STEPS (even: tree, odd: chain),
  i.e. runs of PROBE_STEPS steps, which hold PROBE_STEPS - 1 pure samples each;
- then the faster shape, except the last PROBE_STEPS steps of every EXPLORE_EVERY, which
  draft the other one so that its rate stays current.

Example: bucket 8, tree 540 tok/s, chain 690 tok/s -> steps 29-31, 61-63, ... draft trees,
the rest chains. Greedy outputs never depend on it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

from rocdraft.draft_policy import batch_bucket

SHAPES = ("tree", "chain")
SAMPLES = 5  # a shape's rate: the median of its last SAMPLES pure steps
PROBE_STEPS = 3  # a run of one shape: PROBE_STEPS - 1 pure samples
EXPLORE_EVERY = 32  # steps between probes of the slower shape


@dataclass
class _Bucket:
    steps: int = 0  # decisions taken in this bucket
    samples: dict = field(default_factory=dict)  # shape -> deque of tokens per second

    @property
    def rates(self) -> dict:
        """shape -> the median of its recent samples (tokens per second)."""
        return {shape: median(found) for shape, found in self.samples.items()}


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
        samples = self._bucket(batch_size).samples
        if seconds <= 0 or num_tokens <= 0:
            return
        samples.setdefault(shape, deque(maxlen=SAMPLES)).append(num_tokens / seconds)
