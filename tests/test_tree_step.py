"""Tree speculative decoding through the engine (rocdraft/sample/tree_step.py and the tree step of
rocdraft/engine/llm_engine.py): greedy output equals target-only token for token for static (uniform and
EAGLE's non-uniform) and EAGLE-2 dynamic trees, EAGLE-1 and EAGLE-3 heads, padded and unpadded
drafting, ragged batches with chunked prefill, on every backend of the matrix; seeded sampling
equals seeded target-only; unseeded sampling follows the target's distribution; the batch
budget; preemption; a request near max_model_len writes only inside its own blocks.

The cyclic pairs (tests/checkpoints.py) make heads right often but not always, so every test
also asserts that tree nodes were accepted (acceptance length well above 1) and rejected."""
from __future__ import annotations

import pytest
import torch

from checkpoints import write_cyclic_eagle1_head, write_cyclic_eagle3_head, write_cyclic_llama
from rocdraft.backends import registry
from rocdraft.backends.kv_cache import PADDING_SLOT_ID
from rocdraft.config import SamplingParams, SpeculativeConfig
from rocdraft.drafter.tree_spec import EAGLE_DEFAULT_TREE, UNIFORM_TREE_2X2
from rocdraft.engine import LLM
from rocdraft.errors import RocdraftError
from stats import chi_square_p_value

PROMPTS = [[1, 5, 7, 9], [1, 2], list(range(1, 30)), [4] * 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.9, top_k=50, max_tokens=10, seed=s, ignore_eos=True)
          for s in (11, 12, 13, 14)]
TREES = {
    "uniform": dict(speculative_token_tree=str(list(UNIFORM_TREE_2X2))),
    "eagle": dict(speculative_token_tree=EAGLE_DEFAULT_TREE),  # 25 nodes, depth 5
    "dynamic": dict(tree_depth=3, tree_top_k=2, tree_total_tokens=6),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    target = write_cyclic_llama(root / "target")
    return {"target": str(target),
            "eagle": str(write_cyclic_eagle1_head(root / "eagle1", target)),
            "eagle3": str(write_cyclic_eagle3_head(root / "eagle3", target))}


@pytest.fixture(scope="module")
def reference(pair):
    llm = LLM(pair["target"], attention_backend="TORCH_SDPA")
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def tree_llm(pair, method: str, tree: str, **kwargs) -> LLM:
    """An engine drafting ``tree`` at its full size (draft_policy "fixed": the cost policy's
    batch budget is tested on its own below) unless the kwargs say otherwise."""
    spec = {k: kwargs.pop(k) for k in ("padded_drafting", "max_draft_tokens_per_step",
                                       "draft_policy") if k in kwargs}
    spec.setdefault("draft_policy", "fixed")
    return LLM(pair["target"], draft=pair[method],
               speculative_config=SpeculativeConfig(method=method, **TREES[tree], **spec),
               **kwargs)


def assert_nodes_accepted_and_rejected(stats, depth: int) -> None:
    assert stats.num_verify_steps > 0
    assert 1.5 < stats.acceptance_length < depth + 1, stats.accepted_at_position
    assert len(stats.per_position_acceptance) == depth  # acceptance per tree depth
    assert stats.accepted_at_position[0] < stats.proposed_at_position[0]  # some rejected


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("tree", list(TREES))
def test_greedy_tree_speculation_equals_target_only(pair, reference, tree, method, padded,
                                                    attention_backend):
    # 32 tokens per step: the 26-token EAGLE tree next to a prompt chunk (chunked prefill).
    llm = tree_llm(pair, method, tree, padded_drafting=padded, max_num_batched_tokens=32,
                   attention_backend=attention_backend)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    depth = llm.tree.depth
    assert_nodes_accepted_and_rejected(llm.last_stats, depth)
    assert llm.last_stats.nodes_per_verify_step > depth  # a tree, not a chain


@pytest.mark.parametrize("tree", ["uniform", "dynamic"])
def test_seeded_tree_sampling_equals_seeded_target_only(pair, tree):
    """The tree sampler draws the target's own noise per emitted position, so a seeded request
    emits exactly what target-only decoding emits (rocdraft/sample/tree_sampler.py)."""
    expected = [o.token_ids for o in LLM(pair["target"]).generate(PROMPTS, SEEDED)]
    llm = tree_llm(pair, "eagle3", tree)
    assert [o.token_ids for o in llm.generate(PROMPTS, SEEDED)] == expected
    assert llm.last_stats.acceptance_length > 1.3


def _first_two_token_distribution(model_path: str, prompt: list[int]) -> tuple:
    """Exact target distributions of the first token and of (first, second) jointly."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        vocab = p1.shape[0]
        p2_given = model(torch.tensor([prompt + [x] for x in range(vocab)])).logits[:, -1] \
            .softmax(-1)  # [vocab, vocab]
    return p1, p1.unsqueeze(1) * p2_given


@pytest.mark.parametrize("tree", ["uniform", "dynamic"])
def test_unseeded_tree_sampling_follows_the_target_distribution(tmp_path, tree):
    """Temperature 1 on a 12-token vocabulary, 4000 unseeded requests: the first token and the
    (first, second) pair follow the target's exact distributions (total variation of the
    first within 0.07, chi-square of the joint p > 1e-3) while tree nodes are accepted. A
    verifier that accepts a matching child with probability 1 instead of p fails both."""
    target = write_cyclic_llama(tmp_path / "t", noise=1.0, sharpness=4.0, vocab_size=12,
                                tokenizer=False)
    head = write_cyclic_eagle1_head(tmp_path / "h", target)
    prompt = [1, 5, 7]
    p1, joint = _first_two_token_distribution(str(target), prompt)
    n = 4000
    trees = {"uniform": dict(speculative_token_tree="[(0,), (1,), (0, 0), (0, 1), (1, 0)]"),
             "dynamic": dict(tree_depth=2, tree_top_k=3, tree_total_tokens=6)}
    llm = LLM(str(target), draft=str(head), max_num_seqs=1024, max_num_batched_tokens=8192,
              speculative_config=SpeculativeConfig("eagle", **trees[tree]),
              attention_backend="TORCH_SDPA")
    torch.manual_seed(0)
    params = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
    outs = llm.generate([prompt] * n, params)
    pairs = torch.tensor([o.token_ids[:2] for o in outs])
    first = torch.bincount(pairs[:, 0], minlength=12) / n
    counts = torch.bincount(pairs[:, 0] * 12 + pairs[:, 1], minlength=144).double()
    assert 0.5 * (first - p1).abs().sum() < 0.07
    assert chi_square_p_value(counts, joint.reshape(-1).double(), min_prob=2e-3) > 1e-3
    assert 1.3 < llm.last_stats.acceptance_length < 3


def test_dynamic_tree_batch_budget_bounds_nodes_per_step_and_stays_lossless(pair, reference):
    """max_draft_tokens_per_step: the batch's nodes are chosen by a global top-N, so a step
    verifies at most N nodes over its requests (4 prompts, N 8: 2 per request on average)."""
    llm = tree_llm(pair, "eagle3", "dynamic", max_draft_tokens_per_step=8)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    stats = llm.last_stats
    assert stats.acceptance_length > 1.3
    assert stats.nodes_per_verify_step < 5  # the full tree has 5 nodes per request


def test_tree_speculation_under_kv_pressure_with_preemption(pair, reference):
    llm = tree_llm(pair, "eagle3", "dynamic", block_size=4, num_kv_blocks=24,
                   max_model_len=64)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.last_stats.num_preemptions > 0
    assert llm.last_stats.acceptance_length > 1.5
    assert [o.token_ids for o in outs] == reference


def _record_writes(monkeypatch) -> list:
    """Record (slot_mapping, block_table, query_start_loc) of every TORCH_SDPA KV write."""
    impl = registry.get_backend("TORCH_SDPA").impl_cls
    calls, forward = [], impl.forward

    def recording(self, query, key, value, kv_cache, metadata):
        common = metadata.common
        calls.append((common.slot_mapping.clone(), common.block_table.clone(),
                      common.query_start_loc.clone(), kv_cache.block_size))
        return forward(self, query, key, value, kv_cache, metadata)

    monkeypatch.setattr(impl, "forward", recording)
    return calls


@pytest.mark.parametrize("tree", ["eagle", "dynamic"])
def test_near_max_model_len_trees_write_only_inside_their_blocks(pair, monkeypatch, tree):
    """max_model_len 24: requests reach the end while drafting 25-node (EAGLE) or fed-frontier
    (dynamic) trees past it. Every KV write of the target and of the head lands in the
    writing request's own blocks or is padding, and outputs equal target-only's."""
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    expected = [o.token_ids for o in LLM(pair["target"], max_model_len=24,
                                          attention_backend="TORCH_SDPA").generate(prompts,
                                                                                  params)]
    calls = _record_writes(monkeypatch)
    llm = tree_llm(pair, "eagle3", tree, max_model_len=30 if tree == "eagle" else 24,
                   attention_backend="TORCH_SDPA")
    if tree == "eagle":  # 26 tokens verified: max_model_len must exceed them
        expected = [o.token_ids for o in LLM(pair["target"], max_model_len=30,
                                              attention_backend="TORCH_SDPA").generate(
                                                  prompts, params)]
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert all(len(p) + len(g) == llm.max_model_len for p, g in zip(prompts, got))
    assert llm.last_stats.num_accepted_drafts > 0
    checked = 0
    for slots, table, qsl, block_size in calls:
        req = torch.searchsorted(qsl[1:].long(), torch.arange(slots.shape[0]), right=True)
        for token, slot in enumerate(slots.tolist()):
            if slot == PADDING_SLOT_ID:
                continue
            own = table[int(req[token])].tolist()
            assert slot // block_size in own, (slot, own)
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "ROCM_AITER_FA"])
@pytest.mark.parametrize("role", ["attention_backend", "draft_attention_backend"])
@pytest.mark.parametrize("tree", ["uniform", "dynamic"])
def test_backends_without_tree_masks_are_refused_before_weights_load(tmp_path, backend, role,
                                                                     tree):
    missing = str(tmp_path / "no_such_checkpoint")  # loading anything would fail differently
    with pytest.raises(RocdraftError) as exc:
        LLM(missing, draft=missing, speculative_config=SpeculativeConfig(**TREES[tree]),
            **{role: backend})
    message = str(exc.value)
    assert f"{backend} does not support tree_drafting" in message
    assert "TORCH_SDPA" in message and "TRITON_ATTN" in message and "\n" not in message


def test_chain_config_is_unchanged_by_the_tree_path(pair, reference):
    """num_speculative_tokens keeps meaning the chain: no spec_mask, no parents."""
    llm = LLM(pair["target"], draft=pair["eagle3"], speculative_config=SpeculativeConfig(
        "eagle3", 3, draft_policy="fixed"))
    assert llm.tree is None and llm.draft_runner.proposer.tree_drafter is None
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert len(llm.last_stats.per_position_acceptance) == 3


def _recorded_budgets(llm: LLM) -> list[tuple[int, int | None]]:
    """(batch size, budget) of every tree the engine drafts from now on."""
    budgets, choose = [], llm.policy.tree_budget
    llm.policy.tree_budget = lambda b: budgets.append((b, choose(b))) or budgets[-1][1]
    return budgets


def test_cost_policy_budgets_dynamic_trees_from_costs_and_measured_acceptance(pair,
                                                                                reference):
    """Under the cost policy a dynamic tree's batch budget comes from the step costs and the
    acceptance measured on full-size trees (rocdraft/spec_decode/tree_budget.py): full trees first, then
    dear verification keeps one node per request while cheap verification and levels keep
    the full trees; greedy output is the target's either way."""
    chosen = {}
    for name, costs in (("dear", (1.0, 5.0, 0.0, 0.0, 0.1)), ("cheap", (1.0, 1e-4, 0, 0, 1e-4))):
        spec = SpeculativeConfig("eagle3", **TREES["dynamic"], draft_costs=costs)
        llm = LLM(pair["target"], draft=pair["eagle3"], speculative_config=spec)
        assert llm.policy.tree_acceptance is not None
        budgets = _recorded_budgets(llm)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
        assert budgets[0][1] is None and llm.policy.tree_acceptance.accepted is not None  # full first
        chosen[name] = budgets[1:]
        assert llm.last_stats.acceptance_length > 1.2
    cut = [(b, n) for b, n in chosen["dear"] if n is not None]
    assert len(cut) > len(chosen["dear"]) // 2 and all(n == b for b, n in cut)
    assert all(n is None for _, n in chosen["cheap"])

def test_tree_step_costs_are_measured_per_bucket(pair, reference):
    """Without given costs the engine measures tree steps (the levels' cost as draft_step);
    a fixed budget or policy turns the cost budget off."""
    llm = LLM(pair["target"], draft=pair["eagle3"],
              speculative_config=SpeculativeConfig("eagle3", **TREES["dynamic"]))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert sorted(llm.policy.step_costs) == [1, 2, 4]
    assert all(c.draft_step > 0 and c.target_fixed > 0 for c in llm.policy.step_costs.values())
    for extra in (dict(max_draft_tokens_per_step=8), dict(draft_policy="fixed")):
        other = LLM(pair["target"], draft=pair["eagle3"],
                    speculative_config=SpeculativeConfig("eagle3", **TREES["dynamic"], **extra))
        assert other.policy.tree_acceptance is None
