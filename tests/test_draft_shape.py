"""Tree or chain per batch bucket (rocdraft/draft_shape.py): the probe and choice schedule of
the docstring, the averaged samples, and the engine drafting chains in tree mode with greedy
output unchanged."""
from __future__ import annotations

import pytest

from checkpoints import write_cyclic_eagle3_head, write_cyclic_llama
from rocdraft.config import SamplingParams, SpeculativeConfig
from rocdraft.draft_shape import EXPLORE_EVERY, PROBE_STEPS, SAMPLES, DraftShapeChooser
from rocdraft.engine import LLM

PROMPTS = [[1, 5, 7, 9], [1, 2], list(range(1, 30)), [4] * 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
STATIC = "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]"  # depth 4


def test_until_both_are_measured_it_alternates_runs_of_probe_steps():
    chooser = DraftShapeChooser()
    shapes = [chooser.decide(4) for _ in range(4 * PROBE_STEPS)]
    assert shapes == (["tree"] * PROBE_STEPS + ["chain"] * PROBE_STEPS) * 2
    chooser.record(4, "tree", 100, 1.0)  # one shape measured is not enough to choose
    assert chooser.faster(4) is None and chooser.decide(4) == "tree"


def test_docstring_example_the_faster_shape_with_probes_of_the_other():
    chooser = DraftShapeChooser()
    chooser.record(8, "tree", 540, 1.0)
    chooser.record(8, "chain", 690, 1.0)
    assert chooser.faster(8) == chooser.faster(5) == "chain"  # one bucket (8)
    assert chooser.faster(1) is None  # nothing measured in bucket 1
    shapes = [chooser.decide(8) for _ in range(3 * EXPLORE_EVERY)]
    assert [i for i, s in enumerate(shapes) if s == "tree"] == \
        [i for i in range(3 * EXPLORE_EVERY) if i % EXPLORE_EVERY >= EXPLORE_EVERY - PROBE_STEPS]
    for _ in range(4):  # faster tree samples lift its average above the chain's
        chooser.record(8, "tree", 1000, 1.0)
    assert chooser.faster(8) == "tree"


def test_a_rate_is_the_median_of_recent_samples_so_one_slow_step_does_not_count():
    chooser = DraftShapeChooser()
    chooser.record(2, "tree", 5, 1.0)  # a first step that compiled a kernel: 5 tok/s
    chooser.record(2, "chain", 100, 1.0)
    for rate in (400, 410, 390):
        chooser.record(2, "tree", rate, 1.0)
    assert chooser.buckets[2].rates["tree"] == 395  # median of 5, 400, 410, 390
    assert chooser.faster(2) == "tree"
    for _ in range(SAMPLES):  # older samples leave the window
        chooser.record(2, "tree", 50, 1.0)
    assert chooser.buckets[2].rates["tree"] == 50 and chooser.faster(2) == "chain"


def test_bad_samples_are_not_counted_and_bad_arguments_refused():
    chooser = DraftShapeChooser()
    chooser.record(2, "tree", 0, 1.0)  # nothing emitted: no sample
    chooser.record(2, "tree", 5, 0.0)
    assert "tree" not in chooser.buckets[2].rates
    with pytest.raises(ValueError, match="shape must be one of .*, got 'plain'"):
        chooser.record(2, "plain", 1, 1.0)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        chooser.decide(0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("shape")
    target = write_cyclic_llama(root / "target")
    return str(target), str(write_cyclic_eagle3_head(root / "eagle3", target))


@pytest.mark.parametrize("tree", [dict(speculative_token_tree=STATIC),
                                  # a fixed batch budget: no cost-based cut of the trees
                                  dict(tree_depth=4, tree_top_k=2, tree_total_tokens=8,
                                       max_draft_tokens_per_step=32)],
                         ids=["static", "dynamic"])
def test_engine_measures_both_shapes_and_drafts_the_faster(pair, tree):
    target, head = pair
    reference = [o.token_ids for o in LLM(target).generate(PROMPTS, GREEDY)]
    llm = LLM(target, head, SpeculativeConfig("eagle3", 3, **tree))
    assert llm.shape_chooser is not None
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.last_stats.acceptance_length > 1.5
    rates = llm.shape_chooser.buckets[4].rates  # both shapes were measured at batch 4
    assert rates["tree"] > 0 and rates["chain"] > 0
    nodes = {}
    for faster, slower in (("chain", "tree"), ("tree", "chain")):  # one shape far faster
        for bucket in (1, 2, 4):
            llm.shape_chooser.buckets[bucket] = type(llm.shape_chooser.buckets[4])(
                samples={faster: [1e12], slower: [1.0]})
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
        stats = llm.last_stats
        assert stats.acceptance_length > 1.5
        nodes[faster] = stats.num_verified_nodes / stats.num_verify_steps
        if faster == "chain":  # a chain, not a flat tree: drafts past depth 1 are accepted
            assert sum(stats.accepted_at_position[1:]) > 0, stats.accepted_at_position
    # Chains of min(k, depth) = 3 drafts (no probe in so few steps); trees of up to 7 nodes.
    assert nodes["chain"] == 3 and nodes["tree"] > 4, nodes


def test_fixed_policy_and_given_costs_draft_only_the_tree(pair):
    target, head = pair
    for spec in (SpeculativeConfig("eagle3", 3, speculative_token_tree=STATIC,
                                   draft_policy="fixed"),
                 SpeculativeConfig("eagle3", 3, speculative_token_tree=STATIC,
                                   draft_costs=(1.0, 0.1, 0.0, 0.0, 0.1)),
                 SpeculativeConfig("eagle3", 3)):  # a chain config: nothing to choose
        assert LLM(target, head, spec).shape_chooser is None
