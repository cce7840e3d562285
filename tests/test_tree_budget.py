"""The cost-based batch budget of dynamic trees (rocdraft/spec_decode/tree_budget.py): the counts of
``accepted_within`` against a naive per-n walk, the running estimate, the docstring's worked
example and the choice's response to cheap and dear verification."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rocdraft.spec_decode.cost_model import StepCosts
from rocdraft.drafter.tree_spec import DynamicTree
from rocdraft.spec_decode.tree_budget import TreeAcceptanceEstimate, accepted_within, choose_nodes_per_request

FAST = settings(max_examples=80, deadline=None)


def naive_accepted_within(scores: list[float], path: list[int]) -> list[int]:
    """Keep the n best nodes (ties by index); walk the path while its nodes are kept."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    counts = []
    for n in range(1, len(scores) + 1):
        kept = set(order[:n])
        walked = 0
        for node in path:
            if node not in kept:
                break
            walked += 1
        counts.append(walked)
    return counts


def test_accepted_within_docstring_example():
    assert accepted_within([-0.1, -0.5, -0.3, -2.0], [0, 2]) == [1, 2, 2, 2]
    assert accepted_within([-0.1, -0.5], []) == [0, 0]  # nothing accepted


@FAST
@given(st.data())
def test_accepted_within_equals_a_naive_walk(data):
    num_nodes = data.draw(st.integers(1, 12))
    scores = data.draw(st.lists(st.sampled_from([-0.1, -0.5, -1.0, -2.0, -3.5]),
                                min_size=num_nodes, max_size=num_nodes))
    path = data.draw(st.lists(st.integers(0, num_nodes - 1), max_size=num_nodes, unique=True))
    counts = accepted_within(scores, path)
    assert counts == naive_accepted_within(scores, path)
    assert counts[-1] == len(path)  # the full tree accepts the whole path
    assert all(a <= b for a, b in zip(counts, counts[1:]))  # more nodes never accept less


def test_estimate_is_a_decayed_mean_of_full_size_trees_only():
    est = TreeAcceptanceEstimate(3)
    assert est.accepted is None
    est.observe([([-0.1, -0.2, -0.3], [0, 1]), ([-0.1, -0.2], [0])])  # 2nd: not full size
    assert est.accepted == [1.0, 2.0, 2.0]
    est.observe([([-0.1, -0.2, -0.3], [])])
    assert est.accepted == pytest.approx([0.95, 1.9, 1.9])
    with pytest.raises(ValueError, match="num_nodes must be >= 1, got 0"):
        TreeAcceptanceEstimate(0)


def test_choice_docstring_worked_example():
    """levels(n) of DynamicTree(4, 1, 5) is n - 1 (a top_k 1 tree is a chain: budget_shape's
    depth is min(4, n)), so T(n) = 5 + 2n ms as in the docstring: n* = 1."""
    costs = StepCosts(target_fixed=5.0, target_per_token=1.0, head_fixed=0.0,
                      head_per_token=0.0, draft_step=1.0)
    tree = DynamicTree(depth=4, top_k=1, total_tokens=5)
    assert choose_nodes_per_request([0.9, 1.4, 1.6, 1.7], costs, 1, tree) == 1
    # A steep A(n) with cheap verification and levels keeps every node ...
    cheap = StepCosts(5.0, 0.01, 0.0, 0.0, 0.01)
    assert choose_nodes_per_request([0.9, 1.7, 2.4, 3.0], cheap, 1, tree) == 4
    # ... and a cut that gains less than CUT_MARGIN over the full tree is not taken:
    # A(3) = A(4) makes n = 3 best by 0.2% only.
    assert choose_nodes_per_request([0.9, 1.7, 2.4, 2.4], cheap, 1, tree) == 4


def test_choice_shrinks_as_verification_gets_dearer_and_the_batch_grows():
    tree = DynamicTree(depth=5, top_k=4, total_tokens=16)
    accepted = [0.8, 1.1, 1.8, 2.1, 2.2, 2.3, 2.5, 3.1, 3.1, 3.2, 3.7, 3.7, 4.1, 4.2, 4.2]
    chosen = [choose_nodes_per_request(accepted, StepCosts(5.0, per_token, 1.0, 0.05, 1.8), b,
                                       tree)
              for per_token, b in ((0.05, 1), (0.35, 1), (0.35, 8), (2.0, 8))]
    assert chosen == sorted(chosen, reverse=True) and chosen[0] == 15 and chosen[-1] < 4
    # Deterministic: a pure function of its inputs.
    again = choose_nodes_per_request(accepted, StepCosts(5.0, 0.35, 1.0, 0.05, 1.8), 8, tree)
    assert again == chosen[2]
    with pytest.raises(ValueError, match="accepted has 3 entries, the tree 15 nodes"):
        choose_nodes_per_request([1.0, 2.0, 3.0], StepCosts(5.0, 1.0, 0, 0, 1.0), 1, tree)
