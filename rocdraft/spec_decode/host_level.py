"""Realized step-time samples re-levelled to the host's speed now: a count the policy rarely
drafts is priced by its own samples times how much the count it drafts most has slowed or
sped up since they were taken (rocdraft/spec_decode/realized_times.py keeps the samples).

Why: the host's speed moves by 20-50% for seconds at a time (other processes, a shared VM).
The count the policy drafts is re-measured every step and follows; a count it rarely drafts
keeps the samples of the last time it was drafted. Measured on the built-in pair at bs 1
(1 thread, 8 prompts, cost policy, k = 4): the kept verify samples of v = 2 and 3 read
[4.6, 4.5, 4.9, 7.6, 7.2, 6.9, 6.3, 4.6] ms and [4.7, 5.1, 6.1, 7.4, 7.5, 6.5, 5.3, 4.9]
ms, drafted in a slow spell, where those steps ran 4.2-4.3 ms in the fixed engines beside
it; so T(3) read 9.2 ms where it ran 7.0 and T(4) 8.4, and the policy drafted 4 where
fixed 3 was 2.5% faster. Too high an estimate is corrected only by the count's next probe
(tens to hundreds of steps away), and that probe may fall in a slow spell again.

The rule. Each sample is kept with its reference: the count drafted most in the bucket's
last ``WINDOW`` steps then (the main count) and the robust mean of that count's kept
samples then. A sample of another count than the main count now is scaled by the main
count's robust mean now over its reference mean, when the reference is the same count
(both means are of one count's samples, so the ratio is the host's speed change alone, with
no error of the prior's shape between counts). The main count's own samples are its
recent ones and are not scaled. A reference to another count (the main count changed since)
leaves the sample as it was. No level is carried from step to step, so none drifts: a
level that follows each step's time against the estimates (tried first) random-walks with
the steps' noise, and the counts it does not re-measure drift with it (the simulation tests
ran at 0.94-0.95x of the best fixed count with 15% noise per step and a steady host).

Worked example: the main count 4 had a robust mean of 8 ms when count 3 was probed at
9 ms; the host has slowed since and count 4 now runs 10 ms: the probe counts as
9 x 10 / 8 = 11.25 ms.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import NamedTuple

WINDOW = 16  # steps of a bucket whose most drafted count is the main count


class Sample(NamedTuple):
    seconds: float
    reference: int | None = None  # the main count when taken (None: none had 2 samples)
    reference_mean: float = 0.0  # the robust mean of its kept samples then


class RecentCounts:
    """The counts of a bucket's last WINDOW steps, tallied as they come (``main`` runs
    every step: no recount).

    >>> recent = RecentCounts()
    >>> recent.main() is None
    True
    >>> for count in [4, 4, 3, 4, 1]:
    ...     recent.add(count)
    >>> recent.main()
    4
    """

    def __init__(self, window: int = WINDOW) -> None:
        self.counts: deque = deque()
        self.window = window
        self.tally: Counter = Counter()

    def add(self, count: int) -> None:
        self.counts.append(count)
        self.tally[count] += 1
        if len(self.counts) > self.window:
            self.tally[self.counts.popleft()] -= 1

    def main(self) -> int | None:
        """The count drafted most, the most recent of those tied; None before any.

        >>> recent = RecentCounts(4)
        >>> for count in [1, 4, 3, 3, 4]:  # 1 has left the window: 4 and 3 twice, 4 last
        ...     recent.add(count)
        >>> recent.main()
        4
        """
        if not self.counts:
            return None
        most = max(self.tally.values())
        return next(count for count in reversed(self.counts) if self.tally[count] == most)


def reference(samples: dict, main: int | None) -> tuple[int | None, float]:
    """(main count, the robust mean of its kept samples): the level now, and a new
    sample's reference; (None, 0) when it has fewer than 2 (one sample is no level)."""
    kept = samples.get(main, ()) if main is not None else ()
    if len(kept) < 2:
        return None, 0.0
    return main, robust_mean([s.seconds for s in kept])


def leveled(samples: dict, main: int | None, main_mean: float) -> dict[int, list[float]]:
    """Per count, its kept samples' seconds at the host's speed now: a count other than
    ``main`` has each sample whose reference is ``main`` scaled by main_mean / its reference
    mean (``main_mean``: ``reference(samples, main)``'s mean now; 0: none, nothing scaled).

    >>> kept = {4: [Sample(10.0), Sample(10.0)], 3: [Sample(9.0, 4, 8.0), Sample(6.0, 1, 5.0)]}
    >>> leveled(kept, 4, 10.0)
    {4: [10.0, 10.0], 3: [11.25, 6.0]}
    """
    out = {}
    for count, kept in samples.items():
        if count == main or main_mean <= 0:
            out[count] = [s.seconds for s in kept]
        else:
            out[count] = [s.seconds * main_mean / s.reference_mean
                          if s.reference == main and s.reference_mean > 0 else s.seconds
                          for s in kept]
    return out


def robust_mean(samples) -> float:
    """The mean without the slowest sample once there are 2 (a step slowed by something
    else, a garbage collection or another process, is one-sided noise; so is the first step
    of a new shape: oneDNN makes its kernels for a new row count on first use, measured
    0.3-0.4 ms per weight shape on the built-in pair, 1-2 ms per step, and the sweep's first
    sample of each count is such a step).

    >>> robust_mean([2.0, 9.0, 4.0]), robust_mean([2.0, 4.0]), robust_mean([5.0])
    (3.0, 2.0, 5.0)
    """
    values = sorted(samples)
    if len(values) >= 2:
        values.pop()
    return sum(values) / len(values)
