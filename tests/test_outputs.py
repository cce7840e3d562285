"""GenerationStats: acceptance length and per-position acceptance arithmetic; RequestOutput."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rocdraft.outputs import GenerationStats, RequestOutput


def test_empty_stats():
    stats = GenerationStats(num_speculative_tokens=3)
    assert stats.acceptance_length == 0.0
    assert stats.per_position_acceptance == [0.0, 0.0, 0.0]
    assert stats.accepted_at_position == [0, 0, 0]
    assert stats.proposed_at_position == [0, 0, 0]
    assert stats.num_verify_steps == 0 and stats.num_accepted_drafts == 0


def test_no_speculation():
    stats = GenerationStats()
    assert stats.num_speculative_tokens == 0
    assert stats.per_position_acceptance == []
    assert stats.acceptance_length == 0.0


def test_worked_example():
    stats = GenerationStats(num_speculative_tokens=3)
    stats.record_verification(3, 2)  # drafts 1, 2 accepted, 3 rejected
    stats.record_verification(2, 0)  # only 2 drafts (room ran out), none accepted
    stats.record_verification(3, 3)  # all accepted
    assert stats.num_verify_steps == 3
    assert stats.num_accepted_drafts == 5
    assert stats.proposed_at_position == [3, 3, 2]
    assert stats.accepted_at_position == [2, 2, 1]
    # (accepted drafts + one token per verification) / verifications = (5 + 3) / 3
    assert stats.acceptance_length == pytest.approx(8 / 3)
    assert stats.per_position_acceptance == pytest.approx([2 / 3, 2 / 3, 1 / 2])


def test_all_rejected_means_acceptance_length_one():
    stats = GenerationStats(num_speculative_tokens=2)
    for _ in range(4):
        stats.record_verification(2, 0)
    assert stats.acceptance_length == 1.0
    assert stats.per_position_acceptance == [0.0, 0.0]


def test_all_accepted_means_acceptance_length_k_plus_one():
    stats = GenerationStats(num_speculative_tokens=4)
    for _ in range(5):
        stats.record_verification(4, 4)
    assert stats.acceptance_length == 5.0
    assert stats.per_position_acceptance == [1.0] * 4


def test_instances_do_not_share_counters():
    a, b = GenerationStats(num_speculative_tokens=2), GenerationStats(num_speculative_tokens=2)
    a.record_verification(2, 1)
    a.time_s["draft"] += 1.5
    assert b.accepted_at_position == [0, 0] and b.proposed_at_position == [0, 0]
    assert b.time_s["draft"] == 0.0
    assert set(a.time_s) == {"target_verify", "draft", "sampler", "bookkeeping", "policy"}


@settings(max_examples=100, deadline=None)
@given(k=st.integers(1, 6), data=st.data())
def test_identities(k, data):
    steps = data.draw(st.lists(st.tuples(st.integers(1, k), st.integers(0, k)), max_size=20))
    stats = GenerationStats(num_speculative_tokens=k)
    for num_drafts, accepted in steps:
        stats.record_verification(num_drafts, min(accepted, num_drafts))
    accepted = [min(a, d) for d, a in steps]
    assert stats.num_verify_steps == len(steps)
    assert stats.num_accepted_drafts == sum(accepted)
    assert sum(stats.accepted_at_position) == sum(accepted)
    assert sum(stats.proposed_at_position) == sum(d for d, _ in steps)
    # Acceptance is a prefix: position j is accepted only if j - 1 was.
    for j in range(1, k):
        assert stats.accepted_at_position[j] <= stats.accepted_at_position[j - 1]
        assert stats.proposed_at_position[j] <= stats.proposed_at_position[j - 1]
    assert all(0.0 <= a <= 1.0 for a in stats.per_position_acceptance)
    assert len(stats.per_position_acceptance) == k
    if steps:
        assert 1.0 <= stats.acceptance_length <= k + 1
        assert stats.acceptance_length == pytest.approx(
            1 + sum(stats.accepted_at_position) / len(steps))
    else:
        assert stats.acceptance_length == 0.0


def test_request_output_is_frozen():
    out = RequestOutput([1, 2], [3], "x", "length")
    assert out.error is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.finish_reason = "stop"
