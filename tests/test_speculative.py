"""Speculative generation through the engine: lossless greedy and seeded random sampling for
EAGLE-1 and EAGLE-3 heads (k in {1, 2, 4}, padded and unpadded drafting, ragged batches,
chunked prefill, preemption) on every backend of the matrix, lossless random sampling, and
the acceptance statistics.

The lossless tests use cyclic pairs (tests/checkpoints.py): heads right often but not
always, so every test also checks that drafts were accepted (the accept path, the bonus
token, multi-token KV appends) and rejected (the rejected-token bookkeeping). Random heads,
which never agree with their target, are kept for the all-rejected case."""
from __future__ import annotations

import pytest
import torch

from checkpoints import (write_cyclic_eagle1_head, write_cyclic_eagle3_head,
                         write_cyclic_llama, write_eagle1_head, write_eagle3_head,
                         write_tiny_llama)
from rocdraft.config import SamplingParams, SpeculativeConfig
from rocdraft.engine import LLM
from rocdraft.errors import RocdraftError

PROMPTS = [[1, 5, 7, 9], [1, 2], list(range(1, 30)), [4] * 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.9, top_k=50, max_tokens=10, seed=s, ignore_eos=True)
          for s in (11, 12, 13, 14)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A cyclic target with cyclic EAGLE-1 / EAGLE-3 heads (the EAGLE-3 one with a d2t draft
    vocabulary), and a random target with random heads (nothing ever accepted)."""
    root = tmp_path_factory.mktemp("spec")
    target = write_cyclic_llama(root / "target")
    random_target = write_tiny_llama(root / "random_target", kind="deep")
    return {"target": str(target),
            "eagle": str(write_cyclic_eagle1_head(root / "eagle1", target, fmt="bin")),
            "eagle3": str(write_cyclic_eagle3_head(root / "eagle3", target)),
            "random_target": str(random_target),
            "random_eagle": str(write_eagle1_head(root / "random_eagle1", random_target)),
            "random_eagle3": str(write_eagle3_head(root / "random_eagle3", random_target))}


@pytest.fixture(scope="module")
def reference(pair):
    llm = LLM(pair["target"], attention_backend="TORCH_SDPA")
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def seeded_reference(pair):
    llm = LLM(pair["target"], attention_backend="TORCH_SDPA")
    return [o.token_ids for o in llm.generate(PROMPTS, SEEDED)]


def assert_some_accepted_some_rejected(stats, k: int) -> None:
    """Acceptance well above 1 (drafts were accepted, bonus tokens emitted) and below k + 1
    (some were rejected)."""
    assert stats.num_verify_steps > 0
    lower = 1.2 if k == 1 else 1.5
    assert lower < stats.acceptance_length < k + 1, stats.accepted_at_position
    assert len(stats.per_position_acceptance) == k


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_speculative_equals_target_only(pair, reference, method, k, padded,
                                               attention_backend):
    llm = LLM(pair["target"], draft=pair[method], attention_backend=attention_backend,
              speculative_config=SpeculativeConfig(method=method, num_speculative_tokens=k,
                                                   padded_drafting=padded, draft_policy="fixed"),
              max_num_batched_tokens=16)  # forces a chunked prefill next to decodes
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert_some_accepted_some_rejected(llm.last_stats, k)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_seeded_random_speculative_output_equals_seeded_target_only(
        pair, seeded_reference, method, k, padded, attention_backend):
    """Each verified position uses the noise of its output index (seeded per position), so a
    seeded request samples exactly the tokens target-only sampling draws, however many drafts
    each step verified, accepted or rejected."""
    llm = LLM(pair["target"], draft=pair[method], attention_backend=attention_backend,
              speculative_config=SpeculativeConfig(method, k, padded_drafting=padded,
                                                   draft_policy="fixed"),
              max_num_batched_tokens=16)
    assert [o.token_ids for o in llm.generate(PROMPTS, SEEDED)] == seeded_reference
    assert_some_accepted_some_rejected(llm.last_stats, k)


def test_seeded_random_output_does_not_depend_on_the_batch_or_the_budget(pair,
                                                                         seeded_reference):
    """Alone or in a batch, with a budget that trims drafts, the same tokens."""
    for budget in (2048, 12):
        llm = LLM(pair["target"], draft=pair["eagle3"], max_num_batched_tokens=budget,
                  speculative_config=SpeculativeConfig("eagle3", 4, draft_policy="fixed"))
        assert [o.token_ids for o in llm.generate(PROMPTS, SEEDED)] == seeded_reference
        assert llm.last_stats.acceptance_length > 1.5
        assert [o.token_ids for o in llm.generate(PROMPTS[:1], SEEDED[:1])] == \
            seeded_reference[:1]


@pytest.mark.parametrize("tree", [None, "[(0,), (1,), (0, 0), (0, 0, 0)]"],
                         ids=["chain", "tree"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_bfloat16_head_beside_a_float32_target_stays_lossless(
        pair, reference, seeded_reference, method, tree, attention_backend):
    """draft_dtype="bfloat16": the head's weights, KV cache and draft loop buffers are
    bfloat16, the target's stay float32 (and the target's embedding / lm_head the head shares
    stay the target's), greedy and seeded outputs are target-only's, and drafts are still
    accepted (the casts at the head's edges keep its predictions)."""
    spec = SpeculativeConfig(method, 3, draft_policy="fixed", draft_dtype="bfloat16",
                             speculative_token_tree=tree)
    llm = LLM(pair["target"], draft=pair[method], attention_backend=attention_backend,
              speculative_config=spec, max_num_batched_tokens=16,
              graph_mode="replay-eagerly")  # the static buffers a GPU engine captures
    runner = llm.draft_runner
    loop = runner.proposer.graph_runner if tree is None else runner.proposer.tree_runner
    hidden = loop.hidden if tree is None else loop.root_hidden
    assert hidden.dtype == torch.bfloat16  # not the shared embedding's float32
    assert {c.key.dtype for c in runner.kv_caches} == {torch.bfloat16}
    assert runner.head.fc.weight.dtype == torch.bfloat16
    assert llm.model_runner.kv_caches[0].key.dtype == torch.float32
    assert runner.head.embed_tokens.weight.dtype == torch.float32  # the target's, shared
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.last_stats.acceptance_length > 1.5
    if tree is None:  # (seeded once: the tree's levels run the same casts as the chain)
        assert_some_accepted_some_rejected(llm.last_stats, 3)
        assert [o.token_ids for o in llm.generate(PROMPTS, SEEDED)] == seeded_reference
        assert_some_accepted_some_rejected(llm.last_stats, 3)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_random_heads_are_all_rejected_and_stay_lossless(pair, method, attention_backend):
    """A random head never agrees with its random target: acceptance exactly 1, every step
    emits the target's correction token, and the output is still the target's."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    target_only = LLM(pair["random_target"], attention_backend="TORCH_SDPA")
    expected = [o.token_ids for o in target_only.generate(PROMPTS[2:], params)]
    llm = LLM(pair["random_target"], draft=pair[f"random_{method}"],
              attention_backend=attention_backend, max_num_batched_tokens=16,
              speculative_config=SpeculativeConfig(method, 4, draft_policy="fixed"))
    assert [o.token_ids for o in llm.generate(PROMPTS[2:], params)] == expected
    stats = llm.last_stats
    assert stats.num_verify_steps > 0
    assert stats.acceptance_length == 1.0
    assert stats.accepted_at_position == [0, 0, 0, 0]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_unpadded_drafting_gives_the_same_drafts_as_padded(pair, method):
    """The padded path (rejected tokens kept as padding, no host sync) and the unpadded path
    (rejected tokens dropped on the host) must propose identical drafts, so their acceptance
    counters agree step for step."""
    runs = []
    for padded in (True, False):
        llm = LLM(pair["target"], draft=pair[method], max_num_batched_tokens=16,
                  speculative_config=SpeculativeConfig(method=method, num_speculative_tokens=3,
                                                       padded_drafting=padded,
        draft_policy="fixed"))
        outs = llm.generate(PROMPTS, GREEDY)
        s = llm.last_stats
        runs.append(([o.token_ids for o in outs], s.accepted_at_position, s.num_verify_steps))
    assert runs[0] == runs[1]
    assert runs[0][1][0] > 0


def test_speculative_under_kv_pressure_with_preemption(pair, reference):
    llm = LLM(pair["target"], draft=pair["eagle3"], block_size=4, num_kv_blocks=20,
              max_model_len=64, speculative_config=SpeculativeConfig("eagle3", 4,
                                                                     draft_policy="fixed"))
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.last_stats.num_preemptions > 0
    assert llm.last_stats.acceptance_length > 1.5
    assert [o.token_ids for o in outs] == reference


def test_drafting_near_max_model_len_stays_lossless(pair):
    target_only = LLM(pair["target"], max_model_len=20)
    spec = LLM(pair["target"], draft=pair["eagle"], max_model_len=20,
               speculative_config=SpeculativeConfig("eagle", 4, draft_policy="fixed"))
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    expected = [o.token_ids for o in target_only.generate(PROMPTS[:2] + PROMPTS[3:], params)]
    got = [o.token_ids for o in spec.generate(PROMPTS[:2] + PROMPTS[3:], params)]
    assert got == expected
    assert all(len(p) + len(g) == 20 for p, g in zip(PROMPTS[:2] + PROMPTS[3:], got))


def test_eos_inside_an_accepted_chain_stops_the_request(pair, reference):
    """Stop on a token the target emits mid-way: nothing after it is returned, even when
    the stop token sits inside a run of accepted drafts."""
    stop = reference[0][5]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop,))
    llm = LLM(pair["target"], draft=pair["eagle3"], speculative_config=SpeculativeConfig(
        "eagle3", 4, draft_policy="fixed"))
    out = llm.generate(PROMPTS[:1], params)[0]
    assert llm.last_stats.num_accepted_drafts > 0
    assert out.finish_reason == "stop"
    assert out.token_ids == reference[0][:reference[0].index(stop) + 1]


def _first_two_token_distribution(model_path: str, prompt: list[int]) -> tuple:
    """Exact target distributions of the first generated token and of the second token
    (marginalised over the first), from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        vocab = p1.shape[0]
        batch = torch.tensor([prompt + [x] for x in range(vocab)])
        p2_given = model(batch).logits[:, -1].softmax(-1)  # [vocab, vocab]
    return p1, p1 @ p2_given


def test_random_sampling_is_lossless(tmp_path):
    """With temperature 1 on a 12-token vocabulary, the first two tokens produced with
    speculation follow the target's exact distributions (total variation within sampling
    noise: expected ~0.03 at 4000 samples, bound 0.07). A lossy verifier (e.g. always
    accepting drafts) puts most mass on the draft's tokens and fails by a wide margin."""
    target = write_cyclic_llama(tmp_path / "t", noise=1.0, sharpness=4.0, vocab_size=12,
                                tokenizer=False)
    head = write_cyclic_eagle1_head(tmp_path / "h", target)
    prompt = [1, 5, 7]
    p1, p2 = _first_two_token_distribution(str(target), prompt)
    n = 4000
    llm = LLM(str(target), draft=str(head), max_num_seqs=1024, max_num_batched_tokens=4096,
              speculative_config=SpeculativeConfig("eagle", 2, draft_policy="fixed"),
              attention_backend="TORCH_SDPA")
    params = [SamplingParams(temperature=1.0, max_tokens=2, seed=i, ignore_eos=True)
              for i in range(n)]
    outs = llm.generate([prompt] * n, params)
    first = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=12) / n
    second = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=12) / n
    assert 1.3 < llm.last_stats.acceptance_length < 3
    assert 0.5 * (first - p1).abs().sum() < 0.07
    assert 0.5 * (second - p2).abs().sum() < 0.07


def test_speculative_configuration_errors(pair):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("eagle3", 0, draft_policy="fixed")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("eagle3", 17, draft_policy="fixed")
    with pytest.raises(ValueError, match="needs a draft"):
        LLM(pair["target"], speculative_config=SpeculativeConfig("eagle3", 2, draft_policy="fixed"))
    with pytest.raises(RocdraftError, match="EAGLE3 head"):
        LLM(pair["target"], draft=pair["eagle3"],
            speculative_config=SpeculativeConfig("eagle", 2, draft_policy="fixed"))


def test_draft_token_cap_shrinks_drafts_with_the_batch_and_stays_lossless(pair, reference):
    spec = SpeculativeConfig("eagle3", 4, max_draft_tokens_per_step=8, draft_policy="fixed")
    llm = LLM(pair["target"], draft=pair["eagle3"], speculative_config=spec)
    assert [llm.policy.drafts_per_request(b) for b in (1, 2, 3, 4, 8, 9)] == [4, 4, 2, 2, 1, 0]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    # Four copies of one request advance together: at most two drafts each, so positions 3
    # and 4 are never proposed.
    assert [o.token_ids for o in llm.generate(PROMPTS[:1] * 4, GREEDY)] == reference[:1] * 4
    assert llm.last_stats.proposed_at_position[2:] == [0, 0]
    assert llm.last_stats.accepted_at_position[1] > 0
    with pytest.raises(ValueError, match="max_draft_tokens_per_step"):
        SpeculativeConfig("eagle3", 4, max_draft_tokens_per_step=0, draft_policy="fixed")
