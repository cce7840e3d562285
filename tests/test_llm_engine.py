"""LLMEngine and LLM (rocdraft/engine/llm_engine.py, llm.py): equality with transformers,
continuous batching, chunked prefill, preemption under KV pressure, seeded sampling, bad
requests failing alone, the step API, and the draft policy seen through the engine."""
from __future__ import annotations

import pytest
import torch

from checkpoints import write_tiny_llama
from rocdraft.config import SamplingParams, SpeculativeConfig
from rocdraft.engine import LLM
from rocdraft.errors import RocdraftError

PROMPTS = [[1, 5, 7, 9], [1, 2], list(range(1, 30)), [4] * 11, [1, 9, 3]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    return {kind: write_tiny_llama(root / kind, kind=kind) for kind in ("llama", "llama3", "qwen2")}


def hf_greedy(path, prompt: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2"])
def test_greedy_equals_transformers_batched_with_chunked_prefill(checkpoints, kind,
                                                                  attention_backend):
    path = checkpoints[kind]
    # A 16-token budget forces the 29-token prompt through two chunked-prefill steps while
    # the other requests decode in the same batches.
    llm = LLM(str(path), attention_backend=attention_backend, max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(path, prompt, 8), prompt
        assert out.finish_reason == "length"


def test_kv_pressure_preempts_and_every_request_matches_its_solo_run(checkpoints):
    path = str(checkpoints["llama"])
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    solo = LLM(path)
    expected = [solo.generate([p], params)[0].token_ids for p in PROMPTS]
    # 18 blocks of 4 tokens hold one full-length request (64 tokens) but not all five.
    tight = LLM(path, block_size=4, num_kv_blocks=18, max_model_len=64)
    outs = tight.generate(PROMPTS, params)
    assert tight.last_stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected


def test_max_num_seqs_and_different_lengths(checkpoints):
    path = str(checkpoints["llama"])
    llm = LLM(path, max_num_seqs=2)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 1, 5, 2)]
    outs = llm.generate(PROMPTS, params)
    assert [len(o.token_ids) for o in outs] == [3, 9, 1, 5, 2]


def test_stop_token_ids_end_a_request_early(checkpoints):
    path = str(checkpoints["llama"])
    llm = LLM(path)
    free = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8,
                                                     ignore_eos=True))[0].token_ids
    stop = free[3]
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8,
                                                    stop_token_ids=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free[:free.index(stop) + 1]


def test_seeded_sampling_is_reproducible_and_independent_of_neighbours(checkpoints):
    path = str(checkpoints["llama3"])
    llm = LLM(path)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=10, seed=1234,
                            ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=4, seed=7, ignore_eos=True)
    batched = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], [other, params, other])
    assert batched[1].token_ids == alone
    assert llm.generate([PROMPTS[0]], params)[0].token_ids == alone


def test_bad_requests_fail_alone(checkpoints):
    path = str(checkpoints["llama"])
    llm = LLM(path, max_model_len=40)
    prompts = [[], [1, 500, 2], list(range(1, 60)), [1, 2, 3], "text prompt"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [o.finish_reason for o in outs[:3]] == ["error"] * 3
    assert "empty prompt" in outs[0].error
    assert "500" in outs[1].error
    assert "max_model_len 40" in outs[2].error
    assert outs[3].finish_reason == "length" and len(outs[3].token_ids) == 4
    assert outs[4].finish_reason == "length"  # the tiny checkpoint ships a tokenizer


def test_generation_stops_at_max_model_len(checkpoints):
    llm = LLM(str(checkpoints["llama"]), max_model_len=12)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=50,
                                                    ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(PROMPTS[0]) + len(out.token_ids) == 12


def test_engine_argument_errors(checkpoints, tmp_path):
    path = str(checkpoints["llama"])
    with pytest.raises(RocdraftError, match="cannot hold one request"):
        LLM(path, block_size=4, num_kv_blocks=2)
    with pytest.raises(RocdraftError, match="no GPU"):
        if torch.cuda.is_available():
            pytest.skip("a GPU is visible")
        LLM(path, device="cuda")
    with pytest.raises(ValueError, match="dtype"):
        LLM(path, dtype="int8")
    with pytest.raises(RocdraftError):
        LLM(str(tmp_path / "missing"))
    llm = LLM(path)
    with pytest.raises(RocdraftError, match="2 sampling params for 1 prompts"):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()])


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(num_kv_blocks=0), "num_kv_blocks must be >= 1, got 0"),
    (dict(max_model_len=0), "max_model_len must be >= 1, got 0"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1, got 0"),
    (dict(draft="/some/head"), "without speculative_config"),
])
def test_engine_rejects_bad_sizes_and_a_stray_draft(checkpoints, kwargs, fragment):
    with pytest.raises(RocdraftError, match=fragment):
        LLM(str(checkpoints["llama"]), **kwargs)


def test_prompts_that_cannot_run_fail_alone(checkpoints):
    """Text without a UTF-8 form, bytes, and non-integer token ids each fail their own request
    (one line naming the problem); the others complete as if alone."""
    llm = LLM(str(checkpoints["llama"]))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    alone = llm.generate([[1, 5, 7]], params)[0].token_ids
    prompts = ["caf\udcff", b"\x01\x05\x07", [1, 5.0, 7], [1, True, 7],
               torch.tensor([1.0, 5.0]), [1, 5, 7], torch.tensor([1, 5, 7]), "hello", [[1, 5]]]
    outs = llm.generate(prompts, params)
    for out, fragments in zip(outs, [("not valid UTF-8", "0xff"), ("bytes", "str", "int"),
                                     ("index 1", "5.0", "float"), ("index 1", "True", "bool"),
                                     ("index 0", "1.0", "float"), (), (), (),
                                     ("index 0", "[1, 5]", "list")]):
        if fragments:
            assert out.finish_reason == "error" and out.token_ids == [], out
            assert "\n" not in out.error
            assert all(f in out.error for f in fragments), (fragments, out.error)
        else:
            assert out.finish_reason == "length" and out.error is None
    assert outs[5].token_ids == alone and outs[6].token_ids == alone
    assert len(outs[7].token_ids) == 3


@pytest.mark.parametrize("prompts, sampling_params, fragment", [
    ([[1, 2], [3, 4]], [SamplingParams(), "greedy"], "sampling_params[1] is a str"),
    ([[1, 2]], [None], "sampling_params[0] is a NoneType"),
    ([[1, 2]], {"temperature": 0.0}, "got dict"),
    ([[1, 2]], [], "0 sampling params for 1 prompts"),
    ([[1, 2], [3]], (SamplingParams(),), "1 sampling params for 2 prompts"),
    ("hello", None, "got str"),
])
def test_bad_sampling_params_list_is_refused_before_anything_runs(checkpoints, prompts,
                                                                  sampling_params, fragment):
    llm = LLM(str(checkpoints["llama"]))
    with pytest.raises(RocdraftError) as exc:
        llm.generate(prompts, sampling_params)
    assert fragment in str(exc.value), str(exc.value)
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2))[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(block_size=16.0), "block_size must be an integer, got 16.0 (float)"),
    (dict(max_num_seqs=True), "max_num_seqs must be an integer, got True (bool)"),
    (dict(max_model_len=2.5), "max_model_len must be an integer or None, got 2.5"),
])
def test_engine_sizes_must_be_integers(checkpoints, kwargs, fragment):
    with pytest.raises(RocdraftError) as exc:
        LLM(str(checkpoints["llama"]), **kwargs)
    assert fragment in str(exc.value)


@pytest.mark.parametrize("var, value, fragments", [
    ("ROCDRAFT_ATTENTION_BACKEND", "NO_SUCH", ("ROCDRAFT_ATTENTION_BACKEND='NO_SUCH'",
                                               "TORCH_SDPA")),
    ("ROCDRAFT_HIP_KERNELS", "maybe", ("ROCDRAFT_HIP_KERNELS='maybe'", "off")),
    ("ROCDRAFT_AITER_ASM_LAYOUT", "2", ("ROCDRAFT_AITER_ASM_LAYOUT='2'", "yes")),
])
def test_bad_environment_variables_name_the_variable(checkpoints, monkeypatch, var, value,
                                                     fragments):
    monkeypatch.setenv(var, value)
    with pytest.raises(RocdraftError) as exc:
        LLM(str(checkpoints["llama"]))
    for fragment in fragments:
        assert fragment in str(exc.value), (fragment, str(exc.value))


# --- speculative step: draft-count policy and ops per step -------------------------------

SPEC_PROMPTS = [[1, 5, 7, 9], [1, 2], list(range(1, 30)), [4] * 11]
SPEC_GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def cyclic_pair(tmp_path_factory):
    """A target and a random EAGLE-3 head (drafts rejected: the policy's choice is visible
    only through the counts; outputs must not depend on it)."""
    from checkpoints import write_eagle3_head

    root = tmp_path_factory.mktemp("policy")
    target = write_tiny_llama(root / "target", kind="deep")
    head = write_eagle3_head(root / "eagle3", target)
    reference = [o.token_ids for o in LLM(str(target)).generate(SPEC_PROMPTS, SPEC_GREEDY)]
    return str(target), str(head), reference


@pytest.mark.parametrize("draft_costs, drafts_verified", [
    ((1.0, 0.0, 0.0, 0.0, 0.0), "all"),  # verification and drafts free: k
    ((1e-3, 1.0, 0.0, 1.0, 1.0), "none"),  # every extra token costs a full step: never
    (None, "any"),  # measured at start-up
])
def test_draft_policy_keeps_greedy_outputs_identical_to_target_only(cyclic_pair, draft_costs,
                                                                    drafts_verified):
    from rocdraft.config import SpeculativeConfig

    target, head, reference = cyclic_pair
    spec = SpeculativeConfig("eagle3", 3, draft_costs=draft_costs)
    llm = LLM(target, draft=head, speculative_config=spec)
    assert [o.token_ids for o in llm.generate(SPEC_PROMPTS, SPEC_GREEDY)] == reference
    proposed = llm.last_stats.proposed_at_position
    if drafts_verified == "all":  # k on every step but a request's last ones, where
        # fewer drafts can still yield tokens (rocdraft/spec_decode/batch_finish.py useful_drafts)
        assert proposed[0] == llm.last_stats.num_verify_steps > 0
        assert proposed[2] >= 0.75 * llm.last_stats.num_verify_steps
    elif drafts_verified == "none":
        assert llm.last_stats.num_verify_steps == 0
    else:
        assert sorted(llm.policy.step_costs) == [1, 2, 4]  # buckets up to the 4 prompts
        # the engine's steps were folded in a few at a time, and all of them by the end
        assert llm.policy.defer_observations and llm.policy.pending == []
        assert llm.policy.realized_times.buckets[4].samples > 0


def test_step_costs_are_measured_once_per_engine(cyclic_pair):
    from rocdraft.config import SpeculativeConfig

    target, head, reference = cyclic_pair
    llm = LLM(target, draft=head, speculative_config=SpeculativeConfig("eagle3", 2))
    llm.generate(SPEC_PROMPTS[:2], SPEC_GREEDY)
    first = dict(llm.policy.step_costs)
    assert sorted(first) == [1, 2] and all(c.target_fixed + c.target_per_token > 0
                                           for c in first.values())
    assert [o.token_ids for o in llm.generate(SPEC_PROMPTS, SPEC_GREEDY)] == reference
    assert sorted(llm.policy.step_costs) == [1, 2, 4]  # the larger batch's bucket is added...
    assert all(llm.policy.step_costs[b] is first[b] for b in first)  # ...the others kept
    again = dict(llm.policy.step_costs)
    llm.generate(SPEC_PROMPTS, SPEC_GREEDY)
    assert llm.policy.step_costs == again
    # The "fixed" policy and given costs never measure.
    fixed = LLM(target, draft=head,
                speculative_config=SpeculativeConfig("eagle3", 2, draft_policy="fixed"))
    assert [o.token_ids for o in fixed.generate(SPEC_PROMPTS, SPEC_GREEDY)] == reference
    assert fixed.policy.step_costs == {}


def test_measure_step_costs_up_front_covers_every_bucket(cyclic_pair):
    """A server measures before it accepts requests (rocdraft serve), so no request's first
    step pays for it; later batches find their bucket measured and add nothing."""
    target, head, reference = cyclic_pair
    llm = LLM(target, draft=head, speculative_config=SpeculativeConfig("eagle3", 2),
              max_num_seqs=5)
    llm.measure_step_costs()
    assert sorted(llm.policy.step_costs) == [1, 2, 4, 8]  # 8: the bucket of 5
    measured = dict(llm.policy.step_costs)
    assert [o.token_ids for o in llm.generate(SPEC_PROMPTS, SPEC_GREEDY)] == reference
    assert llm.policy.step_costs == measured
    # No cost policy, given costs or no head: nothing to measure.
    for other in (LLM(target, draft=head, speculative_config=SpeculativeConfig(
                      "eagle3", 2, draft_costs=(1.0, 0.1, 0.0, 0.0, 0.1))), LLM(target)):
        other.measure_step_costs()
        assert getattr(other, "step_costs", {}) == {}


def count_ops(fn):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.n += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        result = fn()
    return Counter.n, result


def test_greedy_rejection_without_drafts_is_one_op():
    from rocdraft.sample.rejection_sampler import rejection_sample
    from rocdraft.sample.sampler import SamplingTensors

    logits = torch.randn(8, 1, 32)
    sampling = SamplingTensors.build([SamplingParams(temperature=0.0)] * 8, [None] * 8, "cpu")
    drafts, num_drafts = torch.zeros(8, 0, dtype=torch.long), torch.zeros(8, dtype=torch.long)
    ops, out = count_ops(lambda: rejection_sample(logits, drafts, num_drafts, [0] * 8, sampling))
    assert ops == 1 and out.tolist() == logits.argmax(-1).tolist()


def test_cost_measurement_fits_small_engine_limits(cyclic_pair):
    """Buckets round up past max_num_seqs and k + 1 tokens per request may exceed the token
    budget: the measurement stays within both (the proposer refuses larger batches)."""
    from rocdraft.config import SpeculativeConfig

    target, head, reference = cyclic_pair
    llm = LLM(target, draft=head, speculative_config=SpeculativeConfig("eagle3", 4),
              max_num_seqs=3, max_num_batched_tokens=8)
    assert [o.token_ids for o in llm.generate(SPEC_PROMPTS, SPEC_GREEDY)] == reference
    assert sorted(llm.policy.step_costs) == [1, 2, 4]


# --- the step API (LLMEngine): requests joining and leaving between steps ---------------

@pytest.fixture(scope="module")
def accepting_pair(tmp_path_factory):
    """A cyclic target and an EAGLE-3 head that is right most of the time (drafts accepted)."""
    from checkpoints import write_cyclic_eagle3_head, write_cyclic_llama

    root = tmp_path_factory.mktemp("step_api")
    target = write_cyclic_llama(root / "target")
    head = write_cyclic_eagle3_head(root / "eagle3", target)
    return str(target), str(head)


def _spec_engine(pair, cls=None, **kwargs):
    from rocdraft.config import SpeculativeConfig
    from rocdraft.engine import LLMEngine

    target, head = pair
    cls = cls or LLMEngine
    return cls(target, draft=head, speculative_config=SpeculativeConfig(
        "eagle3", 3, draft_policy="fixed"), **kwargs)


def _run_staggered(engine, prompts, params, arrivals):
    """Add prompt i before step arrivals[i]; step to the end -> (outputs by id, new tokens
    streamed per id, steps)."""
    final, streamed, step = {}, {i: [] for i in range(len(prompts))}, 0
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(i, prompts[i], params)
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
            assert out.token_ids == streamed[out.request_id]
            if out.finished:
                final[out.request_id] = out
        step += 1
    return final, streamed


def test_staggered_arrivals_give_the_outputs_of_one_batch(accepting_pair):
    from rocdraft.engine import LLM

    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    reference = LLM(accepting_pair[0]).generate(SPEC_PROMPTS, params)
    engine = _spec_engine(accepting_pair)
    final, streamed = _run_staggered(engine, SPEC_PROMPTS, params, arrivals=[0, 3, 1, 7])
    assert [final[i].token_ids for i in range(4)] == [o.token_ids for o in reference]
    assert all(final[i].finish_reason == "length" for i in range(4))
    assert engine.stats.acceptance_length > 1.5  # drafts were accepted across the arrivals
    assert max(final[i].acceptance_length for i in range(4)) > 1.5
    assert engine.num_free_blocks == engine.num_blocks and not engine.has_unfinished_requests()


def test_abort_frees_every_block_and_leaves_the_others_unchanged(accepting_pair):
    from rocdraft.engine import LLM

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = LLM(accepting_pair[0]).generate(SPEC_PROMPTS, params)
    engine = _spec_engine(accepting_pair, max_num_batched_tokens=16)
    for i, prompt in enumerate(SPEC_PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    seen = {f"r{i}": [] for i in range(4)}
    for _ in range(3):  # r2 (29 tokens) is still in chunked prefill; r1 is decoding
        for out in engine.step():
            seen[out.request_id] += out.new_token_ids
    assert seen["r1"] and engine.num_running >= 2
    assert engine.abort_request("r1") and engine.abort_request("r2")
    assert not engine.abort_request("r1") and not engine.abort_request("nope")
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id in ("r0", "r3")
            if out.finished:
                final[out.request_id] = out
    assert final["r0"].token_ids == reference[0].token_ids
    assert final["r3"].token_ids == reference[3].token_ids
    assert engine.num_free_blocks == engine.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
    # A waiting request can be aborted too, and the engine is then empty.
    engine.add_request("w", SPEC_PROMPTS[0], params)
    assert engine.num_waiting == 1 and engine.abort_request("w")
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_add_request_refuses_bad_input_and_changes_nothing(accepting_pair):
    engine = _spec_engine(accepting_pair, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    engine.add_request("a", [1, 2, 3], params)
    for request_id, prompt, sp, fragment in [
        ("a", [1, 2], params, "already in flight"),
        ("b", [], params, "empty prompt"),
        ("c", [1, 10_000], params, "outside the vocabulary"),
        ("d", [1] * 64, params, "does not fit max_model_len 64"),
        ("e", [1, "x"], params, "token id at index 1"),
        ("f", [1, 2], {"temperature": 0}, "not a SamplingParams"),
    ]:
        with pytest.raises(RocdraftError, match=fragment):
            engine.add_request(request_id, prompt, sp)
    assert list(engine.requests) == ["a"] and engine.num_waiting == 1
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == "a" and outs[-1].finished and len(outs[-1].token_ids) == 4


def test_generate_refuses_to_mix_with_requests_in_flight(accepting_pair):
    from rocdraft.engine import LLM

    llm = _spec_engine(accepting_pair, cls=LLM)
    llm.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RocdraftError, match="1 requests added with add_request"):
        llm.generate([[1, 2]])
    while llm.has_unfinished_requests():
        llm.step()
    assert len(llm.generate([[1, 2]], SamplingParams(max_tokens=3))[0].token_ids) == 3
    assert llm.stats.generated_tokens >= 3 + 2  # engine-wide counters include both


def test_cost_policy_with_given_costs_follows_acceptance_as_it_drifts(accepting_pair):
    """Fixed synthetic costs (verification cheap, so a good head pays at d = 3): the policy
    drafts 3 while drafts are accepted, drops to 0 while the head is made useless (its
    drafts shifted by one token), and drafts again once it is good again (the probes see
    its drafts accepted). Greedy outputs equal target-only's throughout."""
    from rocdraft.config import SpeculativeConfig
    from rocdraft.spec_decode.draft_runner import ChainDrafts

    target, head = accepting_pair
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    prompt = [[1, 5, 7, 9]]
    reference = [o.token_ids for o in LLM(target).generate(prompt, params)]
    llm = LLM(target, draft=head, speculative_config=SpeculativeConfig(
        "eagle3", 3, draft_costs=(1.0, 0.1, 0.0, 0.0, 0.1)))
    chosen, useless = [], range(40, 200)  # policy steps whose drafts are wrong
    num_drafts, propose = llm.policy.num_drafts, llm.draft_runner.propose_chain

    def recording(batch_size, outlook=None, prefill=False):
        chosen.append(num_drafts(batch_size, outlook, prefill))
        return chosen[-1]

    def maybe_wrong(*args, **kwargs):
        drafts = propose(*args, **kwargs)
        if len(chosen) in useless:
            return ChainDrafts((drafts.tokens + 1) % llm.model_runner.target.config.vocab_size)
        return drafts

    llm.policy.num_drafts, llm.draft_runner.propose_chain = recording, maybe_wrong
    while len(chosen) < 400:  # one request after another: the policy's state carries over
        assert [o.token_ids for o in llm.generate(prompt, params)] == reference
    good, bad, again = chosen[5:40], chosen[120:200], chosen[-100:]
    assert good.count(3) / len(good) > 0.9, good
    assert bad.count(0) / len(bad) > 0.9, "".join(map(str, chosen))
    assert again.count(3) / len(again) > 0.9, again


def test_the_cost_policy_reads_the_batch_outlook_when_the_batch_is_all_the_work(
        accepting_pair):
    """generate() with EOS ignored: every decision sees the batch's requests and the tokens
    each has left (no request waits), which shrink as they are produced; with EOS honoured
    it sees none. Greedy outputs equal target-only's, and drafts are accepted."""
    from rocdraft.config import SpeculativeConfig

    target, head = accepting_pair
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = [o.token_ids for o in LLM(target).generate(SPEC_PROMPTS, params)]
    llm = LLM(target, draft=head, speculative_config=SpeculativeConfig(
        "eagle3", 3, draft_costs=(1.0, 0.1, 0.0, 0.0, 0.1)))
    seen, num_drafts = [], llm.policy.num_drafts

    def recording(batch_size, outlook=None, prefill=False):
        seen.append((batch_size, outlook))
        return num_drafts(batch_size, outlook, prefill)

    llm.policy.num_drafts = recording
    assert [o.token_ids for o in llm.generate(SPEC_PROMPTS, params)] == reference
    assert llm.last_stats.acceptance_length > 1.5
    assert all(o is not None and len(o.keys) == len(o.remaining) == b for b, o in seen)
    left = [max(o.remaining) for _, o in seen]
    assert left[0] <= 24 and left == sorted(left, reverse=True) and left[-1] < left[0]
    seen.clear()
    llm.generate(SPEC_PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    assert seen and all(o is None for _, o in seen)


@pytest.mark.parametrize("policy", [dict(draft_policy="fixed"), dict(),
                                    dict(draft_costs=(1.0, 0.1, 0.0, 0.0, 0.1)),
                                    dict(draft_costs=(1e-3, 1.0, 0.0, 1.0, 1.0))],
                         ids=["fixed", "cost-realized", "cost-cheap", "cost-dear"])
def test_seeded_outputs_equal_seeded_target_only_under_every_policy(accepting_pair, policy):
    from rocdraft.config import SpeculativeConfig

    target, head = accepting_pair
    seeded = [SamplingParams(temperature=0.9, top_k=50, max_tokens=40, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]
    prompts = [[1, 5, 7, 9], [1, 2], [4] * 11]
    expected = [o.token_ids for o in LLM(target).generate(prompts, seeded)]
    llm = LLM(target, draft=head, speculative_config=SpeculativeConfig("eagle3", 3, **policy))
    assert [o.token_ids for o in llm.generate(prompts, seeded)] == expected


@pytest.mark.parametrize("draft_backend, padded, shared", [
    (None, True, True),  # the head runs the target's backend: one plan per step
    ("TORCH_SDPA", True, False),  # another backend plans its own
    (None, False, False),  # unpadded drafting drops rejected tokens: another batch
])
def test_the_head_reuses_the_targets_attention_plan_of_the_same_batch(
        accepting_pair, monkeypatch, draft_backend, padded, shared):
    """The target's plan of the step's batch serves the head's first forward when both run
    one backend class over that batch; greedy outputs are the same either way."""
    from rocdraft.config import SpeculativeConfig
    from rocdraft.engine import LLMEngine

    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    reference = LLM(accepting_pair[0], attention_backend="CPU_ATTN").generate(SPEC_PROMPTS,
                                                                              params)
    engine = LLMEngine(accepting_pair[0], draft=accepting_pair[1],
                       attention_backend="CPU_ATTN", draft_attention_backend=draft_backend,
                       speculative_config=SpeculativeConfig(
                           "eagle3", 3, draft_policy="fixed", padded_drafting=padded))
    builds = {"target": 0, "draft": 0}

    def counting(name, builder):
        build = builder.build

        def counted(common):
            builds[name] += 1
            return build(common)
        monkeypatch.setattr(builder, "build", counted)

    counting("target", engine.model_runner.builder)
    counting("draft", engine.draft_runner.proposer.builder)
    final, _ = _run_staggered(engine, SPEC_PROMPTS, params, arrivals=[0, 0, 0, 0])
    steps = engine.stats.num_steps
    assert [final[i].token_ids for i in range(4)] == [o.token_ids for o in reference]
    assert engine.stats.acceptance_length > 1.5
    assert builds["target"] == steps  # one plan per step (plan() then forward())
    assert (builds["draft"] == 0) == shared and (shared or builds["draft"] >= steps)


def _burning_cpu(call, seconds: float = 0.05):
    """``call`` after burning ``seconds`` of this thread's CPU time (the work clock the
    policy's step times are read on: a sleep would not show there)."""
    import time as clock

    def burning(*args, **kwargs):
        start = clock.thread_time()
        while clock.thread_time() - start < seconds:
            pass
        return call(*args, **kwargs)
    return burning


def _record_observed(policy) -> list:
    """The StepRecords ``policy`` observes from now on, in order."""
    records, observe = [], policy.observe

    def recording(step):
        records.append(step)
        return observe(step)
    policy.observe = recording
    return records


@pytest.mark.parametrize("overlap", [False, True])
def test_the_step_times_the_policy_learns_leave_out_its_own_decision(accepting_pair, overlap):
    """The step times a ``StepRecord`` carries (the whole step and its draft part, on the
    work clock: this thread's CPU time) leave out the policy's decision, in the synchronous
    and the async step: a decision that burns 50 ms of CPU does not show in any step's
    time, which the tiny pair runs in a few ms. (Before, the synchronous step counted it in
    the draft part of the count decided, and the async step in the verify part of the next:
    fresh decisions cluster on probes, so the probed counts read slow.)"""
    target, head = accepting_pair
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(target, draft=head, speculative_config=SpeculativeConfig(
        "eagle3", 3, draft_policy="fixed"), async_scheduling=overlap)
    llm.policy.num_drafts = _burning_cpu(llm.policy.num_drafts)
    records = _record_observed(llm.policy)
    llm.generate([[1, 5, 7, 9]], params)
    assert llm.last_stats.acceptance_length > 2.0  # drafts were made and accepted
    assert len(records) == llm.last_stats.num_steps
    assert sum(r.draft_seconds > 0 for r in records) >= 2
    assert all(0 < r.seconds < 0.025 and 0 <= r.draft_seconds < r.seconds for r in records), \
        [(r.seconds, r.draft_seconds) for r in records]
    assert llm.last_stats.time_s["policy"] >= 0.05 * len(records) * 0.95


def test_a_tree_configs_shape_decision_is_the_policys_time_not_the_steps(accepting_pair):
    """A tree config's policy picks the shape, the chain's drafts and the tree's budget
    before the drafting (``LLMEngine._tree_choice``): that time is in the "policy" phase and
    in no step time the policy learns, as a chain config's decision (a shape decision that
    burns 50 ms of CPU)."""
    target, head = accepting_pair
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(target, draft=head, speculative_config=SpeculativeConfig(
        "eagle3", 3, tree_depth=3, tree_top_k=2, tree_total_tokens=6))
    assert llm.policy.shape_chooser is not None
    llm.policy.shape = _burning_cpu(llm.policy.shape)
    records = _record_observed(llm.policy)
    llm.generate([[1, 5, 7, 9]], params)
    stats = llm.last_stats
    assert stats.acceptance_length > 1.5
    assert len(records) == stats.num_steps and {r.shape for r in records} >= {"tree"}
    assert all(0 < r.seconds < 0.025 for r in records), [r.seconds for r in records]
    assert stats.time_s["policy"] >= 0.05 * len(records) * 0.95
    assert stats.time_s["draft"] < 0.025 * len(records)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_policys_calls_are_a_phase_of_their_own(accepting_pair, overlap):
    """``GenerationStats.time_s["policy"]``: the draft policy's calls the engine makes each
    step (the decision with the batch's outlook, the step it observes), taken out of the
    "draft" and "bookkeeping" phases, in the synchronous and the async step. A policy whose
    decision and observation each take 20 ms more shows them in "policy" and not in "draft";
    target-only has no policy phase."""
    target, head = accepting_pair
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = LLM(target, async_scheduling=overlap)
    plain.generate([[1, 5, 7, 9]], params)
    assert plain.last_stats.time_s["policy"] == 0.0
    llm = LLM(target, draft=head, speculative_config=SpeculativeConfig(
        "eagle3", 3, draft_policy="fixed"), async_scheduling=overlap)
    llm.policy.num_drafts = _burning_cpu(llm.policy.num_drafts, 0.02)
    llm.policy.observe = _burning_cpu(llm.policy.observe, 0.02)
    out = llm.generate([[1, 5, 7, 9]], params)
    stats = llm.last_stats
    assert stats.acceptance_length > 2.0  # drafts were made and accepted
    seconds, steps = stats.time_s, stats.num_steps
    assert seconds["policy"] >= 0.04 * steps * 0.95
    assert seconds["draft"] < 0.02 * steps
    assert seconds["bookkeeping"] < 0.02 * steps
    assert out[0].token_ids == plain.generate([[1, 5, 7, 9]], params)[0].token_ids
