"""models/draft_loader.py: what a head checkpoint may hold, and every bad one named.

Each head is loaded against a tiny target; the checks are strict both ways (every module
weight present with its shape and a compatible dtype, every checkpoint key used or listed as
legitimately unused), EAGLE-1 q/k/v biases follow ``qkv_bias`` as in SafeAILab/EAGLE's
``eagle/model/cnets1.py``, and EAGLE-3 aux layer ids follow the head's config as in vLLM.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import PagedBatch, write_eagle1_head, write_eagle3_head, write_tiny_llama
from rocdraft.backends.kv_cache import allocate_kv_cache
from rocdraft.backends.registry import get_backend
from rocdraft.errors import CheckpointError
from rocdraft.models.draft_loader import load_draft
from rocdraft.models.llama import load_target

SDPA = get_backend("TORCH_SDPA")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    target = write_tiny_llama(root / "target", kind="llama", tokenizer=False)
    deep = write_tiny_llama(root / "deep", kind="deep", tokenizer=False)
    return {"target": target, "deep": deep,
            "e1": write_eagle1_head(root / "e1", target, seed=1, fmt="safetensors"),
            "e3": write_eagle3_head(root / "e3", deep, seed=3),
            "e3_full": write_eagle3_head(root / "e3_full", deep, seed=5, draft_vocab_size=160)}


@pytest.fixture(scope="module")
def targets(dirs):
    return {name: load_target(dirs[name], torch.float32, "cpu", SDPA)
            for name in ("target", "deep")}


def _state(directory):
    return load_file(str(directory / "model.safetensors"))


def _rewrite(src, dst, state=None, **config_changes):
    """Head ``src`` copied to ``dst`` with another state dict and/or config fields."""
    dst.mkdir()
    save_file(state if state is not None else _state(src), str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **config_changes}))
    return dst


def _load(directory, target):
    return load_draft(directory, target, torch.float32, "cpu", SDPA)


# --- EAGLE-1 q/k/v biases (Qwen2 heads) -----------------------------------------------------

def _qwen2_style(dirs, dst, seed=0):
    """The EAGLE-1 head with q/k/v biases and ``"qkv_bias": true``, as Qwen2 EAGLE heads."""
    g = torch.Generator().manual_seed(seed)
    state = _state(dirs["e1"])
    for name, size in (("q", 64), ("k", 32), ("v", 32)):
        state[f"layers.0.self_attn.{name}_proj.bias"] = 0.5 * torch.randn(size, generator=g)
    return _rewrite(dirs["e1"], dst, state, qkv_bias=True), state


def _dense_eagle1_with_biases(s, embed, ids, features, heads=4, kv_heads=2, head_dim=16):
    """cnets1.py's layer 0 for one sequence at positions 0.. (no input_layernorm, q/k/v bias)."""
    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def rope(x):  # [n, h, d], theta 10000, rotate-half layout
        inv_freq = 1e4 ** -(torch.arange(0, head_dim, 2) / head_dim)
        angles = torch.cat([torch.arange(n).float()[:, None] * inv_freq] * 2, -1)[:, None]
        rotated = torch.cat([-x[..., head_dim // 2:], x[..., :head_dim // 2]], -1)
        return x * angles.cos() + rotated * angles.sin()

    def proj(x, name):
        p = f"layers.0.self_attn.{name}_proj"
        return x @ s[f"{p}.weight"].T + s.get(f"{p}.bias", 0)

    n = ids.shape[0]
    h = torch.cat([embed[ids], features], -1) @ s["fc.weight"].T + s["fc.bias"]
    q = rope(proj(h, "q").view(n, heads, head_dim))
    k = rope(proj(h, "k").view(n, kv_heads, head_dim)).repeat_interleave(heads // kv_heads, 1)
    v = proj(h, "v").view(n, kv_heads, head_dim).repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim ** 0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    h = h + torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1) @ \
        s["layers.0.self_attn.o_proj.weight"].T
    x = rms(h, s["layers.0.post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(x @ s["layers.0.mlp.gate_proj.weight"].T)
           * (x @ s["layers.0.mlp.up_proj.weight"].T)) @ s["layers.0.mlp.down_proj.weight"].T
    return h + mlp


@torch.no_grad()
def test_qwen2_eagle1_head_keeps_its_qkv_biases(dirs, targets, tmp_path):
    directory, state = _qwen2_style(dirs, tmp_path / "qwen2")
    target = targets["target"]
    head = _load(directory, target)
    attn = head.layers[0].self_attn
    for name in ("q", "k", "v"):
        assert torch.equal(getattr(attn, f"{name}_proj").bias,
                           state[f"layers.0.self_attn.{name}_proj.bias"])
    assert attn.o_proj.bias is None
    g = torch.Generator().manual_seed(0)
    ids, features = torch.randint(0, 160, (6,), generator=g), torch.randn(6, 64, generator=g)
    batch = PagedBatch(1)
    caches = allocate_kv_cache(1, batch.num_blocks, batch.block_size, 2, 16, torch.float32, "cpu")
    input_ids, positions, metadata, _ = batch.step([ids.tolist()], SDPA)
    out = head(input_ids, positions, features, caches, metadata)
    expected = _dense_eagle1_with_biases(state, target.embed_tokens.weight, ids, features)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_qkv_biases_need_the_config_flag_and_the_flag_needs_biases(dirs, targets, tmp_path):
    _, state = _qwen2_style(dirs, tmp_path / "qwen2")
    unflagged = _rewrite(dirs["e1"], tmp_path / "unflagged", state)
    with pytest.raises(CheckpointError, match=r"has q/k/v biases \(layers\.0\.self_attn\.k_proj"
                                              r"\.bias, .*does not say \"qkv_bias\": true"):
        _load(unflagged, targets["target"])
    flagged = _rewrite(dirs["e1"], tmp_path / "flagged", qkv_bias=True)
    with pytest.raises(CheckpointError, match=r"missing weight\(s\) layers\.0\.self_attn\.q_proj"
                                              r"\.bias"):
        _load(flagged, targets["target"])


# --- unexpected and legitimately unused keys ------------------------------------------------

def test_eagle1_keys_beyond_its_config_are_refused(dirs, targets, tmp_path):
    state = _state(dirs["e1"])
    state.update({k.replace("layers.0.", "layers.1."): v.clone() for k, v in state.items()
                  if k.startswith("layers.0.")})
    two_layers = _rewrite(dirs["e1"], tmp_path / "two", state)  # config: num_hidden_layers 1
    with pytest.raises(CheckpointError, match=r"8 unexpected weight\(s\) the model does not use: "
                                              r"layers\.1\.mlp\.down_proj\.weight, .*\(\+4 more\)"):
        _load(two_layers, targets["target"])
    state = _state(dirs["e1"])
    state["lm_head.weight"] = targets["target"].lm_head.weight.clone()
    with pytest.raises(CheckpointError, match=r"1 unexpected weight\(s\) .*: lm_head\.weight"):
        _load(_rewrite(dirs["e1"], tmp_path / "lm", state), targets["target"])


def test_eagle3_unexpected_keys_are_refused(dirs, targets, tmp_path):
    state = _state(dirs["e3"])
    state["midlayer.self_attn.q_proj.bias"] = torch.zeros(64)
    state["layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    with pytest.raises(CheckpointError, match=r"2 unexpected weight\(s\) the model does not use: "
                                              r"layers\.1\.mlp\.up_proj\.weight, "
                                              r"midlayer\.self_attn\.q_proj\.bias"):
        _load(_rewrite(dirs["e3"], tmp_path / "extra", state), targets["deep"])


def test_legitimately_unused_keys_load(dirs, targets, tmp_path):
    """EAGLE-1: embed_tokens (shared) and rotary inv_freq; EAGLE-3: t2d, embed_tokens and
    inv_freq; a full-vocabulary EAGLE-3 head's d2t (all zeros, no map)."""
    state = _state(dirs["e1"])
    state["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    head = _load(_rewrite(dirs["e1"], tmp_path / "e1", state), targets["target"])
    assert head.embed_tokens is targets["target"].embed_tokens
    state = _state(dirs["e3"])
    state["embed_tokens.weight"] = targets["deep"].embed_tokens.weight.clone()
    state["midlayer.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    assert state["t2d"].dtype == torch.bool and state["d2t"].dtype == torch.int64
    head = _load(_rewrite(dirs["e3"], tmp_path / "e3", state), targets["deep"])
    assert head.embed_tokens is targets["deep"].embed_tokens and head.d2t is not None
    state = _state(dirs["e3_full"])
    assert "d2t" in state and not state["d2t"].any()
    assert _load(dirs["e3_full"], targets["deep"]).d2t is None


# --- dtypes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("head, key, dtype", [
    ("e1", "layers.0.post_attention_layernorm.weight", torch.bool),
    ("e1", "fc.weight", torch.int32),
    ("e3", "fc.weight", torch.int32),
    ("e3", "midlayer.hidden_norm.weight", torch.bool),
    ("e3", "embed_tokens.weight", torch.int64),
])
def test_non_floating_head_weight_is_refused_by_key_and_dtype(dirs, targets, tmp_path, head, key,
                                                              dtype):
    state = _state(dirs[head])
    if key == "embed_tokens.weight":
        state[key] = torch.ones(160, 64)
    state[key] = state[key].to(dtype)
    target = targets["target" if head == "e1" else "deep"]
    with pytest.raises(CheckpointError, match=rf"weight {key.replace('.', '[.]')} has dtype "
                                              rf"{dtype}, expected a floating-point"):
        _load(_rewrite(dirs[head], tmp_path / "bad", state), target)


def test_d2t_must_be_integer(dirs, targets, tmp_path):
    state = _state(dirs["e3"])
    state["d2t"] = state["d2t"].float()
    with pytest.raises(CheckpointError, match=r"d2t has dtype torch\.float32, expected an "
                                              r"integer tensor"):
        _load(_rewrite(dirs["e3"], tmp_path / "float_d2t", state), targets["deep"])


# --- d2t range boundaries -------------------------------------------------------------------

@pytest.mark.parametrize("draft_id, target_id, ok", [
    (79, 160, False), (79, 159, True),  # the last draft id onto vocab_size / vocab_size - 1
    (0, -1, False), (0, 0, True),
])
def test_d2t_range_boundaries(dirs, targets, tmp_path, draft_id, target_id, ok):
    state = _state(dirs["e3"])
    state["d2t"][draft_id] = target_id - draft_id
    directory = _rewrite(dirs["e3"], tmp_path / "edge", state)
    if ok:
        head = _load(directory, targets["deep"])
        assert int(head.draft_to_target(torch.tensor([draft_id]))) == target_id
    else:
        with pytest.raises(CheckpointError, match=r"d2t maps draft ids to target ids in .*outside "
                                                  r"the target vocab \[0, 160\)"):
            _load(directory, targets["deep"])


# --- EAGLE-3 aux layer ids ------------------------------------------------------------------

def test_eagle3_on_a_target_with_fewer_than_three_layers_is_refused_at_load(tmp_path):
    shallow = write_tiny_llama(tmp_path / "shallow", num_hidden_layers=2, tokenizer=False)
    head = write_eagle3_head(tmp_path / "e3", shallow)
    with pytest.raises(CheckpointError, match=r"draft head .*EAGLE-3 needs a target with at least "
                                              r"3 layers .*the target has 2 layer"):
        _load(head, load_target(shallow, torch.float32, "cpu", SDPA))


@pytest.mark.parametrize("config, expected", [
    ({}, (2, 4, 5)),
    ({"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}, (1, 3, 7)),
    ({"eagle_aux_hidden_state_layer_ids": [6, 0, 3]}, (0, 3, 6)),  # low to high, as vLLM
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}, (1, 2, 3)),
])
def test_eagle3_declared_aux_layer_ids_are_used(dirs, targets, tmp_path, config, expected):
    head = _load(_rewrite(dirs["e3"], tmp_path / "ids", **config), targets["deep"])
    assert head.aux_layer_ids(targets["deep"].config.num_hidden_layers) == expected


def test_eagle3_aux_layer_ids_out_of_range_are_refused_at_load(dirs, targets, tmp_path):
    directory = _rewrite(dirs["e3"], tmp_path / "ids", eagle_aux_hidden_state_layer_ids=[2, 4, 8])
    with pytest.raises(CheckpointError, match=r"eagle_aux_hidden_state_layer_ids \[2, 4, 8\] must "
                                              r"be 3 distinct layer ids in \[0, 8\) for a target "
                                              r"with 8 layers"):
        _load(directory, targets["deep"])


# --- EAGLE-3 lm_head sharing ----------------------------------------------------------------

@torch.no_grad()
def test_full_vocab_eagle3_without_lm_head_shares_the_targets(dirs, targets, tmp_path):
    target = targets["deep"]
    state = _state(dirs["e3_full"])
    del state["lm_head.weight"]
    head = _load(_rewrite(dirs["e3_full"], tmp_path / "no_lm", state), target)
    assert head.lm_head is target.lm_head and head.d2t is None
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(head.compute_draft_logits(hidden),
                               target.compute_logits(head.norm(hidden)))
    own = _load(dirs["e3_full"], target)
    assert own.lm_head is not target.lm_head


def test_reduced_vocab_eagle3_without_lm_head_is_refused(dirs, targets, tmp_path):
    state = _state(dirs["e3"])
    del state["lm_head.weight"]
    with pytest.raises(CheckpointError, match=r"no lm_head\.weight in the head, and the target's "
                                              r"lm_head \[160, 64\] cannot stand in for "
                                              r"\[draft_vocab_size, hidden_size\] = \[80, 64\]"):
        _load(_rewrite(dirs["e3"], tmp_path / "no_lm", state), targets["deep"])
