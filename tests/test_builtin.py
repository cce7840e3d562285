"""The built-in model pair (models/builtin): it loads through the ordinary loaders, fits the
size budget, is the CLI's default, and meets the acceptance bar on held-out code (greedy,
k = 4) with outputs identical to target-only decoding. Acceptance is a property of the
committed weights (deterministic), not a timing; speedups live in ``rocdraft bench``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import PagedBatch
from rocdraft import LLM, SamplingParams, SpeculativeConfig
from rocdraft.backends.kv_cache import allocate_kv_cache
from rocdraft.backends.registry import get_backend
from rocdraft.builtin import builtin_paths
from rocdraft.entrypoints.cli import main
from rocdraft.bench.corpus import heldout_prompts
from rocdraft.models.draft_loader import load_draft
from rocdraft.models.llama import load_target

PAIR = builtin_paths()
BARS = {"eagle3": 2.5, "eagle": 2.2}


@pytest.fixture(scope="module")
def target_only():
    return LLM(PAIR.target)


@pytest.fixture(scope="module")
def prompts(target_only):
    return heldout_prompts(n=6, prompt_tokens=96, seed=0, tokenizer=target_only.tokenizer)


def test_weights_fit_the_budget_and_are_half_precision():
    files = [p for d in (PAIR.target, PAIR.eagle1, PAIR.eagle3)
             for p in Path(d).glob("*.safetensors")]
    assert len(files) == 3
    assert sum(p.stat().st_size for p in files) <= 40 * 2 ** 20
    for directory in (PAIR.target, PAIR.eagle1, PAIR.eagle3):
        config = json.loads((Path(directory) / "config.json").read_text())
        assert config.get("torch_dtype", config.get("dtype")) in ("bfloat16", "float16")


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_acceptance_bar_on_heldout_code(target_only, prompts, method):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    reference = [o.token_ids for o in target_only.generate(prompts, params)]
    head = PAIR.eagle3 if method == "eagle3" else PAIR.eagle1
    llm = LLM(PAIR.target, draft=head, speculative_config=SpeculativeConfig(method, 4,
                                                                            draft_policy="fixed"))
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    assert llm.last_stats.acceptance_length >= BARS[method]


def test_cli_default_is_the_builtin_pair_with_eagle3(capsys):
    # draft_policy "fixed": verify steps must not depend on machine load
    rc = main(["generate", "def parse_args(argv):", "--max-new-tokens", "24", "--json",
               "--draft-policy", "fixed"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["stats"]["method"] == "eagle3" and out["stats"]["num_verify_steps"] > 0
    assert out["outputs"][0]["text"]


# --- layouts other implementations expect -------------------------------------------------

def _config(directory) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


def _tensors(directory) -> dict[str, torch.Tensor]:
    return load_file(str(Path(directory) / "model.safetensors"))


def _layer_shapes(prefix: str, c: dict, attn_in: int) -> dict[str, list[int]]:
    """q/k/v/o, gated MLP and post-attention norm of a Llama layer, head_dim = H // heads."""
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = hidden // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    return {f"{prefix}.self_attn.q_proj.weight": [q, attn_in],
            f"{prefix}.self_attn.k_proj.weight": [kv, attn_in],
            f"{prefix}.self_attn.v_proj.weight": [kv, attn_in],
            f"{prefix}.self_attn.o_proj.weight": [hidden, q],
            f"{prefix}.mlp.gate_proj.weight": [inter, hidden],
            f"{prefix}.mlp.up_proj.weight": [inter, hidden],
            f"{prefix}.mlp.down_proj.weight": [hidden, inter],
            f"{prefix}.post_attention_layernorm.weight": [hidden]}


def _reference_config_fields_hold(c: dict) -> None:
    """Fields the reference's modules read from config.json (EConfig): head_dim is always
    hidden_size // num_attention_heads there, rope_scaling must be absent (plain RoPE with
    the config's rope_theta), and the MLP is SiLU."""
    for field in ("hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "rms_norm_eps", "vocab_size",
                  "max_position_embeddings", "rope_theta"):
        assert field in c, field
    assert c["hidden_size"] % c["num_attention_heads"] == 0
    assert c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]) == \
        c["hidden_size"] // c["num_attention_heads"]
    assert c.get("rope_scaling") is None and c["hidden_act"] == "silu"


def test_eagle3_layout_loads_in_the_reference_code():
    """SafeAILab/EAGLE eagle/model/cnets.py ``Model.__init__`` builds embed_tokens, lm_head
    [draft_vocab, H], midlayer (q/k/v read 2H; input_layernorm, hidden_norm), fc [H, 3 *
    target_hidden_size] (no bias), norm and the d2t (int64) / t2d (bool) buffers; with
    ``target_hidden_size`` in the config it does NOT copy embeddings from the target, and
    eagle/model/ea_model.py loads the head with ``load_state_dict(strict=False)``, so every
    one of those tensors must be in the file (a missing one stays random) and nothing else
    (an extra one is dropped). Its target collects aux states at layers 2, L//2, L-3
    (eagle/model/modeling_llama_kv.py), which the declared ids must equal."""
    c, state = _config(PAIR.eagle3), _tensors(PAIR.eagle3)
    _reference_config_fields_hold(c)
    hidden, vocab, draft_vocab = c["hidden_size"], c["vocab_size"], c["draft_vocab_size"]
    assert "target_hidden_size" in c and draft_vocab < vocab
    expected = {"embed_tokens.weight": [vocab, hidden], "lm_head.weight": [draft_vocab, hidden],
                "fc.weight": [hidden, 3 * c["target_hidden_size"]], "norm.weight": [hidden],
                "midlayer.input_layernorm.weight": [hidden],
                "midlayer.hidden_norm.weight": [hidden], "d2t": [draft_vocab], "t2d": [vocab],
                **_layer_shapes("midlayer", c, 2 * hidden)}
    assert {k: list(v.shape) for k, v in state.items()} == expected
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert {v.dtype for k, v in state.items() if k not in ("d2t", "t2d")} == {torch.bfloat16}
    kept = torch.arange(draft_vocab) + state["d2t"]
    assert torch.equal(state["t2d"].nonzero().flatten(), kept)  # t2d marks the d2t targets
    target_layers = _config(PAIR.target)["num_hidden_layers"]
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, target_layers // 2, target_layers - 3]
    target_embed = load_file(str(Path(PAIR.target) / "model.safetensors"))[
        "model.embed_tokens.weight"]
    assert torch.equal(state["embed_tokens.weight"], target_embed)  # the frozen copy


def test_eagle3_layout_loads_in_vllm():
    """vllm/model_executor/models/llama_eagle3.py ``Eagle3LlamaForCausalLM.load_weights``:
    ``t2d`` is skipped, ``d2t`` becomes ``draft_id_to_target_id`` (int64 [draft_vocab]),
    ``lm_head.*`` is kept and every other key gets a ``model.`` prefix with ``midlayer.`` ->
    ``layers.0.``; q/k/v are stacked into ``qkv_proj`` and gate/up into ``gate_up_proj``; a
    name outside the module's parameters is a KeyError; embed_tokens is optional (the
    target's is shared when absent). q/k/v biases follow ``attention_bias`` and o_proj's
    follows ``attention_bias`` or ``bias``, so neither may be set. The architecture must be
    one vLLM registers for it, and vLLM reads the aux ids from
    ``eagle_aux_hidden_state_layer_ids`` (vllm/v1/worker/gpu_model_runner.py)."""
    c, state = _config(PAIR.eagle3), _tensors(PAIR.eagle3)
    assert c["architectures"] == ["LlamaForCausalLMEagle3"]
    assert not c.get("attention_bias", False) and not c.get("bias", False)
    assert len(c["eagle_aux_hidden_state_layer_ids"]) == 3
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = c.get("head_dim", hidden // c["num_attention_heads"])
    qkv_rows = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head_dim
    vllm_params = {
        "model.embed_tokens.weight": [c["vocab_size"], hidden],
        "model.layers.0.self_attn.qkv_proj.weight": [qkv_rows, 2 * hidden],
        "model.layers.0.self_attn.o_proj.weight": [hidden, c["num_attention_heads"] * head_dim],
        "model.layers.0.mlp.gate_up_proj.weight": [2 * inter, hidden],
        "model.layers.0.mlp.down_proj.weight": [hidden, inter],
        **{f"model.layers.0.{n}.weight": [hidden]
           for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")},
        "model.fc.weight": [hidden, 3 * c["target_hidden_size"]],
        "model.norm.weight": [hidden], "lm_head.weight": [c["draft_vocab_size"], hidden],
        "draft_id_to_target_id": [c["draft_vocab_size"]]}
    stacked = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj",
               ".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}
    rows: dict[str, int] = {}
    for key, tensor in state.items():
        if key == "t2d":
            continue
        name = ("draft_id_to_target_id" if key == "d2t" else key if key.startswith("lm_head")
                else "model." + key.replace("midlayer.", "layers.0."))
        for shard, param in stacked.items():
            if shard in name:
                name = name.replace(shard, param)
                assert list(tensor.shape[1:]) == vllm_params[name][1:], key
                rows[name] = rows.get(name, 0) + tensor.shape[0]
                break
        else:
            assert list(tensor.shape) == vllm_params[name], key
            rows[name] = tensor.shape[0]
    assert rows == {name: shape[0] for name, shape in vllm_params.items()}
    targets = torch.arange(c["draft_vocab_size"]) + state["d2t"]
    assert 0 <= int(targets.min()) and int(targets.max()) < c["vocab_size"]


def test_eagle1_layout_loads_in_the_reference_code():
    """SafeAILab/EAGLE eagle/model/cnets1.py ``Model``: fc [H, 2H] with a bias when the config
    says ``bias`` (eagle/model/ea_model.py; absent means true), layer 0 without
    input_layernorm, q/k/v biases only with ``qkv_bias``, no final norm, no lm_head (the
    target's is used), embeddings copied from the target (``load_emb``)."""
    c, state = _config(PAIR.eagle1), _tensors(PAIR.eagle1)
    _reference_config_fields_hold(c)
    assert c["bias"] is True and "qkv_bias" not in c and c["num_hidden_layers"] == 1
    hidden = c["hidden_size"]
    expected = {"fc.weight": [hidden, 2 * hidden], "fc.bias": [hidden],
                **_layer_shapes("layers.0", c, hidden)}
    assert {k: list(v.shape) for k, v in state.items()} == expected
    assert {v.dtype for v in state.values()} == {torch.bfloat16}


@torch.no_grad()
def test_shipped_eagle3_drafts_as_without_its_embedding_copy(tmp_path):
    """Storing the target's embeddings in the head changes nothing in rocdraft: the copy is
    recognised and shared, and the logits on a fixed input equal those of the same head
    without ``embed_tokens.weight`` (the layout shipped before)."""
    sdpa = get_backend("TORCH_SDPA")
    target = load_target(PAIR.target, torch.float32, "cpu", sdpa)
    old = tmp_path / "eagle3_without_embed"
    old.mkdir()
    state = _tensors(PAIR.eagle3)
    del state["embed_tokens.weight"]
    save_file(state, str(old / "model.safetensors"))
    (old / "config.json").write_text((Path(PAIR.eagle3) / "config.json").read_text())
    ids = torch.arange(5, 17)
    aux = torch.randn(ids.numel(), 3 * target.config.hidden_size,
                      generator=torch.Generator().manual_seed(0))
    logits = []
    for directory in (PAIR.eagle3, old):
        head = load_draft(directory, target, torch.float32, "cpu", sdpa)
        assert head.embed_tokens is target.embed_tokens
        batch = PagedBatch(1)
        num_layers, num_kv_heads, head_dim = head.kv_cache_spec()
        caches = allocate_kv_cache(num_layers, batch.num_blocks, batch.block_size, num_kv_heads,
                                   head_dim, torch.float32, "cpu")
        input_ids, positions, metadata, _ = batch.step([ids.tolist()], sdpa)
        hidden = head(input_ids, positions, head.combine_hidden_states(aux), caches, metadata)
        logits.append(head.compute_draft_logits(hidden))
    assert torch.equal(logits[0], logits[1])
