"""DraftPolicy (rocdraft/spec_decode/policy.py): which estimates exist for which config, the
questions the engine asks (num_drafts, shape, tree budget, costs to measure), and what one
``observe(StepRecord)`` feeds where. Pure: no model, no runner."""
from __future__ import annotations

import pytest

from rocdraft.config import SpeculativeConfig
from rocdraft.spec_decode.cost_model import StepCosts
from rocdraft.spec_decode.draft_shape import MIN_TIME_SAMPLES
from rocdraft.spec_decode.policy import DECIDE_EVERY, DraftPolicy
from rocdraft.spec_decode.realized_times import RealizedStepTimes
from rocdraft.spec_decode.step_record import StepRecord

STATIC = "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"  # depth 3, ranks 0 1 0 1 0 0
DYNAMIC = dict(tree_depth=3, tree_top_k=2, tree_total_tokens=6)
CHEAP = (1.0, 0.0, 0.0, 0.0, 0.0)  # verification and drafts free: always the most drafts


def policy(**spec) -> DraftPolicy:
    config = SpeculativeConfig("eagle3", **{"num_speculative_tokens": 4, **spec})
    return DraftPolicy(config, config.draft_tree())


def kept_seconds(entries: dict) -> dict:
    """A realized-times part (count -> kept Samples) as count -> their seconds."""
    return {count: [sample.seconds for sample in kept] for count, kept in entries.items()}


def record(**fields) -> StepRecord:
    base = dict(batch_size=1, has_prefill=False, seconds=0.01, produced=3, any_verified=True,
                drafted=True, shape=None, verified_tree=False, samples=[True])
    return StepRecord(**{**base, **fields})


def fresh_decisions(timer) -> list[int]:
    """The counts ``timer`` (a RealizedStepTimes) decides from now on, one per fresh
    decision (a repeated decision calls ``repeat``, not ``decide``)."""
    fresh, decide = [], timer.decide

    def counting(*args, **kwargs):
        fresh.append(decide(*args, **kwargs))
        return fresh[-1]

    timer.decide = counting
    return fresh


@pytest.mark.parametrize("spec, realized, tree_acceptance, chooser", [
    (dict(), True, False, False),  # chains, cost policy, measured costs: realized step times
    (dict(draft_costs=CHEAP), False, False, False),
    (dict(draft_policy="fixed"), False, False, False),
    (dict(speculative_token_tree=STATIC), False, False, True),
    (dict(**DYNAMIC), False, True, True),
    (dict(**DYNAMIC, max_draft_tokens_per_step=8), False, False, True),
    (dict(**DYNAMIC, draft_costs=CHEAP), False, True, False),
])
def test_which_estimates_exist_follows_from_the_config(spec, realized, tree_acceptance,
                                                       chooser):
    p = policy(**spec)
    assert (p.realized_times is not None, p.tree_acceptance is not None,
            p.shape_chooser is not None) == (realized, tree_acceptance, chooser)
    assert p.wants_tree_paths == (tree_acceptance or chooser)
    assert p.wants_tree_scores == tree_acceptance


def test_num_drafts_is_the_cap_until_costs_are_known_then_the_cost_choice():
    p = policy()
    assert p.num_drafts(1) == 4  # nothing measured: the cap
    assert p.costs_to_measure(4) == [(True, 1), (True, 2), (True, 4)]
    for chain, bucket in p.costs_to_measure(4):
        # every extra token costs a whole step: plain decoding is faster
        p.add_costs(chain, bucket, StepCosts(1e-3, 1.0, 0.0, 1.0, 1.0))
    assert p.costs_to_measure(4) == [] and p.costs_to_measure(8) == [(True, 8)]
    sweep = [p.num_drafts(3) for _ in range(10)]  # each count twice: realized times for all
    assert sweep == [4, 4, 3, 3, 2, 2, 1, 1, 0, 0]
    assert p.num_drafts(3) == 0
    capped = policy(max_draft_tokens_per_step=6, draft_policy="fixed")
    assert [capped.num_drafts(b) for b in (1, 2, 3, 4, 8)] == [4, 3, 2, 1, 0]
    assert policy(speculative_token_tree=STATIC).num_drafts(5) == 6  # a tree: its nodes


def test_given_costs_and_fixed_policy_measure_nothing():
    assert policy(draft_costs=CHEAP).costs_to_measure(64) == []
    assert policy(draft_policy="fixed").costs_to_measure(64) == []
    assert policy(draft_costs=CHEAP).num_drafts(2) == 4


def test_a_tree_config_measures_its_chains_and_a_dynamic_tree_its_own_steps():
    static = policy(speculative_token_tree=STATIC)
    assert static.costs_to_measure(2) == [(True, 1), (True, 2)]
    dynamic = policy(**DYNAMIC)
    assert dynamic.costs_to_measure(2) == [(False, 1), (False, 2), (True, 1), (True, 2)]
    dynamic.add_costs(False, 1, StepCosts(1.0, 0.0, 0.0, 0.0, 0.0))
    dynamic.add_costs(True, 1, StepCosts(2.0, 0.0, 0.0, 0.0, 0.0))
    assert dynamic.step_costs[1].target_fixed == 1.0
    assert dynamic.chain_step_costs[1].target_fixed == 2.0


def test_tree_budget_is_the_configured_one_or_the_full_tree_before_acceptance_is_seen():
    assert policy(**DYNAMIC, max_draft_tokens_per_step=8).tree_budget(2) == 8
    assert policy(speculative_token_tree=STATIC).tree_budget(2) is None
    dynamic = policy(**DYNAMIC, draft_costs=CHEAP)
    assert dynamic.tree_budget(2) is None  # no full tree verified yet


def test_observe_feeds_the_chain_acceptance_and_the_realized_step_times():
    p = policy()
    p.observe(record(chain_verified=[4], chain_accepted=[4], produced=5, num_drafts=4,
                     draft_seconds=0.004))
    assert p.realized_times.buckets == {}  # no start-up costs yet: nothing to keep it by
    p = policy()
    for bucket in (1, 2):  # samples at a bucket's own size are kept as they are
        p.add_costs(True, bucket, StepCosts(0.01, 0.001, 0.0005, 0.0005, 0.001))
    before = list(p.acceptance.rates)
    p.observe(record(chain_verified=[4], chain_accepted=[4], produced=5, num_drafts=4,
                     draft_seconds=0.004))
    assert all(after > b for after, b in zip(p.acceptance.rates, before))
    p.observe(record(batch_size=2, any_verified=False, drafted=False, produced=2,
                     samples=[True, True], draft_seconds=0.001))
    buckets = p.realized_times.buckets
    # verify part keyed by drafts verified per request, draft part by drafts made
    assert kept_seconds(buckets[1].verify) == {4: [pytest.approx(0.006)]}
    assert kept_seconds(buckets[1].draft) == {4: [0.004]}
    assert kept_seconds(buckets[2].verify) == {0: [pytest.approx(0.009)]}
    assert kept_seconds(buckets[2].draft) == {0: [0.001]}
    p.observe(record(has_prefill=True, produced=100, num_drafts=4, draft_seconds=0.5))
    assert kept_seconds(buckets[1].draft)[4] == [0.004]  # a prompt in the step: no sample
    # requests that verified different counts: a draft sample only
    p.observe(record(batch_size=2, samples=[True, True], chain_verified=[4, 2],
                     chain_accepted=[1, 1], num_drafts=4, draft_seconds=0.003))
    assert list(buckets[2].verify) == [0] and kept_seconds(buckets[2].draft)[4] == [0.003]


def test_observe_on_a_tree_step_feeds_the_chooser_with_the_chains_tokens_on_the_same_step():
    p = policy(speculative_token_tree=STATIC)
    parents = [-1, -1, 0, 0, 1, 2]  # the static tree's BFS parents
    # Path 0 -> 2 -> 5: all rank-0 nodes, the chain (min(k, depth) = 3 drafts) would have
    # accepted the same 3 tokens; the tree produced 4.
    tree_step = dict(shape="tree", verified_tree=True, tree_parents=[parents],
                     tree_paths=[[0, 2, 5]], produced=4)
    p.observe(record(**tree_step))  # the first tree step: no previous shape, no sample
    assert not p.shape_chooser.buckets
    p.observe(record(**tree_step))
    bucket = p.shape_chooser.buckets[1]
    assert list(bucket.tokens) == [(4, 4.0)] and len(bucket.times["tree"]) == 1
    # The chain's acceptance estimate learnt from both tree steps (3 of 3 accepted).
    assert p.acceptance.accepted[:3] == pytest.approx([1.95, 1.95, 1.95])
    for _ in range(MIN_TIME_SAMPLES - 1):
        p.observe(record(**tree_step))
    for _ in range(MIN_TIME_SAMPLES + 1):  # the first chain step switches: no sample
        p.observe(record(shape="chain", chain_verified=[3], chain_accepted=[3], produced=4,
                         seconds=0.001))
    assert p.shape_chooser.faster(1) == "chain"  # 4 tokens in a tenth of the time


def test_a_tree_step_sample_needs_a_verified_tree_and_a_repeated_shape():
    p = policy(speculative_token_tree=STATIC)
    p.observe(record(shape="tree", verified_tree=False))
    p.observe(record(shape="tree", verified_tree=False))  # only chains verified: no sample
    p.observe(record(shape="chain", chain_verified=[3], chain_accepted=[1]))  # switch
    assert not p.shape_chooser.buckets and p.drafted_shape == "chain"


def test_a_tree_configs_chains_start_at_the_cap_and_count_no_policy_step():
    p = policy(speculative_token_tree=STATIC)
    assert [p.chain_drafts_in_tree_mode(1) for _ in range(3)] == [3] * 3  # min(k, depth)
    assert p.policy_steps == 0  # the tree budget's exploration counts tree steps only


def run_steps(p, steps: int, verify_seconds, tree_config: bool) -> list[int]:
    """``steps`` pure decode steps at batch 1 where every draft is accepted, verifying v
    drafts takes ``verify_seconds(v)`` and drafting 1 ms -> the drafts of each step."""
    made, verified = [], 0
    for _ in range(steps):
        d = p.chain_drafts_in_tree_mode(1) if tree_config else p.num_drafts(1)
        made.append(d)
        draft = 1e-3 if d else 0.0
        p.observe(record(shape="chain" if tree_config else None,
                         seconds=verify_seconds(verified) + draft, draft_seconds=draft,
                         produced=verified + 1,
                         any_verified=verified > 0, num_drafts=d,
                         chain_verified=[verified] if verified else [],
                         chain_accepted=[verified] if verified else []))
        verified = d
    return made


def test_a_tree_configs_chains_are_decided_as_the_chain_configs_on_realized_times():
    """Start-up costs that make drafting look dear (what the built-in pair's replayed draft
    loop measured at batch 8): the chain config's realized times overrule them after its
    sweep, and so must a tree config's chains (they drafted 1 on every step before)."""
    dear = StepCosts(1e-3, 0.0, 0.0, 0.0, 1.0)  # each draft step 1 s
    tree, chain = policy(speculative_token_tree=STATIC), policy(num_speculative_tokens=3)
    tree.add_costs(True, 1, dear)
    chain.add_costs(True, 1, dear)
    flat = lambda v: 0.01  # noqa: E731  every count realizes the same step time
    made_tree = run_steps(tree, 20, flat, tree_config=True)
    made_chain = run_steps(chain, 20, flat, tree_config=False)
    assert made_chain[:8] == [3, 3, 2, 2, 1, 1, 0, 0] and set(made_chain[8:]) == {3}
    assert made_tree[:6] == [3, 3, 2, 2, 1, 1] and set(made_tree[6:]) == {3}  # never 0
    assert tree._chain_policy_drafts(1) == 3
    # Verification dearer with every draft: the chain config decodes plainly, the tree
    # config's chains draft 1 (never 0).
    steep = lambda v: 0.01 + 0.05 * v  # noqa: E731
    tree, chain = policy(speculative_token_tree=STATIC), policy(num_speculative_tokens=3)
    for p in (tree, chain):
        p.add_costs(True, 1, StepCosts(1e-3, 0.0, 0.0, 0.0, 0.0))  # drafting looks free
    assert set(run_steps(tree, 20, steep, tree_config=True)[6:]) == {1}
    assert set(run_steps(chain, 20, steep, tree_config=False)[8:]) == {0}


def test_a_tree_configs_chains_repeat_a_decision_as_a_chain_configs_do():
    """A tree config's chains decide afresh every DECIDE_EVERY-th chain step, as a chain
    config's cost policy does (``num_drafts``), never repeat the sweep, and decide afresh
    after a tree step."""
    from rocdraft.spec_decode.policy import DECIDE_EVERY

    p = policy(speculative_token_tree=STATIC)
    p.add_costs(True, 1, StepCosts(1e-3, 0.0, 0.0, 0.0, 0.0))
    timer = p.chain_times
    fresh = fresh_decisions(timer)
    p.drafted_shape = "chain"
    sweep = 2 * 3  # 3, 3, 2, 2, 1, 1: every one decided
    for _ in range(sweep + 4 * DECIDE_EVERY):
        p.chain_drafts_in_tree_mode(1)
    assert len(fresh) == sweep + 4 and timer.buckets[1].steps == sweep + 4 * DECIDE_EVERY
    p.drafted_shape = "tree"  # the last step verified a tree: decided afresh
    p.chain_drafts_in_tree_mode(1)
    assert len(fresh) == sweep + 5


def test_a_tree_configs_chain_steps_wait_for_a_fresh_decision_and_its_shapes_do_not():
    """With ``defer_observations`` (the engine's), a tree config's chain steps are folded at
    its chains' next fresh decision, as a chain config's steps are; the shape chooser, which
    decides every step, learns each step at once; a step that verified a tree folds the kept
    steps first (what the chain would have done on it reads the chain's acceptance). Once
    folded, the estimates are those of a policy that folded every step at once."""
    p, now = policy(speculative_token_tree=STATIC), policy(speculative_token_tree=STATIC)
    for q in (p, now):
        q.add_costs(True, 1, StepCosts(1e-3, 0.0, 0.0, 0.0, 0.0))
        q.drafted_shape = "chain"
    p.defer_observations = True
    chain_step = dict(shape="chain", chain_verified=[3], chain_accepted=[1], produced=2,
                      seconds=0.01, draft_seconds=0.004)
    tree_step = dict(shape="tree", verified_tree=True, tree_parents=[[-1, -1, 0, 0, 1, 2]],
                     tree_paths=[[0, 2, 5]], produced=4)  # all rank-0: the chain's 3 of 3

    def both(call):
        return [call(q) for q in (p, now)]

    def same_estimates():
        return p.acceptance.rates == now.acceptance.rates \
            and kept_seconds(p.chain_times.buckets[1].verify) \
            == kept_seconds(now.chain_times.buckets[1].verify)

    for _ in range(2):
        both(lambda q: q.observe(record(**chain_step)))
    assert len(p.pending) == 2 and p.acceptance.verified[0] == 0 and not p.chain_times.buckets
    assert len(p.shape_chooser.buckets[1].times["chain"]) == 2  # the chooser knows already
    assert both(lambda q: q.chain_drafts_in_tree_mode(1)) == [3, 3]  # fresh: folded first
    assert not p.pending and same_estimates()
    assert kept_seconds(p.chain_times.buckets[1].verify) == {3: [0.006, 0.006]}
    both(lambda q: q.observe(record(**chain_step)))
    assert len(p.pending) == 1
    for _ in range(2):  # (the second a sample of the chooser's)
        both(lambda q: q.observe(record(**tree_step)))
    assert not p.pending and same_estimates() and p.drafted_shape == "tree"
    assert list(p.shape_chooser.buckets[1].tokens) == list(now.shape_chooser.buckets[1].tokens)
    for _ in range(4 * DECIDE_EVERY):  # no decision for a while: folded without one
        both(lambda q: q.observe(record(**chain_step)))
    assert not p.pending and same_estimates()


def test_a_tree_configs_kept_chain_steps_are_folded_before_its_chains_decide():
    """A fresh decision of a tree config's chains reads every step observed before it: with
    its steps kept (``defer_observations``) it drafts what a policy that folded each step at
    once drafts, step by step, while its head stops being accepted (2 drafts, then 1)."""
    def chains_on_a_clock(defer: bool) -> DraftPolicy:
        p = policy(speculative_token_tree=STATIC)
        p.add_costs(True, 1, StepCosts(0.01, 0.002, 0.0, 0.0, 0.002))  # each draft dearer
        p.chain_times = RealizedStepTimes(p._chain_cap(), sweep=False, min_drafts=1)
        p.drafted_shape, p.defer_observations = "chain", defer
        return p

    kept, now = chains_on_a_clock(True), chains_on_a_clock(False)
    made = {id(kept): [], id(now): []}
    for _ in range(3 * DECIDE_EVERY):
        for p in (kept, now):
            made[id(p)].append(p.chain_drafts_in_tree_mode(1))
            p.observe(record(shape="chain", chain_verified=[3], chain_accepted=[0], produced=1,
                             seconds=0.02, draft_seconds=0.006))
    assert made[id(kept)] == made[id(now)]
    assert made[id(now)][0] == 2 and made[id(now)][-1] == 1


def test_tree_steps_give_the_chains_realized_times_no_sample():
    p = policy(speculative_token_tree=STATIC)
    p.add_costs(True, 1, StepCosts(1e-3, 0.0, 0.0, 0.0, 0.0))
    # Drafted a tree, verified a tree: neither part is a chain's.
    p.observe(record(shape="tree", verified_tree=True, tree_parents=[[-1, -1, 0]],
                     tree_paths=[[0, 2]], draft_seconds=0.5))
    assert not p.chain_times.buckets.get(1, None) or \
        not (p.chain_times.buckets[1].verify or p.chain_times.buckets[1].draft)
    # Verified a tree, drafted a chain: the draft part includes the tree's reordering.
    p.chain_drafts_in_tree_mode(1)
    p.observe(record(shape="chain", verified_tree=True, tree_parents=[[-1, -1, 0]],
                     tree_paths=[[0, 2]], draft_seconds=0.5))
    bucket = p.chain_times.buckets[1]
    assert not bucket.verify and not bucket.draft
    # Verified chains of 3, drafted a tree: a verify sample only.
    p.observe(record(shape="tree", chain_verified=[3], chain_accepted=[2], seconds=0.01,
                     draft_seconds=0.004))
    assert kept_seconds(bucket.verify) == {3: [pytest.approx(0.006)]}
    assert not bucket.draft
    # Verified chains, drafted a chain of the count decided: both parts.
    d = p.chain_drafts_in_tree_mode(1)
    p.observe(record(shape="chain", chain_verified=[3], chain_accepted=[3], seconds=0.01,
                     draft_seconds=0.004))
    assert kept_seconds(bucket.draft) == {d: [0.004]}


def test_a_decision_is_repeated_for_a_few_steps_but_never_a_probe_or_a_new_cap():
    """DECIDE_EVERY: a chain config's cost policy decides afresh every 4th step of one batch
    size and cap and repeats its choice in between (counted as policy steps, so probes keep
    their spacing); a probe drafts its count once, and so does a decision while a request
    of an outlook has verified no draft; near a batch's end it decides afresh when the cap
    the tokens left allow changes (``useful_drafts``), not every step; steps observed
    meanwhile are folded in before the next fresh decision (``defer_observations``)."""
    from rocdraft.spec_decode.batch_finish import BatchOutlook
    from rocdraft.spec_decode.policy import DECIDE_EVERY

    p = policy(draft_costs=(0.010, 0.0005, 0.0005, 0.0002, 0.0012))
    timer = p.given_times
    fresh = fresh_decisions(timer)
    chosen = [p.num_drafts(1) for _ in range(400)]
    assert timer.buckets[1].steps == 400  # every step counted
    best = max(set(chosen), key=chosen.count)
    probes = [i for i, d in enumerate(chosen) if d != best]
    # a probe is not repeated (counts due together are probed on consecutive steps)
    assert probes and all(chosen[i + 1] != chosen[i] for i in probes if i + 1 < len(chosen))
    # one decision in DECIDE_EVERY, and one more after each probe
    assert len(fresh) <= 400 / DECIDE_EVERY + 2 * len(probes) < 400 / 2
    # a lone request 20 tokens from its end repeats as anywhere else (a new policy: no
    # probe is due in its first MIN_PROBE_INTERVAL = 32 steps) ...
    lone = policy(draft_costs=(0.010, 0.0005, 0.0005, 0.0002, 0.0012))
    lone_fresh = fresh_decisions(lone.given_times)
    for _ in range(2 * DECIDE_EVERY):
        lone.num_drafts(1, BatchOutlook(("a",), (20,)))
    assert len(lone_fresh) == 2
    # ... and decides afresh on every step whose tokens left cap its drafts anew
    for left in (5, 4, 3, 2):  # useful_drafts 3, 2, 1, 0 (0 decides nothing: no drafts)
        lone.num_drafts(1, BatchOutlook(("a",), (left,)))
    assert len(lone_fresh) == 5
    # nor while a request of the outlook has verified no draft (a batch's first steps):
    # its acceptance is the pooled rates' until then
    fresh.clear()
    far = BatchOutlook(("a", "b"), (200,) * 2)
    for _ in range(3):
        p.num_drafts(2, far)
    p.request_acceptance.observe(["a"], [2], [1])
    p.num_drafts(2, far)
    assert len(fresh) == 4
    p.request_acceptance.observe(["b"], [2], [1])
    for _ in range(DECIDE_EVERY):
        p.num_drafts(2, far)
    assert len(fresh) == 5
    # observed steps wait for the next fresh decision
    p.defer_observations = True
    p.realized_times = p.given_times  # (deferral is a realized-times policy's)
    p.observe(record(chain_verified=[2], chain_accepted=[2], num_drafts=2))
    assert p.pending and p.acceptance.verified[0] == 0
    p.flush()
    assert not p.pending and p.acceptance.verified[0] == 1
