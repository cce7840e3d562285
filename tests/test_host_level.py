"""Samples re-levelled to the host's speed now (rocdraft/spec_decode/host_level.py), alone and
through RealizedStepTimes: a count drafted only in a slow spell is priced at what it runs
once the spell is over."""
from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, strategies as st

from rocdraft.spec_decode.cost_model import StepCosts
from rocdraft.spec_decode.host_level import RecentCounts, Sample, leveled, reference
from rocdraft.spec_decode.realized_times import RealizedStepTimes

K = 4
PRIOR = StepCosts(0.010, 0.0005, 0.0005, 0.0002, 0.0012)


def test_the_modules_examples():
    import doctest

    from rocdraft.spec_decode import host_level

    assert doctest.testmod(host_level).failed == 0


def test_the_main_count_is_the_most_drafted_of_the_window():
    recent = RecentCounts(window=3)
    for count in [1, 1, 1, 4, 4]:
        recent.add(count)
    assert recent.main() == 4  # the 1s have left the window: [1, 4, 4]
    recent.add(2)
    recent.add(2)
    assert recent.main() == 2  # [4, 2, 2]
    assert sum(recent.tally.values()) == 3


def test_reference_needs_two_samples_of_the_main_count():
    one = {4: deque([Sample(0.01)])}
    assert reference(one, 4) == (None, 0.0)
    assert reference(one, None) == (None, 0.0)
    two = {4: deque([Sample(0.01), Sample(0.03), Sample(0.02)])}
    assert reference(two, 4) == (4, pytest.approx(0.015))  # the slowest dropped


@given(st.floats(0.5, 3.0), st.lists(st.floats(0.001, 0.1), min_size=1, max_size=8))
def test_a_host_twice_as_slow_prices_every_other_count_twice_as_dear(speed, seconds):
    """Scaling the main count's level by ``speed`` scales every referenced sample of another
    count by it, and leaves the main count's own and unreferenced ones as they are."""
    kept = {3: [Sample(s, 4, 0.01) for s in seconds], 2: [Sample(s) for s in seconds],
            1: [Sample(s, 0, 0.01) for s in seconds], 4: [Sample(0.01), Sample(0.01)]}
    same = leveled(kept, 4, 0.01)
    slow = leveled(kept, 4, 0.01 * speed)
    assert same[3] == pytest.approx(seconds)  # the level has not moved: as taken
    assert slow[3] == pytest.approx([s * speed for s in seconds])
    assert slow[2] == slow[1] == same[2] == pytest.approx(seconds)  # no reference to 4
    assert slow[4] == [0.01, 0.01]
    assert leveled(kept, 4, 0.0) == same | {3: [s for s in seconds]}  # no level: as taken


def test_a_count_probed_in_a_slow_spell_is_priced_at_the_hosts_speed_after_it():
    """Count 4 runs every step; count 3 is probed twice, both times while the host runs
    1.6x slow (a spell of 10 steps). After the spell the estimate of T(3) is what 3 runs
    at the host's speed then, not the spell's; without the level it kept the spell's
    samples until the next probe (1.6x: d = 3 looked dearer than d = 4)."""
    def true(v, d):  # the machine: verify 4 ms + 1 ms per draft verified, draft 1 ms each
        return 0.004 + 0.001 * v, 0.001 * d

    times = RealizedStepTimes(K, sweep=False)
    previous = 4
    plan = [4] * 20 + [4, 3, 4, 4, 3, 4] + [4] * 30  # the probes at steps 21 and 24
    for step, d in enumerate(plan):
        slow = 1.6 if 18 <= step < 28 else 1.0
        verify, draft = true(previous, d)
        times.record(1, previous, d, verify * slow, draft * slow, PRIOR)
        previous = d
    estimate = times.step_times(1, PRIOR, K)
    assert estimate[4] == pytest.approx(sum(true(4, 4)))
    # the references were taken early in the spell (the main count's mean then still
    # partly fast), so T(3) reads within 25% of its true 0.010, where as taken it read 1.6x
    assert estimate[3] == pytest.approx(sum(true(3, 3)), rel=0.25)
    assert estimate[3] < estimate[4]
    as_taken = sum(s.seconds for s in times.buckets[1].verify[3]) / 2 \
        + sum(s.seconds for s in times.buckets[1].draft[3]) / 2
    assert as_taken == pytest.approx(1.6 * sum(true(3, 3)))
    assert as_taken > estimate[4]  # what the policy read before the level: 3 dearer than 4
