"""models/eagle1.py, models/eagle3.py, models/draft_loader.py.

The paged forward of each head is checked against a dense re-implementation written here
from the raw checkpoint tensors (causal attention over one sequence), processed on the paged
path as a prefill chunk, a multi-token chunk and a single-token step.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from checkpoints import PagedBatch, write_eagle1_head, write_eagle3_head, write_tiny_llama
from rocdraft.backends.kv_cache import allocate_kv_cache
from rocdraft.backends.registry import get_backend
from rocdraft.errors import CheckpointError
from rocdraft.models.draft_loader import EAGLE1, EAGLE3, detect_format, load_draft
from rocdraft.models.eagle1 import Eagle1Head
from rocdraft.models.eagle3 import Eagle3Head
from rocdraft.models.llama import load_target

SDPA = get_backend("TORCH_SDPA")
CHUNKS = (5, 3, 1)  # one sequence of 9 tokens: prefill chunk, multi-token step, decode step
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    target = write_tiny_llama(root / "target", kind="llama", tokenizer=False)
    # The deep target's RoPE base (5e5) differs from the EAGLE-3 head's (10000, the default).
    deep = write_tiny_llama(root / "deep", kind="deep", tokenizer=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    return {
        "target": target, "deep": deep,
        "e1_bin": write_eagle1_head(root / "e1_bin", target, seed=1, fmt="bin"),
        "e1_st": write_eagle1_head(root / "e1_st", target, seed=2, bias=False,
                                   fmt="safetensors"),
        "e3": write_eagle3_head(root / "e3", deep, seed=3),
        "e3_bin": write_eagle3_head(root / "e3_bin", deep, seed=4, fmt="bin",
                                    architecture="LlamaForCausalLM"),
        "e3_full": write_eagle3_head(root / "e3_full", deep, seed=5, draft_vocab_size=160),
    }


@pytest.fixture(scope="module")
def targets(dirs):
    return {name: load_target(dirs[name], torch.float32, "cpu", SDPA)
            for name in ("target", "deep")}


def _raw_state(directory):
    if (directory / "pytorch_model.bin").is_file():
        return torch.load(directory / "pytorch_model.bin", weights_only=True)
    return load_file(str(directory / "model.safetensors"))


def _rewrite(src, dst, state=None, **config_changes):
    """Copy head ``src`` to ``dst`` with a modified state dict and/or config."""
    dst.mkdir()
    save_file(state if state is not None else _raw_state(src), str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **config_changes}))
    return dst


# --- dense reference ---------------------------------------------------------------------

def _rms(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta):  # x [n, heads, d]
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angles = positions.float()[:, None] * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat(
        [angles, angles], -1).sin()[:, None]
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rotated * sin


def _dense_attention(x, s, prefix, positions, heads=4, kv_heads=2, head_dim=16, theta=1e4):
    n = x.shape[0]
    q = _rope((x @ s[f"{prefix}.q_proj.weight"].T).view(n, heads, head_dim), positions, theta)
    k = _rope((x @ s[f"{prefix}.k_proj.weight"].T).view(n, kv_heads, head_dim), positions, theta)
    v = (x @ s[f"{prefix}.v_proj.weight"].T).view(n, kv_heads, head_dim)
    k = k.repeat_interleave(heads // kv_heads, 1)
    v = v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim ** 0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * head_dim)
    return out @ s[f"{prefix}.o_proj.weight"].T


def _dense_mlp(x, s, prefix):
    gate = torch.nn.functional.silu(x @ s[f"{prefix}.gate_proj.weight"].T)
    return (gate * (x @ s[f"{prefix}.up_proj.weight"].T)) @ s[f"{prefix}.down_proj.weight"].T


def dense_eagle1(s, embed, ids, positions, features):
    h = torch.cat([embed[ids], features], -1) @ s["fc.weight"].T
    if "fc.bias" in s:
        h = h + s["fc.bias"]
    h = h + _dense_attention(h, s, "layers.0.self_attn", positions)
    return h + _dense_mlp(_rms(h, s["layers.0.post_attention_layernorm.weight"]), s,
                          "layers.0.mlp")


def dense_eagle3(s, embed, ids, positions, g):
    z = torch.cat([_rms(embed[ids], s["midlayer.input_layernorm.weight"]),
                   _rms(g, s["midlayer.hidden_norm.weight"])], -1)
    h = g + _dense_attention(z, s, "midlayer.self_attn", positions)
    return h + _dense_mlp(_rms(h, s["midlayer.post_attention_layernorm.weight"]), s,
                          "midlayer.mlp")


def _paged_run(head, backend, ids, features):
    """Run ``head`` over one sequence in CHUNKS on a paged cache -> [n, H]."""
    batch = PagedBatch(1)
    num_layers, num_kv_heads, head_dim = head.kv_cache_spec()
    caches = allocate_kv_cache(num_layers, batch.num_blocks, batch.block_size, num_kv_heads,
                               head_dim, torch.float32, "cpu")
    outs, start = [], 0
    for size in CHUNKS:
        input_ids, positions, metadata, _ = batch.step([ids[start:start + size].tolist()],
                                                        backend)
        outs.append(head(input_ids, positions, features[start:start + size], caches, metadata))
        start += size
    return torch.cat(outs)


# --- forward vs dense ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["e1_bin", "e1_st"])
@torch.no_grad()
def test_eagle1_forward_matches_dense(name, attention_backend, dirs, targets):
    target = targets["target"]
    head = load_draft(dirs[name], target, torch.float32, "cpu", get_backend(attention_backend))
    assert isinstance(head, Eagle1Head) and head.kv_cache_spec() == (1, 2, 16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 160, (9,), generator=g)
    features = torch.randn(9, 64, generator=g)
    out = _paged_run(head, get_backend(attention_backend), ids, head.combine_hidden_states(
        features))
    expected = dense_eagle1(_raw_state(dirs[name]), target.embed_tokens.weight, ids,
                            torch.arange(9), features)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(head.compute_draft_logits(out),
                               expected @ target.lm_head.weight.T, **TOL)
    assert head.compute_draft_logits(out).dtype == torch.float32
    assert torch.equal(head.draft_to_target(ids), ids) and head.aux_layer_ids(32) == ()


@pytest.mark.parametrize("name", ["e3", "e3_full"])
@torch.no_grad()
def test_eagle3_forward_matches_dense(name, attention_backend, dirs, targets):
    target = targets["deep"]
    head = load_draft(dirs[name], target, torch.float32, "cpu", get_backend(attention_backend))
    assert isinstance(head, Eagle3Head) and head.kv_cache_spec() == (1, 2, 16)
    s = _raw_state(dirs[name])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 160, (9,), generator=g)
    hidden = torch.randn(9, 64, generator=g)
    out = _paged_run(head, get_backend(attention_backend), ids, hidden)
    expected = dense_eagle3(s, target.embed_tokens.weight, ids, torch.arange(9), hidden)
    torch.testing.assert_close(out, expected, **TOL)
    logits = head.compute_draft_logits(out)
    assert logits.shape == (9, s["lm_head.weight"].shape[0]) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, _rms(expected, s["norm.weight"]) @ s["lm_head.weight"].T,
                               **TOL)


@pytest.mark.parametrize("name", ["e1_st", "e3"])
@torch.no_grad()
def test_rows_give_those_rows_of_the_full_forward_and_the_same_cache(name, attention_backend,
                                                                      dirs, targets):
    """``forward(..., rows=)`` (a draft's first forward reads the sampled tokens only):
    the rows of the full forward, and every token's K/V written exactly as without it."""
    target = targets["deep" if name == "e3" else "target"]
    head = load_draft(dirs[name], target, torch.float32, "cpu", get_backend(attention_backend))
    assert head.selects_rows
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (7, 4)]
    features = torch.randn(11, 64, generator=g)
    hidden = head.combine_hidden_states(features) if name == "e1_st" else features
    outs, caches = [], []
    for rows in (None, torch.tensor([6, 10])):  # each prompt's last token
        batch = PagedBatch(2)
        num_layers, num_kv_heads, head_dim = head.kv_cache_spec()
        cache = allocate_kv_cache(num_layers, batch.num_blocks, batch.block_size, num_kv_heads,
                                  head_dim, torch.float32, "cpu")
        ids, positions, metadata, last = batch.step(prompts, get_backend(attention_backend))
        assert last == [6, 10]
        outs.append(head(ids, positions, hidden, cache, metadata, rows=rows))
        caches.append(cache)
    assert outs[1].shape == (2, outs[0].shape[1])
    # (o_proj and the MLP over 2 rows instead of 11: the matmuls may round differently)
    torch.testing.assert_close(outs[1], outs[0][[6, 10]], rtol=1e-5, atol=1e-5)
    for full, selected in zip(*caches):
        assert torch.equal(full.key, selected.key) and torch.equal(full.value, selected.value)


@torch.no_grad()
def test_eagle3_combines_transformers_aux_states(dirs, targets):
    """combine_hidden_states(fc over aux layers 2, L//2, L-3) on the target's own aux output
    equals fc applied to transformers' output_hidden_states."""
    target = targets["deep"]
    head = load_draft(dirs["e3"], target, torch.float32, "cpu", SDPA)
    aux_ids = head.aux_layer_ids(target.config.num_hidden_layers)
    assert aux_ids == (2, 4, 5)
    ids = torch.arange(3, 10)
    batch = PagedBatch(1)
    num_layers, num_kv_heads, head_dim = target.kv_cache_spec()
    caches = allocate_kv_cache(num_layers, batch.num_blocks, batch.block_size, num_kv_heads,
                               head_dim, torch.float32, "cpu")
    input_ids, positions, metadata, _ = batch.step([ids.tolist()], SDPA)
    out = target(input_ids, positions, caches, metadata, aux_layer_ids=aux_ids)
    ref = AutoModelForCausalLM.from_pretrained(dirs["deep"], dtype=torch.float32)
    hf = ref(ids[None], output_hidden_states=True).hidden_states
    expected = torch.cat([hf[i][0] for i in aux_ids], -1) @ _raw_state(dirs["e3"])["fc.weight"].T
    torch.testing.assert_close(head.combine_hidden_states(out.aux_hidden_states), expected, **TOL)
    torch.testing.assert_close(head.combine_hidden_states(torch.cat(out.aux_hidden_states, -1)),
                               expected, **TOL)
    with pytest.raises(ValueError, match="fc takes 192 features"):
        head.combine_hidden_states(out.aux_hidden_states[:2])


# --- loading -------------------------------------------------------------------------------

def test_eagle1_shares_target_modules_and_bias_setting(dirs, targets):
    target = targets["target"]
    with_bias = load_draft(dirs["e1_bin"], target, torch.float32, "cpu", SDPA)
    without = load_draft(dirs["e1_st"], target, torch.float32, "cpu", SDPA)
    for head in (with_bias, without):
        assert head.embed_tokens is target.embed_tokens and head.lm_head is target.lm_head
    assert with_bias.fc.bias is not None and without.fc.bias is None
    assert with_bias.config.rope_theta == 10000.0


def test_eagle1_keeps_its_own_embedding_when_it_differs(dirs, targets, tmp_path):
    state = _raw_state(dirs["e1_bin"])
    state["embed_tokens.weight"] = state["embed_tokens.weight"] + 1.0
    head = load_draft(_rewrite(dirs["e1_bin"], tmp_path / "own", state), targets["target"],
                      torch.float32, "cpu", SDPA)
    assert head.embed_tokens is not targets["target"].embed_tokens
    torch.testing.assert_close(head.embed_tokens.weight, state["embed_tokens.weight"])
    del state["embed_tokens.weight"]
    head = load_draft(_rewrite(dirs["e1_bin"], tmp_path / "none", state), targets["target"],
                      torch.float32, "cpu", SDPA)
    assert head.embed_tokens is targets["target"].embed_tokens


def test_eagle3_vocab_map(dirs, targets):
    target = targets["deep"]
    head = load_draft(dirs["e3_bin"], target, torch.float32, "cpu", SDPA)
    s = _raw_state(dirs["e3_bin"])
    kept = s["t2d"].nonzero().flatten()
    assert torch.equal(head.draft_to_target(torch.arange(80)), kept)
    assert head.embed_tokens is target.embed_tokens
    full = load_draft(dirs["e3_full"], target, torch.float32, "cpu", SDPA)
    assert full.d2t is None and torch.equal(full.draft_to_target(torch.arange(160)),
                                            torch.arange(160))


def test_eagle3_vocab_map_follows_a_reloaded_d2t(dirs, targets):
    """The one-lookup map (arange + d2t, kept) equals ``id + d2t[id]`` for any id shape, and
    follows a d2t written in place (a reload) or replaced, into the same kept tensor."""
    head = load_draft(dirs["e3_bin"], targets["deep"], torch.float32, "cpu", SDPA)
    ids = torch.tensor([[0, 5, 79], [3, 3, 1]])
    assert torch.equal(head.draft_to_target(ids), ids + head.d2t[ids])
    kept = head.target_ids()
    with torch.no_grad():
        head.d2t.copy_(torch.arange(80).flip(0))  # as load_state_dict writes it
    assert torch.equal(head.draft_to_target(ids), ids + head.d2t[ids])
    assert head.target_ids() is kept and torch.equal(kept, torch.full((80,), 79))
    head.d2t = torch.zeros(80, dtype=torch.long)
    assert torch.equal(head.draft_to_target(ids), ids)


def test_eagle3_input_norms_are_one_pair(dirs, targets):
    """Both input norms' weights are rows of one [2, H] tensor (one norm over [n, 2, H] per
    forward): a load through either parameter lands in the pair, the state dict is the
    checkpoint's, and a replaced weight is paired again."""
    from rocdraft.models.eagle3 import paired_norm_weight

    head = load_draft(dirs["e3_bin"], targets["deep"], torch.float32, "cpu", SDPA)
    mid, s = head.midlayer, _raw_state(dirs["e3_bin"])
    pair = paired_norm_weight(mid.input_layernorm, mid.hidden_norm)
    assert paired_norm_weight(mid.input_layernorm, mid.hidden_norm) is pair
    assert torch.equal(pair[0], s["midlayer.input_layernorm.weight"])
    assert torch.equal(head.state_dict()["midlayer.hidden_norm.weight"],
                      s["midlayer.hidden_norm.weight"])
    with torch.no_grad():
        mid.hidden_norm.weight.copy_(torch.full_like(pair[1], 2.0))
    assert torch.equal(pair[1], torch.full_like(pair[1], 2.0))
    mid.input_layernorm.weight.data = torch.full_like(pair[0], 3.0)
    again = paired_norm_weight(mid.input_layernorm, mid.hidden_norm)
    assert again is not pair and again[0].eq(3.0).all() and again[1].eq(2.0).all()


def test_format_detected_by_keys_not_architecture(dirs, targets, tmp_path):
    # e3_bin says "LlamaForCausalLM"; an EAGLE-1 head renamed to something odd still loads.
    assert isinstance(load_draft(dirs["e3_bin"], targets["deep"], torch.float32, "cpu", SDPA),
                      Eagle3Head)
    renamed = _rewrite(dirs["e1_bin"], tmp_path / "renamed", architectures=["EagleModel"])
    assert isinstance(load_draft(renamed, targets["target"], torch.float32, "cpu", SDPA),
                      Eagle1Head)
    assert detect_format(["d2t", "fc.weight"]) == EAGLE3
    assert detect_format(["midlayer.mlp.up_proj.weight"]) == EAGLE3
    assert detect_format(["fc.weight", "layers.0.mlp.up_proj.weight"]) == EAGLE1


def test_unknown_format_lists_keys(dirs, targets, tmp_path):
    bad = _rewrite(dirs["e1_bin"], tmp_path / "bad", {"medusa_head.0.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"unknown draft head format.*medusa_head\.0\.weight"):
        load_draft(bad, targets["target"], torch.float32, "cpu", SDPA)


def test_hidden_size_mismatch_names_both(dirs, targets, tmp_path):
    small = write_tiny_llama(tmp_path / "small", hidden_size=32, head_dim=8, tokenizer=False)
    head = write_eagle1_head(tmp_path / "small_e1", small)
    with pytest.raises(CheckpointError, match="hidden_size 32 does not match the target's "
                                              "hidden_size 64"):
        load_draft(head, targets["target"], torch.float32, "cpu", SDPA)
    e3 = _rewrite(dirs["e3"], tmp_path / "e3_th", target_hidden_size=48)
    with pytest.raises(CheckpointError, match="target_hidden_size 48 does not match the "
                                              "target's hidden_size 64"):
        load_draft(e3, targets["deep"], torch.float32, "cpu", SDPA)


def test_d2t_problems_are_named(dirs, targets, tmp_path):
    state = _raw_state(dirs["e3"])
    state["d2t"] = state["d2t"][:-1]
    short = _rewrite(dirs["e3"], tmp_path / "short", state)
    with pytest.raises(CheckpointError, match=r"d2t has shape \[79\], expected "
                                              r"\[draft_vocab_size\] = \[80\]"):
        load_draft(short, targets["deep"], torch.float32, "cpu", SDPA)
    state = _raw_state(dirs["e3"])
    del state["d2t"]
    missing = _rewrite(dirs["e3"], tmp_path / "missing", state)
    with pytest.raises(CheckpointError, match="no d2t map"):
        load_draft(missing, targets["deep"], torch.float32, "cpu", SDPA)
    big = _rewrite(dirs["e3"], tmp_path / "big", vocab_size=1000, draft_vocab_size=500)
    with pytest.raises(CheckpointError, match="draft_vocab_size 500 exceeds the target's "
                                              "vocab_size 160"):
        load_draft(big, targets["deep"], torch.float32, "cpu", SDPA)


def test_missing_or_misshapen_head_weight_is_named(dirs, targets, tmp_path):
    state = _raw_state(dirs["e3"])
    del state["midlayer.hidden_norm.weight"]
    with pytest.raises(CheckpointError, match=r"missing weight\(s\) midlayer\.hidden_norm"):
        load_draft(_rewrite(dirs["e3"], tmp_path / "m", state), targets["deep"], torch.float32,
                   "cpu", SDPA)
    state = _raw_state(dirs["e3"])
    state["fc.weight"] = torch.zeros(64, 128)
    with pytest.raises(CheckpointError, match=r"fc\.weight has shape \[64, 128\], expected "
                                              r"\[64, 192\]"):
        load_draft(_rewrite(dirs["e3"], tmp_path / "s", state), targets["deep"], torch.float32,
                   "cpu", SDPA)


def test_eagle3_aux_ids_need_three_layers(dirs, targets):
    head = load_draft(dirs["e3"], targets["deep"], torch.float32, "cpu", SDPA)
    assert head.aux_layer_ids(32) == (2, 16, 29)
    with pytest.raises(CheckpointError, match=r"at least 3 layers .* the target has 2 layer"):
        head.aux_layer_ids(2)
    assert head.aux_layer_ids(3) == (0, 1, 2)  # low to high, as vLLM and the reference collect
    for num in (4, 5, 6):  # (2, 2, 1), (2, 2, 2), (2, 3, 3)
        with pytest.raises(CheckpointError, match=rf"not distinct for a target with {num} layers"):
            head.aux_layer_ids(num)
    assert head.aux_layer_ids(7) == (2, 3, 4)
