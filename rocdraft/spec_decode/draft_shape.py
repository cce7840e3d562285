"""Tree or chain: with a tree config under the cost policy, each batch bucket drafts the shape
that measured more tokens per second there, the configured tree or a chain.

Why: a tree verifies more tokens per request than a chain (16 or 25 against 5) and drafts a
frontier of top_k nodes per level. Where the target forward is cheap per extra token (a GPU
at small batches) the tree's longer acceptance wins; where verification cost grows with the
tokens (a CPU, larger batches) the chain wins. Measured on the built-in pair at batch 8 on a
CPU core: chain 1.08x target-only, dynamic tree 0.85x, static tree 0.68x; on an H200 in bf16
the trees won at batch 1 and 8. The dynamic tree's node budget (rocdraft/spec_decode/tree_budget.py)
cuts trees from a cost model fitted on dummy inputs, which misjudged full trees both ways;
this chooser decides from the engine's own clock instead, so a tree config is never slower
than the chain by more than its probes.

The chain is drafted by the chain drafter (``EagleProposer.propose``: 1 to
min(num_speculative_tokens, tree depth) drafts) and verified next step exactly as in chain
mode (causal verification, the rejection sampler, no KV compaction), so a chain step in tree
mode costs what a chain config's step costs (the same aten ops per step at the same count);
both samplers are lossless, so the output distribution is the target's either way. Its
length is decided as a chain config's cost policy decides (rocdraft/spec_decode/
realized_times.py: a sweep, then the best count on the realized times of this config's own
chain steps, the start-up costs only their prior; at least 1 draft, since the drafter of a
tree config always runs). Before, the start-up costs alone decided it, fitted on dummy
inputs (the fit misjudged both ways, which is why chain configs moved to realized times):
on the built-in pair at batch 8 with the draft loop replayed through its graph buffers
(graph_mode "replay-eagerly", the GPU's path, on a CPU core) the static tree config drafted
chains of 1 on 32-33 of its 34-35 chain steps in each of three runs, acceptance length
1.85-1.88 against the chain config's 2.31-2.81; where a step costs about the same at any
count (a GPU's captured loop) that is 0.67-0.81x the chain's speed, as on the H200 (1.07x
against 1.59x, 97% chain steps; not re-measured on a GPU since). A request
whose chain sits in a batch beside another's tree (a step that did not schedule it) is
verified as a one-child-per-level tree (``build_step_batch``).

Estimate, per batch bucket (``batch_bucket``). Samples are whole steps without prompt
tokens that verified drafts of one shape and drafted that shape again (a step that switches
shape is no sample). Acceptance depends on the text far more than on the shape (one held-out
prompt accepts 5.9 tokens per tree step, another 3), so rates of steps taken at different
times compare texts, not shapes: measured that way the chooser kept the tree at batch 1
where the chain was 1.3x faster. So tokens are compared on the same steps: a verified tree
also says what the chain would have produced there, because the chain drafts the head's
argmax at every depth, which is the tree's rank-0 child (``chain_on_path``: 1 + the
accepted path's leading rank-0 nodes, at most the chain's length, the one its policy would
pick now; where the tree ran out of rank-0 nodes, a leaf or a budget-cut tree, the chain's
expected further tokens from its acceptance rates: counting only what the tree showed made
budget-cut dynamic trees look better than the chain at bs 8, which then drafted them on 46%
of its steps at 0.94x target-only; ``chain_on_tree_step`` also feeds the chain's acceptance
estimate from every tree step, so the chain's length stays current while trees win). Then
- gain = sum of the tree's tokens / sum of the chain's tokens on its last ``TOKEN_SAMPLES``
  tree steps (tokens counted before a stop or max_tokens cut them);
- each shape's step time is the median of its last ``TIME_SAMPLES`` steps, the smaller
  while it has only two: one-time costs (a Triton kernel compiled for a new query shape, a
  graph captured) make single steps hundreds of times slower; a mean of such a time kept the
  faster shape from being chosen for dozens of steps in a first H200 run, and a median of
  two is their mean (on an H200 a static tree config then drafted trees on a third of its
  batch-8 steps, at 1.46x target-only where the chain gave 2.22x);
- the tree is faster when gain > tree time / chain time. ``rates`` reports both as tokens
  per second on the tree steps' text.

Where it runs: every tree config under the cost policy without given costs. On a GPU the
engine captures the tree levels and, for a tree at least k deep, the chain's k-draft loop
(shorter chains run eagerly), so each shape is measured at the speed it drafts at.

Decision (``decide``), per step of a bucket numbered i = 0, 1, ...:
- until both shapes have MIN_TIME_SAMPLES step times and the tree has tokens: the shape the
  nearest measured buckets below and above both found faster (``bracketed``; probes of the
  other every EXPLORE_EVERY steps, which measure this bucket), else the shape of
  i // PROBE_STEPS (even: tree, odd: chain), i.e. runs of PROBE_STEPS steps, which hold
  PROBE_STEPS - 1 pure samples each (one run per shape). A batch of 8 shrinks through
  buckets 4, 2 and 1 as its requests finish: each of those tails is a few steps, so
  exploring there drafted trees on most tail steps (3 of the last 6 steps of a batch-8 run of
  the built-in pair, each 2x a chain step) although buckets 1 and 8 had chosen the chain;
- then the faster shape, except runs of PROBE_STEPS steps of the other one that keep its
  figures current, the last PROBE_STEPS steps of every cycle, which starts at the first
  choice; a cycle is PROBE_STEPS x (slower step time / faster step time) x (1 - slower
  rate / faster rate) / PROBE_BUDGET steps (at least EXPLORE_EVERY, at most MAX_CYCLE): a
  probe run lasts PROBE_STEPS x the time ratio faster steps and loses that share of their
  tokens, so the probes cost PROBE_BUDGET of the faster shape's throughput. At batch 8 on a
  CPU core a tree step takes 2.8x a chain step for 1.4x its tokens: probing every 32 steps
  cost about 12% of the chain's speed. With a cycle of 32 x (rate ratio)^2 steps instead (the
  rule until the thirteenth session) a d5/k4/n16 tree config on the built-in pair at batch 1
  (a tree step about 1.8x a chain step's time, the chain 1.2-1.45x the tree's rate) verified
  trees on 6.3% of its steps, about 1.4% of the chain's speed (docs/draft-policy.md,
  thirteenth session).

Example: bucket 8, tree 500 tok/s in 0.08 s steps, chain 600 tok/s in 0.05 s steps, known at
step 0 (cycle round(3 x 1.6 x (1 - 5/6) / 0.005) = 160) -> steps 157-159, 317-319, ...
draft trees, the rest chains. Greedy outputs never depend on it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from rocdraft.spec_decode.cost_model import batch_bucket

SHAPES = ("tree", "chain")
TIME_SAMPLES = 5  # a shape's step time: the median of its last TIME_SAMPLES pure steps
TOKEN_SAMPLES = 16  # the tree's gain: over its last TOKEN_SAMPLES pure steps
MIN_TIME_SAMPLES = 2  # step times per shape before a choice
PROBE_STEPS = 3  # a run of one shape: PROBE_STEPS - 1 pure samples
EXPLORE_EVERY = 32  # steps between probes of the slower shape, at least
MAX_CYCLE = 512  # at most this many steps between probes
PROBE_BUDGET = 0.005  # share of the faster shape's throughput its probes may cost


def rank0_flags(parents: list[int], ranks: tuple[int, ...] | None = None) -> list[bool]:
    """Whether each tree node is its parent's rank-0 (the head's argmax) child -> [N].
    ``ranks``: a static tree's rank of each node (``StaticTree.ranks``); None: a dynamic
    tree, whose BFS order lists a parent's children best first, so its first child is rank 0.

    Example: parents [-1, -1, 0, 0, 1] -> [True, False, True, False, True]."""
    if ranks is not None:
        return [ranks[i] == 0 for i in range(len(parents))]
    seen: set[int] = set()
    flags = []
    for parent in parents:
        flags.append(parent not in seen)
        seen.add(parent)
    return flags


class ChainOnPath(NamedTuple):
    tokens: float  # what the chain would have produced (expected, where the tree ran out)
    verified: int  # chain positions whose outcome the tree shows ...
    accepted: int  # ... and how many of them were accepted


def chain_on_path(path: list[int], parents: list[int], flags: list[bool], chain_len: int,
                  rates: list[float]) -> ChainOnPath:
    """What a chain of ``chain_len`` argmax drafts would have done where a tree with
    ``parents`` (rank-0 ``flags``) was verified and ``path`` (node per depth, -1 after its
    end) accepted. The chain follows the path's leading rank-0 nodes; at the first other
    node, or where the walk stopped although the last node had a rank-0 child, the chain's
    next draft was tried and rejected. Where the walk stopped at a node without a rank-0 child
    in the tree (a leaf, or a tree the batch budget cut), the tree does not say: the chain's
    expected further tokens come from ``rates`` (its acceptance per position, conditional).
    Exact for greedy sampling when the chain's drafts equal the rank-0 children (the same
    head on the same context); the tree walk tries children in rank order, so under random
    sampling the rank-0 child is accepted with the chain's probability too.

    Examples, parents [-1, -1, 0, 0, 1] (flags [T, F, T, F, T]), chain_len 4:
    path [0, 3, -1] -> tokens 2 (node 3 is rank 1: the chain's draft 2 was rejected),
    verified 2, accepted 1; path [0, 2] with rates [.8, .5, .5, .5] -> node 2 is a leaf: 1 +
    2 + (.5 + .25) = 3.75 tokens, verified 2, accepted 2."""
    leading, node = 0, -1
    for child in path:
        if child < 0 or not flags[child] or leading == chain_len:
            break
        leading, node = leading + 1, child
    if leading == chain_len:
        return ChainOnPath(1 + leading, leading, leading)
    diverged = leading < len(path) and path[leading] >= 0  # went on through another child
    if diverged or any(p == node and f for p, f in zip(parents, flags)):
        return ChainOnPath(1 + leading, leading + 1, leading)  # next draft tried, rejected
    expected, survive = 0.0, 1.0
    for position in range(leading, chain_len):
        survive *= rates[position]
        expected += survive
    return ChainOnPath(1 + leading + expected, leading, leading)


class ChainOnTreeStep(NamedTuple):
    tokens: float  # what the chain would have produced, over the requests that sampled
    verified: list[int]  # per tree request that sampled: the chain positions it shows ...
    accepted: list[int]  # ... and how many of them it would have accepted


def chain_on_tree_step(parents: list[list[int]], paths: list[list[int]], samples: list[bool],
                       ranks: tuple[int, ...] | None, chain_len: int, positions: int,
                       rates: list[float]) -> ChainOnTreeStep:
    """``chain_on_path`` over a batch: request i with drafts ``parents[i]`` (empty: it
    verified a chain, whose own tokens count), accepted ``paths[i]``, ``samples[i]`` whether
    it sampled. ``tokens`` counts a chain of ``chain_len`` drafts (the length the chain's
    policy picks now); ``verified`` / ``accepted`` feed the chain's acceptance estimate over
    ``positions`` (min(k, depth)), so it stays current while trees are drafted.

    Example: parents [[-1, -1, 0], []] (a tree; a chain beside it), paths [[0, 2], [0, 1]],
    samples [True, True], ranks None, chain_len 2, positions 3, rates [.5] * 3 -> tokens
    3 + 3 = 6, verified [2], accepted [2] (node 2 is a leaf: position 3 is unknown)."""
    tokens, verified, accepted = 0.0, [], []
    for request_parents, path, sampled in zip(parents, paths, samples):
        if not sampled:
            continue
        if not request_parents:  # a chain beside the trees: what it produced
            tokens += 1 + sum(node >= 0 for node in path)
            continue
        flags = rank0_flags(request_parents, ranks)
        tokens += chain_on_path(path, request_parents, flags, chain_len, rates).tokens
        seen = chain_on_path(path, request_parents, flags, positions, rates)
        if seen.verified:
            verified.append(seen.verified)
            accepted.append(seen.accepted)
    return ChainOnTreeStep(tokens, verified, accepted)


@dataclass
class _Bucket:
    steps: int = 0  # decisions taken in this bucket
    next_probe: int | None = None  # the step that starts the next probe run
    probe_left: int = 0  # steps left in the current probe run
    probe_shape: str = "tree"  # the shape the current probe run drafts
    times: dict = field(default_factory=dict)  # shape -> deque of step seconds
    tokens: deque = field(default_factory=lambda: deque(maxlen=TOKEN_SAMPLES))  # tree steps:
    # (the tree's tokens, the chain's tokens on the same step)
    known_rates: dict | None = None  # ``rates`` since the last sample (None: recompute)

    @property
    def rates(self) -> dict:
        """shape -> tokens per second on the recent tree steps' text (empty until both
        shapes have MIN_TIME_SAMPLES step times and the tree has tokens). Computed once per
        new sample: the engine asks every step (with ``statistics.mean`` over its 16 token
        pairs each time, it took 0.08 ms of a 7 ms step at bs 1 on the built-in pair)."""
        if self.known_rates is None:
            self.known_rates = self._rates()
        return dict(self.known_rates)

    def _rates(self) -> dict:
        if len(self.times) < len(SHAPES) or not self.tokens \
                or min(len(found) for found in self.times.values()) < MIN_TIME_SAMPLES:
            return {}
        tree_tokens = sum(t for t, _ in self.tokens)
        chain_tokens = sum(c for _, c in self.tokens)
        n = len(self.tokens)
        return {"tree": tree_tokens / n / _step_time(self.times["tree"]),
                "chain": chain_tokens / n / _step_time(self.times["chain"])}

    def cycle(self) -> int:
        """Steps from one probe run's start to the next (the module docstring's rule);
        EXPLORE_EVERY while this bucket has no rates of its own (it follows its neighbours)."""
        rates = self.rates
        if not rates:
            return EXPLORE_EVERY
        slower, faster = sorted(SHAPES, key=rates.get)
        return probe_cycle(rates[slower] / rates[faster],
                           _step_time(self.times[slower]) / _step_time(self.times[faster]))


def probe_cycle(slower_share: float, time_ratio: float = 1.0) -> int:
    """Steps from one probe run's start to the next where the slower shape runs at
    ``slower_share`` of the faster one's rate and its steps take ``time_ratio`` times as
    long (the module docstring's rule): a probe run takes PROBE_STEPS x time_ratio faster
    steps' time and makes (1 - slower_share) of their tokens fewer.

    >>> probe_cycle(1.0), probe_cycle(5 / 6, 1.6), probe_cycle(0.5), probe_cycle(0.5, 0.5)
    (32, 160, 300, 150)
    >>> probe_cycle(0.01)
    512
    """
    lost = PROBE_STEPS * time_ratio * (1.0 - slower_share)  # faster steps' tokens lost
    return min(max(round(lost / PROBE_BUDGET), EXPLORE_EVERY), MAX_CYCLE)


def _faster(rates: dict) -> str | None:
    """The faster shape of a bucket's ``rates``, None while they are empty."""
    if not rates:
        return None
    return "chain" if rates["chain"] > rates["tree"] else "tree"


def _step_time(times) -> float:
    """A shape's step time: the median of its recent times, the smaller of only two.

    >>> _step_time([3.0, 1.0, 2.0, 9.0]), _step_time([3.0, 1.0])
    (2.5, 1.0)
    """
    if len(times) <= 2:
        return min(times)
    ordered, half = sorted(times), len(times) // 2
    return ordered[half] if len(times) % 2 else (ordered[half - 1] + ordered[half]) / 2


class DraftShapeChooser:
    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}

    def _bucket(self, batch_size: int) -> _Bucket:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        key = batch_bucket(batch_size)
        bucket = self.buckets.get(key)
        if bucket is None:  # (not setdefault: a _Bucket is built only when new)
            bucket = self.buckets[key] = _Bucket()
        return bucket

    def faster(self, batch_size: int) -> str | None:
        """The shape measured faster in this batch's bucket, None before both were measured."""
        return _faster(self._bucket(batch_size).rates)

    def bracketed(self, batch_size: int) -> str | None:
        """The shape that the nearest measured buckets below and above this batch's both
        measured faster, or None (one side unmeasured, or they disagree). Interpolated only,
        never extrapolated: a tree that wins at batch 1 may lose at batch 8."""
        bucket = batch_bucket(batch_size)
        measured = {b: _faster(found.rates) for b, found in self.buckets.items()}
        below = [b for b, shape in measured.items() if shape and b < bucket]
        above = [b for b, shape in measured.items() if shape and b > bucket]
        if not below or not above:
            return None
        shape = measured[max(below)]
        return shape if shape == measured[min(above)] else None

    def decide(self, batch_size: int) -> str:
        """The shape to draft now for a batch of ``batch_size`` (the module docstring's rule)."""
        bucket = self._bucket(batch_size)
        i = bucket.steps
        bucket.steps += 1
        best = self.faster(batch_size) or self.bracketed(batch_size)
        if best is None:
            return SHAPES[(i // PROBE_STEPS) % 2]
        if bucket.next_probe is None:  # the first choice: a cycle starts
            bucket.next_probe = i + bucket.cycle() - PROBE_STEPS
        if not bucket.probe_left and i >= bucket.next_probe:
            # One shape for the whole run, even if the estimates flip during it.
            bucket.probe_left, bucket.probe_shape = PROBE_STEPS, SHAPES[1 - SHAPES.index(best)]
        if not bucket.probe_left:
            return best
        bucket.probe_left -= 1
        if not bucket.probe_left:  # the run's last step: schedule the next run
            bucket.next_probe = i + 1 + bucket.cycle() - PROBE_STEPS
        return bucket.probe_shape

    def record(self, batch_size: int, shape: str, seconds: float, num_tokens: int = 0,
               chain_tokens: float = 0.0) -> None:
        """One pure step of ``shape`` that took ``seconds``; a tree step also gives the
        tokens it produced and those the chain would have produced on it
        (``chain_on_tree_step``)."""
        if shape not in SHAPES:
            raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
        bucket = self._bucket(batch_size)
        if shape == "tree" and not (num_tokens > 0 and chain_tokens > 0):
            raise ValueError(f"a tree step needs num_tokens > 0 and chain_tokens > 0, got "
                             f"chain_tokens={chain_tokens}, num_tokens={num_tokens}")
        if seconds <= 0:
            return
        bucket.times.setdefault(shape, deque(maxlen=TIME_SAMPLES)).append(seconds)
        if shape == "tree":
            bucket.tokens.append((num_tokens, chain_tokens))
        bucket.known_rates = None
