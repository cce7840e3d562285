"""Speculative generation through the engine: lossless greedy for EAGLE-1 and EAGLE-3 heads
(k in {1, 2, 4}, ragged batches, chunked prefill, preemption, padded and unpadded drafting)
on every backend of the matrix, lossless random sampling, and the acceptance statistics."""
from __future__ import annotations

import pytest
import torch

from checkpoints import write_eagle1_head, write_eagle3_head, write_tiny_llama
from rocdraft.config import SamplingParams, SpeculativeConfig
from rocdraft.engine import LLM
from rocdraft.errors import RocdraftError

PROMPTS = [[1, 5, 7, 9], [1, 2], list(range(1, 30)), [4] * 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = write_tiny_llama(root / "target", kind="deep")
    return {"target": str(target),
            "eagle": str(write_eagle1_head(root / "eagle1", target, fmt="bin")),
            "eagle3": str(write_eagle3_head(root / "eagle3", target))}


@pytest.fixture(scope="module")
def reference(pair):
    llm = LLM(pair["target"], attention_backend="TORCH_SDPA")
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_speculative_equals_target_only(pair, reference, method, k, attention_backend):
    llm = LLM(pair["target"], draft=pair[method], attention_backend=attention_backend,
              speculative_config=SpeculativeConfig(method=method, num_speculative_tokens=k),
              max_num_batched_tokens=16)  # forces a chunked prefill next to decodes
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    stats = llm.last_stats
    assert stats.num_verify_steps > 0
    assert 1.0 <= stats.acceptance_length <= k + 1
    assert len(stats.per_position_acceptance) == k


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_unpadded_drafting_gives_the_same_drafts_as_padded(pair, method):
    """The padded path (rejected tokens kept as padding, no host sync) and the unpadded path
    (rejected tokens dropped on the host) must propose identical drafts, so their acceptance
    counters agree step for step."""
    runs = []
    for padded in (True, False):
        llm = LLM(pair["target"], draft=pair[method], max_num_batched_tokens=16,
                  speculative_config=SpeculativeConfig(method=method, num_speculative_tokens=3,
                                                       padded_drafting=padded))
        outs = llm.generate(PROMPTS, GREEDY)
        s = llm.last_stats
        runs.append(([o.token_ids for o in outs], s.accepted_at_position, s.num_verify_steps))
    assert runs[0] == runs[1]


def test_speculative_under_kv_pressure_with_preemption(pair, reference):
    llm = LLM(pair["target"], draft=pair["eagle3"], block_size=4, num_kv_blocks=20,
              max_model_len=64, speculative_config=SpeculativeConfig("eagle3", 4))
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.last_stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference


def test_drafting_near_max_model_len_stays_lossless(pair):
    target_only = LLM(pair["target"], max_model_len=20)
    spec = LLM(pair["target"], draft=pair["eagle"], max_model_len=20,
               speculative_config=SpeculativeConfig("eagle", 4))
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
        "eagle3", 4))
    out = llm.generate(PROMPTS[:1], params)[0]
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
    target = write_tiny_llama(tmp_path / "t", kind="deep", vocab_size=12, tokenizer=False)
    head = write_eagle1_head(tmp_path / "h", target)
    prompt = [1, 5, 7]
    p1, p2 = _first_two_token_distribution(str(target), prompt)
    n = 4000
    llm = LLM(str(target), draft=str(head), max_num_seqs=1024, max_num_batched_tokens=4096,
              speculative_config=SpeculativeConfig("eagle", 2), attention_backend="TORCH_SDPA")
    params = [SamplingParams(temperature=1.0, max_tokens=2, seed=i, ignore_eos=True)
              for i in range(n)]
    outs = llm.generate([prompt] * n, params)
    first = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=12) / n
    second = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=12) / n
    assert llm.last_stats.num_verify_steps > 0
    assert 0.5 * (first - p1).abs().sum() < 0.07
    assert 0.5 * (second - p2).abs().sum() < 0.07


def test_speculative_configuration_errors(pair):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("eagle3", 0)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("eagle3", 17)
    with pytest.raises(ValueError, match="needs a draft"):
        LLM(pair["target"], speculative_config=SpeculativeConfig("eagle3", 2))
    with pytest.raises(RocdraftError, match="EAGLE3 head"):
        LLM(pair["target"], draft=pair["eagle3"], speculative_config=SpeculativeConfig("eagle", 2))


def test_seeded_random_speculative_output_equals_seeded_target_only(pair):
    """Each verified position uses the noise of its output index (seeded per position), so a
    seeded request samples exactly the tokens target-only sampling draws, however many drafts
    each step verified and whoever shares the batch."""
    params = [SamplingParams(temperature=0.9, top_k=50, max_tokens=14, seed=s, ignore_eos=True)
              for s in (11, 12, 13, 14)]
    base = [o.token_ids for o in LLM(pair["target"]).generate(PROMPTS, params)]
    for k, budget in ((2, 2048), (4, 2048), (4, 12)):  # a tight budget trims drafts
        llm = LLM(pair["target"], draft=pair["eagle3"], max_num_batched_tokens=budget,
                  speculative_config=SpeculativeConfig("eagle3", k))
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == base
        assert [o.token_ids for o in llm.generate(PROMPTS[:1], params[:1])] == base[:1]


def test_draft_token_cap_shrinks_drafts_with_the_batch_and_stays_lossless(pair, reference):
    spec = SpeculativeConfig("eagle3", 4, max_draft_tokens_per_step=8)
    llm = LLM(pair["target"], draft=pair["eagle3"], speculative_config=spec)
    assert [llm.drafts_per_request(b) for b in (1, 2, 3, 4, 8, 9)] == [4, 4, 2, 2, 1, 0]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    # Four requests: at most two drafts each, so positions 3 and 4 are never proposed.
    assert llm.last_stats.proposed_at_position[2:] == [0, 0]
    assert llm.last_stats.proposed_at_position[1] > 0
    with pytest.raises(ValueError, match="max_draft_tokens_per_step"):
        SpeculativeConfig("eagle3", 4, max_draft_tokens_per_step=0)
