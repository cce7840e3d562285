"""The cost policy's realized-throughput guard (rocdraft/spec_decode/throughput_guard.py): the probe and
veto schedule of the docstring, the averaged samples, and the engine feeding it pure steps and
obeying a veto with unchanged greedy output."""
from __future__ import annotations

import pytest

from checkpoints import write_cyclic_eagle3_head, write_cyclic_llama
from rocdraft.config import SamplingParams, SpeculativeConfig
from rocdraft.spec_decode.cost_model import StepCosts
from rocdraft.engine import LLM
from rocdraft.spec_decode.throughput_guard import (PLAIN_EVERY, PLAIN_PROBE, SAMPLE_WEIGHT, SPEC_PROBE_STEPS,
                                       ThroughputGuard)

PROMPTS = [[1, 5, 7, 9], [1, 2], list(range(1, 30)), [4] * 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_without_samples_it_follows_the_policy_except_the_plain_probes():
    guard = ThroughputGuard()
    choices = [guard.decide(8, 3, 4) for _ in range(PLAIN_EVERY + 8)]
    probes = {i for i in range(len(choices)) if i % PLAIN_EVERY in PLAIN_PROBE}
    assert all(choices[i] == (0 if i in probes else 3) for i in range(len(choices)))


def test_docstring_example_veto_and_spec_probes():
    guard = ThroughputGuard()
    guard.record(8, "plain", 600, 1.0)
    guard.record(8, "spec", 560, 1.0)
    assert guard.vetoed(8) and guard.vetoed(5)  # same bucket (8)
    assert not guard.vetoed(1)  # another bucket: nothing measured there
    choices = [guard.decide(8, 3, 4) for _ in range(48)]
    speculating = [i for i, d in enumerate(choices) if d]
    assert speculating == [i for i in range(48) if i % 16 < SPEC_PROBE_STEPS
                           and i % PLAIN_EVERY not in PLAIN_PROBE]
    # A probe whose policy choice is 0 still speculates (max(choice, 1)) ...
    guard.buckets[8].steps = 16
    assert guard.decide(8, 0, 4) == 1
    # ... unless nothing may be drafted at all.
    guard.buckets[8].steps = 16
    assert guard.decide(8, 0, 0) == 0
    # A faster speculative sample lifts the average above plain: the veto ends.
    for _ in range(3):
        guard.record(8, "spec", 900, 1.0)
    assert not guard.vetoed(8)


def test_samples_are_exponential_averages_and_checked():
    guard = ThroughputGuard()
    guard.record(2, "spec", 100, 1.0)
    guard.record(2, "spec", 200, 1.0)
    assert guard.buckets[2].rates["spec"] == pytest.approx(100 + SAMPLE_WEIGHT * 100)
    guard.record(2, "plain", 0, 1.0)  # nothing emitted: not a sample
    guard.record(2, "plain", 5, 0.0)
    assert "plain" not in guard.buckets[2].rates
    with pytest.raises(ValueError, match="mode must be 'plain' or 'spec', got 'tree'"):
        guard.record(2, "tree", 1, 1.0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("guard")
    target = write_cyclic_llama(root / "target")
    return str(target), str(write_cyclic_eagle3_head(root / "eagle3", target))


def test_engine_feeds_pure_steps_and_obeys_a_veto(pair):
    target, head = pair
    reference = [o.token_ids for o in LLM(target).generate(PROMPTS, GREEDY)]
    llm = LLM(target, head, SpeculativeConfig("eagle3", 3))
    assert llm.policy.throughput_guard is not None
    # Costs under which the policy always speculates (the tiny test model's measured ones
    # need not): the guard is what this test watches.
    llm.policy.given_step_costs = StepCosts(1.0, 1e-3, 0.0, 0.0, 1e-3)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.last_stats.acceptance_length > 1.5
    rates = llm.policy.throughput_guard.buckets[4].rates  # both modes were measured at batch 4
    assert rates["spec"] > 0 and rates["plain"] > 0
    # Speculation measured far slower everywhere: the engine decodes plainly but for probes.
    for bucket in (1, 2, 4):
        llm.policy.throughput_guard.record(bucket, "plain", 10**9, 1.0)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    # num_verify_steps counts requests that verified: unvetoed, every request verifies in
    # nearly every step; vetoed, only the probes' steps (3 in 16) do.
    stats = llm.last_stats
    assert stats.num_verify_steps <= len(PROMPTS) * stats.num_steps // 3


def test_given_costs_and_fixed_policies_have_no_guard(pair):
    target, head = pair
    for spec in (SpeculativeConfig("eagle3", 3, draft_costs=(1.0, 0.1, 0.0, 0.0, 0.1)),
                 SpeculativeConfig("eagle3", 3, draft_policy="fixed"),
                 SpeculativeConfig("eagle3", tree_depth=3, tree_top_k=2, tree_total_tokens=6)):
        assert LLM(target, head, spec).throughput_guard is None
