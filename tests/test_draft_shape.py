"""Tree or chain per batch bucket (rocdraft/spec_decode/draft_shape.py): the probe and choice schedule of
the docstring, the averaged samples, and the engine drafting chains in tree mode with greedy
output unchanged."""
from __future__ import annotations

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from checkpoints import write_cyclic_eagle3_head, write_cyclic_llama
from rocdraft.config import SamplingParams, SpeculativeConfig
from rocdraft.spec_decode.cost_model import StepCosts
from rocdraft.spec_decode.realized_times import RealizedStepTimes
from rocdraft.spec_decode.draft_shape import (EXPLORE_EVERY, MAX_CYCLE, MIN_TIME_SAMPLES,
                                              PROBE_BUDGET, PROBE_STEPS, TIME_SAMPLES,
                                              TOKEN_SAMPLES, DraftShapeChooser, chain_on_path,
                                              chain_on_tree_step, probe_cycle, rank0_flags)
from rocdraft.engine import LLM

PROMPTS = [[1, 5, 7, 9], [1, 2], list(range(1, 30)), [4] * 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
STATIC = "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]"  # depth 4


def force(chooser, faster: str, buckets=(1, 2, 4, 8)) -> None:
    """Samples that make ``faster`` far faster in every bucket."""
    for bucket in buckets:
        chooser.buckets.pop(bucket, None)
        for _ in range(MIN_TIME_SAMPLES):
            chooser.record(bucket, "tree", 1.0 if faster == "chain" else 1e-9, 10, 5)
            chooser.record(bucket, "chain", 1e-9 if faster == "chain" else 1.0)


def test_until_both_are_measured_it_alternates_runs_of_probe_steps():
    chooser = DraftShapeChooser()
    shapes = [chooser.decide(4) for _ in range(4 * PROBE_STEPS)]
    assert shapes == (["tree"] * PROBE_STEPS + ["chain"] * PROBE_STEPS) * 2
    for _ in range(MIN_TIME_SAMPLES):  # one shape measured is not enough to choose
        chooser.record(4, "tree", 1.0, 100, 60)
    assert chooser.faster(4) is None and chooser.decide(4) == "tree"
    for _ in range(MIN_TIME_SAMPLES - 1):  # nor too few times of the other (a median of
        chooser.record(4, "chain", 1.0)  # two is their mean)
    assert chooser.faster(4) is None
    chooser.record(4, "chain", 1.0)
    assert chooser.faster(4) == "tree"  # 100 against 60 tokens in equal times
    # both timed, but no tree tokens (not reachable through record: set by hand, and the
    # bucket's rates forgotten as a new sample would)
    chooser.buckets[4].tokens.clear()
    chooser.buckets[4].known_rates = None
    assert chooser.faster(4) is None


def test_rates_follow_every_new_sample():
    """The rates are kept between samples (the engine asks every step), and every recorded
    step moves them: a chain that slows down loses to the tree at once."""
    chooser = DraftShapeChooser()
    for _ in range(MIN_TIME_SAMPLES):
        chooser.record(1, "tree", 0.010, 5, 4)
        chooser.record(1, "chain", 0.007)
    assert chooser.faster(1) == "chain"  # 4 / 0.007 = 571 against 5 / 0.010 = 500 tok/s
    kept = chooser.buckets[1].known_rates
    chooser.buckets[1].rates["chain"] = 0.0  # a caller's copy: the kept rates stay
    assert chooser.buckets[1].known_rates is kept  # not recomputed without a new sample
    assert chooser.faster(1) == "chain"
    for _ in range(2):  # the median of 0.007, 0.007, 0.012, 0.012: 0.0095
        chooser.record(1, "chain", 0.012)
    assert chooser.buckets[1].rates["chain"] == pytest.approx(4 / 0.0095)
    assert chooser.faster(1) == "tree"
    chooser.record(1, "tree", 0.010, 9, 4)  # a tree step with a gain of 9 / 4: tokens move
    assert chooser.buckets[1].rates["tree"] == pytest.approx((5 + 5 + 9) / 3 / 0.010)


def test_docstring_examples():
    import doctest

    from rocdraft.spec_decode import draft_shape

    assert doctest.testmod(draft_shape).failed == 0


def test_docstring_example_the_faster_shape_with_probes_of_the_other():
    chooser = DraftShapeChooser()
    # Tree steps: 40 tokens where the chain would have made 30 (gain 1.33), but a tree step
    # takes 1.6x a chain step: 500 against 600 tok/s.
    for _ in range(MIN_TIME_SAMPLES):
        chooser.record(8, "tree", 0.08, 40, 30)
        chooser.record(8, "chain", 0.05)
    assert chooser.buckets[8].rates == pytest.approx({"tree": 500, "chain": 600})
    assert chooser.faster(8) == chooser.faster(5) == "chain"  # one bucket (8)
    assert chooser.faster(1) is None  # nothing measured in bucket 1
    shapes = [chooser.decide(8) for _ in range(330)]
    # 160: a probe run lasts 3 x 1.6 chain steps and makes 1/6 fewer tokens, 0.8 chain
    # steps' tokens, 0.5% of 160 steps
    cycle = round(PROBE_STEPS * 0.08 / 0.05 * (1 - 500 / 600) / PROBE_BUDGET)
    assert [i for i, s in enumerate(shapes) if s == "tree"] == \
        [(c + 1) * cycle - PROBE_STEPS + j for c in range(2) for j in range(PROBE_STEPS)] \
        == [157, 158, 159, 317, 318, 319]
    for _ in range(TOKEN_SAMPLES):  # a text where the tree's gain is 2: it wins
        chooser.record(8, "tree", 0.08, 40, 20)
    assert chooser.faster(8) == "tree"


@pytest.mark.parametrize("tree, chain", [
    ((0.08, 40), (0.05, 30)),  # the tree 1.6x a chain step, 500 against 600 tok/s
    ((0.018, 6), (0.010, 4.3)),  # bs 1 on the built-in pair: 333 against 430 tok/s
    ((0.06, 40), (0.05, 30)),  # the tree faster: 667 against 600; chain steps probed
])
def test_probes_cost_their_budget_of_the_faster_shapes_throughput(tree, chain):
    """Drafting as the chooser decides for three whole cycles, with each shape's step time
    and tokens as measured: the tokens it makes in that time fall short of the faster
    shape's rate by PROBE_BUDGET (each probe run lasts PROBE_STEPS slower steps)."""
    (tree_time, tree_tokens), (chain_time, chain_tokens) = tree, chain
    chooser = DraftShapeChooser()
    for _ in range(MIN_TIME_SAMPLES):
        chooser.record(1, "tree", tree_time, tree_tokens, chain_tokens)
        chooser.record(1, "chain", chain_time)
    cycle = chooser.buckets[1].cycle()
    assert EXPLORE_EVERY < cycle < MAX_CYCLE
    shapes = [chooser.decide(1) for _ in range(3 * cycle)]
    time = sum(tree_time if s == "tree" else chain_time for s in shapes)
    tokens = sum(tree_tokens if s == "tree" else chain_tokens for s in shapes)
    faster_rate = max(tree_tokens / tree_time, chain_tokens / chain_time)
    assert 1 - tokens / (faster_rate * time) == pytest.approx(PROBE_BUDGET, rel=0.05)


def test_probe_cycles_are_bounded():
    """Shapes about as fast are probed every EXPLORE_EVERY steps at most, a far slower one
    every MAX_CYCLE steps at least."""
    assert probe_cycle(1.0) == probe_cycle(0.999, 1.0) == EXPLORE_EVERY
    assert probe_cycle(0.01) == probe_cycle(0.5, 10.0) == MAX_CYCLE


def test_an_unmeasured_bucket_follows_its_neighbours_only_where_they_agree():
    """A batch of 8 shrinks through buckets 4 and 2 as its requests finish: a few steps per
    run each, which exploring spent on trees although buckets 1 and 8 chose the chain."""
    chooser = DraftShapeChooser()
    force(chooser, "chain", buckets=(1, 8))
    assert chooser.bracketed(4) == chooser.bracketed(2) == "chain"
    assert chooser.faster(4) is None  # nothing of its own yet
    shapes = [chooser.decide(3) for _ in range(EXPLORE_EVERY)]
    # the neighbours' shape, then a probe run of the other (EXPLORE_EVERY: no ratio known)
    assert shapes == ["chain"] * (EXPLORE_EVERY - PROBE_STEPS) + ["tree"] * PROBE_STEPS
    force(chooser, "tree", buckets=(8,))  # they disagree: explore as before
    assert chooser.bracketed(2) is None
    assert [chooser.decide(2) for _ in range(2 * PROBE_STEPS)] == \
        ["tree"] * PROBE_STEPS + ["chain"] * PROBE_STEPS
    lone = DraftShapeChooser()  # only one side measured: never extrapolated
    force(lone, "chain", buckets=(1,))
    assert lone.bracketed(8) is None and lone.decide(8) == "tree"
    force(lone, "chain", buckets=(2,))
    assert lone.bracketed(8) is None


def test_tokens_are_compared_on_the_same_steps_and_times_take_the_median():
    chooser = DraftShapeChooser()
    # Easy text during the tree's steps (6 tokens each, the chain would have made 5 there):
    # a rate of the tree's own steps against chain steps on harder text would pick the tree.
    for _ in range(4):
        chooser.record(1, "tree", 0.030, 6, 5)
        chooser.record(1, "chain", 0.017)
    assert chooser.faster(1) == "chain"  # 6 / 0.030 < 5 / 0.017
    chooser.record(1, "chain", 5.0)  # a step that compiled a kernel: 5 s
    assert chooser.buckets[1].rates["chain"] == pytest.approx(5 / 0.017)
    for _ in range(TIME_SAMPLES):  # older times leave the window
        chooser.record(1, "chain", 0.5)
    assert chooser.faster(1) == "tree"
    early = DraftShapeChooser()  # two times only: the smaller (a median of two is a mean)
    for seconds in (5.0, 0.017):
        early.record(1, "tree", 0.030, 6, 5)
        early.record(1, "chain", seconds)
    assert early.buckets[1].rates["chain"] == pytest.approx(5 / 0.017)


def test_rank0_flags_and_the_chain_tokens_of_a_path():
    parents = [-1, -1, 0, 0, 1]  # a dynamic tree: children best first
    assert rank0_flags(parents) == [True, False, True, False, True]
    # A static tree lists ranks explicitly: (1,) before (0,) is allowed within a depth.
    assert rank0_flags([-1, -1, 1], ranks=(1, 0, 0)) == [False, True, True]
    flags = rank0_flags(parents)
    rates = [0.8, 0.5, 0.5, 0.5]
    # docstring examples: node 3 is rank 1 (the chain's draft 2 was rejected); 2 is a leaf
    assert chain_on_path([0, 3, -1], parents, flags, 4, rates) == (2, 2, 1)
    assert chain_on_path([0, 2], parents, flags, 4, rates) == pytest.approx((3.75, 2, 2))
    assert chain_on_path([0, 2], parents, flags, 1, rates) == (2, 1, 1)  # the chain's length
    assert chain_on_path([1, 4], parents, flags, 4, rates) == (1, 1, 0)  # root's rank-1 child
    # nothing accepted although the root has a rank-0 child: the chain's first draft failed
    assert chain_on_path([-1, -1], parents, flags, 4, rates) == (1, 1, 0)
    # stopped at node 1, which has a rank-0 child (4): rejected, exact
    assert chain_on_path([1, -1], [-1, -1, 0, 0, 1], [True, True, True, False, True], 4,
                         rates) == (2, 2, 1)
    # a budget-cut tree: only the root's rank-0 child, accepted; the rest is expected
    assert chain_on_path([0], [-1], [True], 3, rates) == pytest.approx((1 + 1 + .5 + .25,
                                                                        1, 1))


def test_the_chain_on_a_tree_step_docstring_example_and_rows_that_did_not_sample():
    got = chain_on_tree_step([[-1, -1, 0], []], [[0, 2], [0, 1]], [True, True], None,
                             chain_len=2, positions=3, rates=[0.5] * 3)
    assert got == (6, [2], [2])  # the chain beside the tree counts its own tokens only
    # Static ranks: node 0 is rank 1, node 1 rank 0 (listed second), node 2 its rank-0 child.
    assert chain_on_tree_step([[-1, -1, 1]], [[1, 2]], [True], ranks=(1, 0, 0), chain_len=2,
                              positions=2, rates=[0.5] * 2) == (3, [2], [2])
    got = chain_on_tree_step([[-1, -1, 1], [-1, -1]], [[0, -1], [0, -1]], [True, False],
                             ranks=(1, 0, 0), chain_len=4, positions=4, rates=[0.5] * 4)
    assert got == (1, [1], [0])  # the path took the rank-1 node; row 1 sampled nothing


def test_a_probe_run_keeps_its_shape_when_the_estimates_flip_during_it():
    chooser = DraftShapeChooser()
    for _ in range(MIN_TIME_SAMPLES):
        chooser.record(1, "tree", 1.0, 10, 5)
        chooser.record(1, "chain", 0.4)  # chain faster: probes draft trees
    first = [chooser.decide(1) for _ in range(chooser.buckets[1].cycle() - PROBE_STEPS + 1)]
    assert first[-1] == "tree" and set(first[:-1]) == {"chain"}  # the probe run started
    for _ in range(TIME_SAMPLES):  # now the tree is far faster
        chooser.record(1, "chain", 100.0)
    assert chooser.faster(1) == "tree"
    assert [chooser.decide(1) for _ in range(PROBE_STEPS - 1)] == ["tree"] * (PROBE_STEPS - 1)
    assert chooser.decide(1) == "tree"  # the run over: the faster shape


def test_bad_samples_are_not_counted_and_bad_arguments_refused():
    chooser = DraftShapeChooser()
    chooser.record(2, "chain", 0.0)  # no time: no sample
    assert "chain" not in chooser.buckets[2].times
    with pytest.raises(ValueError, match="shape must be one of .*, got 'plain'"):
        chooser.record(2, "plain", 1.0)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        chooser.decide(0)
    for tokens, chain in ((5, 0), (0, 2)):
        with pytest.raises(ValueError, match=f"chain_tokens={chain}, num_tokens={tokens}"):
            chooser.record(2, "tree", 1.0, tokens, chain)
    chooser.record(2, "tree", 1.0, 2, 3.5)  # the chain's expected tokens may exceed the tree's


def pin_clock(monkeypatch, llm, per_draft: float, sweep: bool) -> None:
    """A deterministic engine clock for ``llm``: each reading advances 1 ms, and drafting
    ``per_draft`` seconds per draft (a chain) or level (a tree) past the first; the chains'
    realized times start
    afresh (with or without the sweep), their prior start-up costs say drafting is free, so
    the counts they pick never depend on machine load."""
    now = [0.0]

    def clock() -> float:
        now[0] += 1e-3
        return now[0]

    proposer = llm.draft_runner.proposer
    propose, propose_tree = proposer.propose, proposer.propose_tree

    def charged_propose(*args, num_drafts=None, **kwargs):
        now[0] += per_draft * ((num_drafts or proposer.num_speculative_tokens) - 1)
        return propose(*args, num_drafts=num_drafts, **kwargs)

    def charged_propose_tree(*args, **kwargs):  # a level per depth past the first
        now[0] += per_draft * (llm.tree.depth - 1)
        return propose_tree(*args, **kwargs)

    monkeypatch.setattr(llm.model_runner, "work_clock", clock)  # the policy's step times
    monkeypatch.setattr(proposer, "propose", charged_propose)
    monkeypatch.setattr(proposer, "propose_tree", charged_propose_tree)
    llm.policy.chain_times = RealizedStepTimes(llm.policy.chain_times.max_drafts, sweep=sweep,
                                               min_drafts=1)
    llm.policy.chain_step_costs = dict.fromkeys((1, 2, 4), StepCosts(1.0, 0.0, 1.0, 0.0, 0.0))


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
def test_engine_measures_both_shapes_and_drafts_the_faster(pair, tree, monkeypatch):
    target, head = pair
    reference = [o.token_ids for o in LLM(target).generate(PROMPTS, GREEDY)]
    llm = LLM(target, head, SpeculativeConfig("eagle3", 3, **tree))
    assert llm.policy.shape_chooser is not None
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.last_stats.acceptance_length > 1.5
    times = llm.policy.shape_chooser.buckets[4].times  # both shapes were timed at batch 4
    assert set(times) == {"tree", "chain"} and all(t > 0 for ts in times.values() for t in ts)
    # Tree steps: the tree's tokens and the chain's on the same step (where the tree ran out
    # of rank-0 nodes, the chain's expected tokens: they may exceed the tree's)
    tokens = llm.policy.shape_chooser.buckets[4].tokens
    assert tokens and all(tree > 0 and chain > 0 for tree, chain in tokens)
    assert any(tree > chain for tree, chain in tokens)
    assert set(llm.policy.chain_step_costs) == {1, 2, 4}  # the chain's costs, measured per bucket
    nodes = {}
    # From here the engine's clock is pinned: every step takes the same time, whatever it
    # drafts (drafting free), so the chains' realized times pick min(k, depth) = 3 (and
    # fewer where the tokens left cannot use 3).
    pin_clock(monkeypatch, llm, per_draft=0.0, sweep=False)
    for faster in ("chain", "tree"):  # one shape far faster
        force(llm.policy.shape_chooser, faster)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
        stats = llm.last_stats
        assert stats.acceptance_length > 1.5
        nodes[faster] = stats.num_verified_nodes / stats.num_verify_steps
        # every verify step verified the forced shape (no probe in so few steps)
        assert stats.num_tree_verify_steps == (stats.num_verify_steps if faster == "tree"
                                               else 0)
        if faster == "chain":  # a chain, not a flat tree: drafts past depth 1 are accepted
            assert sum(stats.accepted_at_position[1:]) > 0, stats.accepted_at_position
    # chains of min(k, depth) = 3 but where a batch's last tokens have use for fewer
    # (``useful_drafts``: these requests end at known lengths); trees of up to 7 nodes
    assert 2.5 < nodes["chain"] < 3 and nodes["tree"] > 4, nodes
    # Every draft past the first costs 1 s although the start-up costs say drafting is free:
    # after the sweep (3, 3, 2, 2, 1, 1 per bucket) the realized times pick chains of 1
    # (the start-up costs alone drafted 3 on every step).
    pin_clock(monkeypatch, llm, per_draft=1.0, sweep=True)
    for _ in range(4):  # the first runs sweep each bucket (bucket 1 sees 1-2 steps a run)
        force(llm.policy.shape_chooser, "chain")
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    stats = llm.last_stats
    assert stats.num_verified_nodes / stats.num_verify_steps < 1.1  # chains of 1
    assert stats.acceptance_length > 1.3
    # (bucket 1 holds only a run's last steps here, whose chains the tokens left cap: it
    # never samples longer ones, so its estimate stays the start-up costs')
    assert llm.policy._chain_policy_drafts(4) == 1


def ops_per_step(monkeypatch, llm) -> tuple[list, list[int], list[int]]:
    """Greedy outputs of PROMPTS, and per engine step the aten ops it ran and the replays of
    the captured draft loop (its static-buffer runner) it made, after a first run (one-time
    work: the RoPE tables)."""
    llm.generate(PROMPTS, GREEDY)
    counts, replays = [], []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[-1] += 1
            return func(*args, **(kwargs or {}))

    runner = llm.draft_runner.proposer.graph_runner
    run, step = runner.run, llm._step

    def counted_run(*args, **kwargs):
        replays[-1] += 1
        return run(*args, **kwargs)

    def counted_step(*args, **kwargs):
        counts.append(0)
        replays.append(0)
        with Count():
            return step(*args, **kwargs)

    monkeypatch.setattr(runner, "run", counted_run)
    monkeypatch.setattr(llm, "_step", counted_step)
    outputs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return outputs, counts, replays


def test_a_chain_step_in_tree_mode_does_the_chain_configs_work(pair, monkeypatch):
    """A tree config whose chooser drafts chains of k runs, step by step, the chain config's
    aten ops and replays its captured k-draft loop (graph_mode "replay-eagerly": the GPU's
    path through the graphs' static buffers, replayed eagerly on the CPU): no tree scoring,
    no tree-path reads, no eager draft loop. Shape and length pinned (no machine timing)."""
    target, head = pair
    reference = [o.token_ids for o in LLM(target).generate(PROMPTS, GREEDY)]
    chain = LLM(target, head, SpeculativeConfig("eagle3", 3, draft_policy="fixed"),
                graph_mode="replay-eagerly")
    tree = LLM(target, head, SpeculativeConfig("eagle3", 3, speculative_token_tree=STATIC),
               graph_mode="replay-eagerly")
    monkeypatch.setattr(tree.policy, "shape", lambda batch_size: "chain")
    monkeypatch.setattr(tree.policy, "chain_drafts_in_tree_mode",
                        lambda batch_size, outlook=None: 3)
    chain_out, chain_ops, chain_replays = ops_per_step(monkeypatch, chain)
    tree_out, tree_ops, tree_replays = ops_per_step(monkeypatch, tree)
    assert chain_out == tree_out == reference
    assert tree.last_stats.acceptance_length > 1.5 and tree.last_stats.num_tree_verify_steps == 0
    assert len(tree_ops) == len(chain_ops) and tree_replays == chain_replays
    assert sum(tree_replays) >= len(tree_ops) - 1  # every step with a decode drafted 3 there
    assert all(abs(t - c) <= 4 for t, c in zip(tree_ops, chain_ops)), (tree_ops, chain_ops)


def test_seeded_sampling_mixing_trees_and_chains_equals_seeded_target_only(pair):
    """Both samplers draw the target's own noise per emitted position, so a seeded request
    emits target-only's tokens whichever shape each step drafts."""
    target, head = pair
    seeded = [SamplingParams(temperature=0.9, top_k=50, max_tokens=24, seed=s, ignore_eos=True)
              for s in (21, 22, 23, 24)]
    expected = [o.token_ids for o in LLM(target).generate(PROMPTS, seeded)]
    llm = LLM(target, head, SpeculativeConfig("eagle3", 3, speculative_token_tree=STATIC))
    assert [o.token_ids for o in llm.generate(PROMPTS, seeded)] == expected
    stats = llm.last_stats  # the learning runs drafted both shapes
    assert 0 < stats.num_tree_verify_steps < stats.num_verify_steps
    assert stats.acceptance_length > 1.3


def test_fixed_policy_and_given_costs_draft_only_the_tree(pair):
    target, head = pair
    for spec in (SpeculativeConfig("eagle3", 3, speculative_token_tree=STATIC,
                                   draft_policy="fixed"),
                 SpeculativeConfig("eagle3", 3, speculative_token_tree=STATIC,
                                   draft_costs=(1.0, 0.1, 0.0, 0.0, 0.1)),
                 SpeculativeConfig("eagle3", 3)):  # a chain config: nothing to choose
        assert LLM(target, head, spec).policy.shape_chooser is None
