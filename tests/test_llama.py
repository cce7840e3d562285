"""models/llama.py on the paged KV cache against transformers (float32, tiny checkpoints).

Batches mix ragged prefills, a prompt split into two chunks, and decodes in single forwards;
logits must match transformers' full-sequence forward and greedy tokens must be identical.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoints import PagedBatch, write_tiny_llama
from rocdraft.backends.kv_cache import allocate_kv_cache
from rocdraft.backends.registry import get_backend
from rocdraft.models.layers import RMSNorm, fused_linear_weights
from rocdraft.models.llama import LlamaForCausalLM, TargetOutput, load_target

KINDS = ("llama", "llama3", "qwen2")
NUM_DECODE_STEPS = 8
TOL = dict(rtol=1e-4, atol=1e-4)  # float32; tied-embedding logits reach |10|


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    return {kind: write_tiny_llama(root / kind, kind=kind, seed=i, tokenizer=False)
            for i, kind in enumerate(KINDS)}


@pytest.fixture(scope="module")
def references(checkpoints):
    return {kind: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            for kind, d in checkpoints.items()}


def _caches(model: LlamaForCausalLM, batch: PagedBatch):
    num_layers, num_kv_heads, head_dim = model.kv_cache_spec()
    return allocate_kv_cache(num_layers, batch.num_blocks, batch.block_size, num_kv_heads,
                             head_dim, torch.float32, "cpu")


@torch.no_grad()
def _hf_logits(ref, ids: list[int]) -> torch.Tensor:
    return ref(torch.tensor([ids])).logits[0]  # [len, vocab]


@torch.no_grad()
def _hf_greedy(ref, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(_hf_logits(ref, ids)[-1].argmax()))
    return ids[len(prompt):]


def _prompts(seed: int, lengths: tuple[int, ...], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_ragged_prefill_and_greedy_decode_match_transformers(kind, attention_backend,
                                                             checkpoints, references):
    backend = get_backend(attention_backend)
    model = load_target(checkpoints[kind], torch.float32, "cpu", backend)
    ref = references[kind]
    prompts = _prompts(1, (5, 9, 2), model.config.vocab_size)
    batch = PagedBatch(len(prompts))
    caches = _caches(model, batch)

    # One forward over all three prompts; compare every position's logits.
    input_ids, positions, metadata, last = batch.step(prompts, backend)
    logits = model.compute_logits(model(input_ids, positions, caches, metadata).hidden_states)
    assert logits.dtype == torch.float32 and logits.shape == (16, model.config.vocab_size)
    torch.testing.assert_close(logits, torch.cat([_hf_logits(ref, p) for p in prompts]), **TOL)

    sequences = [list(p) for p in prompts]
    next_tokens = logits[last].argmax(-1).tolist()
    for _ in range(NUM_DECODE_STEPS - 1):
        for seq, token in zip(sequences, next_tokens):
            seq.append(token)
        input_ids, positions, metadata, last = batch.step([[t] for t in next_tokens], backend)
        logits = model.compute_logits(model(input_ids, positions, caches, metadata).hidden_states)
        torch.testing.assert_close(logits, torch.stack([_hf_logits(ref, s)[-1]
                                                        for s in sequences]), **TOL)
        next_tokens = logits.argmax(-1).tolist()
    for seq, token in zip(sequences, next_tokens):
        seq.append(token)
    for prompt, seq in zip(prompts, sequences):
        assert seq[len(prompt):] == _hf_greedy(ref, prompt, NUM_DECODE_STEPS)


@torch.no_grad()
def test_chunked_prefill_mixed_with_decode(attention_backend, checkpoints, references):
    """Request A's 11-token prompt runs as chunks of 6 and 5; B prefills, then decodes next to
    A's second chunk; then both decode."""
    backend = get_backend(attention_backend)
    model = load_target(checkpoints["llama3"], torch.float32, "cpu", backend)
    ref = references["llama3"]
    prompt_a, prompt_b = _prompts(2, (11, 4), model.config.vocab_size)
    batch = PagedBatch(2)
    caches = _caches(model, batch)

    input_ids, positions, metadata, last = batch.step([prompt_a[:6], prompt_b], backend)
    logits = model.compute_logits(model(input_ids, positions, caches, metadata).hidden_states)
    torch.testing.assert_close(logits[:6], _hf_logits(ref, prompt_a[:6]), **TOL)
    token_b = int(logits[last[1]].argmax())

    input_ids, positions, metadata, last = batch.step([prompt_a[6:], [token_b]], backend)
    logits = model.compute_logits(model(input_ids, positions, caches, metadata).hidden_states)
    torch.testing.assert_close(logits[:5], _hf_logits(ref, prompt_a)[6:], **TOL)
    torch.testing.assert_close(logits[5], _hf_logits(ref, prompt_b + [token_b])[-1], **TOL)
    token_a, token_b2 = int(logits[last[0]].argmax()), int(logits[last[1]].argmax())

    input_ids, positions, metadata, _ = batch.step([[token_a], [token_b2]], backend)
    logits = model.compute_logits(model(input_ids, positions, caches, metadata).hidden_states)
    torch.testing.assert_close(logits, torch.stack([
        _hf_logits(ref, prompt_a + [token_a])[-1],
        _hf_logits(ref, prompt_b + [token_b, token_b2])[-1]]), **TOL)


@torch.no_grad()
def test_aux_hidden_states_match_output_hidden_states(attention_backend, checkpoints,
                                                     references):
    backend = get_backend(attention_backend)
    model = load_target(checkpoints["qwen2"], torch.float32, "cpu", backend)
    ref = references["qwen2"]
    prompts = _prompts(3, (7, 3), model.config.vocab_size)
    batch = PagedBatch(2)
    input_ids, positions, metadata, _ = batch.step(prompts, backend)
    aux_ids = (2, 0, 1)  # returned in the order asked for
    out = model(input_ids, positions, _caches(model, batch), metadata, aux_layer_ids=aux_ids)
    assert isinstance(out, TargetOutput) and len(out.aux_hidden_states) == 3
    hf = [ref(torch.tensor([p]), output_hidden_states=True).hidden_states for p in prompts]
    for aux, layer in zip(out.aux_hidden_states, aux_ids):
        assert aux.shape == (10, model.config.hidden_size)
        torch.testing.assert_close(aux, torch.cat([h[layer][0] for h in hf]), **TOL)
    # hidden_states is the final-norm output (transformers' last hidden state).
    torch.testing.assert_close(out.hidden_states, torch.cat([h[-1][0] for h in hf]), **TOL)


def test_attributes_and_spec(checkpoints):
    backend = get_backend("TORCH_SDPA")
    tied = load_target(checkpoints["llama3"], torch.float32, "cpu", backend)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert tied.kv_cache_spec() == (3, 2, 16)
    untied = load_target(checkpoints["llama"], torch.float32, "cpu", backend)
    assert untied.lm_head.weight is not untied.embed_tokens.weight
    assert isinstance(untied.embed_tokens, torch.nn.Embedding)
    assert isinstance(untied.lm_head, torch.nn.Linear)
    assert untied.config.architecture == "LlamaForCausalLM"


def test_fused_projections_share_storage_and_keep_hf_names(checkpoints):
    """q/k/v and gate/up run as one matmul each on a fused weight whose rows ARE the HF
    modules' weights (views, no copy); state_dict keeps the HF names."""
    model = load_target(checkpoints["qwen2"], torch.float32, "cpu", get_backend("TORCH_SDPA"))
    assert "layers.0.self_attn.q_proj.weight" in model.state_dict()
    assert not any("qkv" in name or "gate_up" in name for name in model.state_dict())
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    weight, bias = fused_linear_weights((attn.q_proj, attn.k_proj, attn.v_proj))
    assert torch.equal(weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight,
                                          attn.v_proj.weight]))
    assert bias is not None and bias.shape == (weight.shape[0],)  # qwen2: q/k/v biases
    assert attn.k_proj.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    gate_up, _ = fused_linear_weights((mlp.gate_proj, mlp.up_proj))
    with torch.no_grad():  # a write through a part (what copy_weights does) is seen fused
        mlp.up_proj.weight.mul_(2)
    assert torch.equal(gate_up[mlp.gate_proj.out_features:], mlp.up_proj.weight)
    assert fused_linear_weights((mlp.gate_proj, mlp.up_proj))[0].data_ptr() == \
        gate_up.data_ptr()  # cached: not rebuilt


@torch.no_grad()
def test_fused_projections_follow_replaced_storage(checkpoints):
    """After .to() (new storage for every part) the fused weight is rebuilt, not stale."""
    model = load_target(checkpoints["llama"], torch.float32, "cpu", get_backend("TORCH_SDPA"))
    attn = model.layers[1].self_attn
    before, _ = fused_linear_weights((attn.q_proj, attn.k_proj, attn.v_proj))
    model.to(torch.float64)
    after, _ = fused_linear_weights((attn.q_proj, attn.k_proj, attn.v_proj))
    assert after.dtype == torch.float64 and after.data_ptr() != before.data_ptr()
    assert torch.equal(after[:attn.q_proj.out_features], attn.q_proj.weight)


@torch.no_grad()
def test_float32_rms_norm_has_no_dtype_round_trip():
    norm = RMSNorm(64, 1e-6)
    norm.weight.normal_()
    x = torch.randn(5, 64)
    reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    with torch.profiler.profile(record_shapes=True) as prof:
        out = norm(x)
    assert torch.equal(out, reference)
    dispatched = [e.name for e in prof.events() if e.cpu_parent is None
                  or not e.cpu_parent.name.startswith("aten::")]  # not those inside an op
    # on the CPU one call from Python (aten's rms_norm, models/layers.py), and nothing in it
    # copies the input to another dtype (its copies are of scalars: eps, the mean's count)
    assert dispatched == ["aten::rms_norm"]
    copies = [e.input_shapes[0] for e in prof.events() if e.name == "aten::_to_copy"]
    assert all(shape == [] for shape in copies), copies


@torch.no_grad()
def test_bfloat16_model_gives_float32_logits(checkpoints):
    backend = get_backend("TORCH_SDPA")
    model = load_target(checkpoints["llama"], torch.bfloat16, "cpu", backend)
    batch = PagedBatch(1)
    num_layers, num_kv_heads, head_dim = model.kv_cache_spec()
    caches = allocate_kv_cache(num_layers, batch.num_blocks, batch.block_size, num_kv_heads,
                               head_dim, torch.bfloat16, "cpu")
    input_ids, positions, metadata, _ = batch.step([[1, 2, 3]], backend)
    out = model(input_ids, positions, caches, metadata)
    assert out.hidden_states.dtype == torch.bfloat16
    assert model.compute_logits(out.hidden_states).dtype == torch.float32


def test_bad_forward_arguments(checkpoints):
    backend = get_backend("TORCH_SDPA")
    model = load_target(checkpoints["llama"], torch.float32, "cpu", backend)
    batch = PagedBatch(1)
    input_ids, positions, metadata, _ = batch.step([[1, 2]], backend)
    with pytest.raises(ValueError, match=r"aux_layer_ids \[3\] out of range \[0, 3\)"):
        model(input_ids, positions, _caches(model, batch), metadata, aux_layer_ids=(0, 3))
    with pytest.raises(ValueError, match="got 2 KV caches for 3 layers"):
        model(input_ids, positions, _caches(model, batch)[:2], metadata)
