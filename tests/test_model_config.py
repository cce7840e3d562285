"""models/config.py: parsing HF config.json dicts into ModelConfig / HeadConfig."""
from __future__ import annotations

import dataclasses
import json

import pytest

from checkpoints import LLAMA3_ROPE, write_tiny_llama
from rocdraft.errors import CheckpointError
from rocdraft.models.config import HeadConfig, ModelConfig, load_model_config, parse_rope

BASE = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("config")
    return {kind: write_tiny_llama(root / kind, kind=kind, tokenizer=False)
            for kind in ("llama", "llama3", "qwen2")}


def test_tiny_llama_fields(dirs):
    c = load_model_config(dirs["llama"])
    assert (c.architecture, c.vocab_size, c.hidden_size, c.num_hidden_layers) == (
        "LlamaForCausalLM", 160, 64, 3)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert c.rope_theta == 10000.0 and c.rope_scaling is None
    assert not c.tie_word_embeddings and not c.attention_bias
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1


def test_llama3_rope_and_tied(dirs):
    c = load_model_config(dirs["llama3"])
    assert c.tie_word_embeddings
    assert c.rope_theta == 500000.0
    expected = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    assert c.rope_scaling == expected
    assert c.eos_token_ids == (2, 3)


def test_qwen2_has_qkv_bias_and_no_window(dirs):
    c = load_model_config(dirs["qwen2"])
    assert c.architecture == "Qwen2ForCausalLM" and c.attention_bias
    assert c.rope_theta == 1000000.0 and c.sliding_window is None


def test_hub_and_transformers5_rope_spellings_agree():
    hub = dict(BASE, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    tf5 = dict(BASE, rope_parameters=dict(hub["rope_scaling"], rope_theta=500000.0))
    assert ModelConfig.from_dict(hub) == ModelConfig.from_dict(tf5)


def test_old_style_type_key_and_default_theta():
    c = ModelConfig.from_dict(dict(BASE, rope_scaling={"type": "linear", "factor": 2.0}))
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.rope_theta == 10000.0
    assert ModelConfig.from_dict(dict(BASE, rope_scaling=None)).rope_scaling is None


def test_mrope_section_recognised():
    theta, scaling = parse_rope({"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}})
    assert scaling == {"rope_type": "mrope", "mrope_section": [2, 3, 3]}
    _, scaling = parse_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 5.0,
                                                 "mrope_section": [2, 3, 3]}})
    assert scaling["rope_type"] == "mrope"


def test_eos_ids_union_with_generation_config():
    c = ModelConfig.from_dict(dict(BASE, eos_token_id=2), {"eos_token_id": [7, 2, 9]})
    assert c.eos_token_ids == (2, 7, 9)
    assert ModelConfig.from_dict(dict(BASE, eos_token_id=None)).eos_token_ids == ()


def test_head_dim_derived_or_explicit_and_kv_default():
    raw = dict(BASE, head_dim=None)
    del raw["num_key_value_heads"]
    c = ModelConfig.from_dict(raw)
    assert c.head_dim == 16 and c.num_key_value_heads == 4
    assert ModelConfig.from_dict(dict(BASE, head_dim=32)).head_dim == 32


def test_mistral_records_sliding_window():
    c = ModelConfig.from_dict(dict(BASE, architectures=["MistralForCausalLM"],
                                   sliding_window=4096))
    assert c.architecture == "MistralForCausalLM" and c.sliding_window == 4096


def test_architecture_from_model_type_when_absent():
    raw = dict(BASE, model_type="qwen2")
    del raw["architectures"]
    assert ModelConfig.from_dict(raw).architecture == "Qwen2ForCausalLM"


def test_unsupported_architecture_is_named():
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelConfig.from_dict(dict(BASE, architectures=["GPT2LMHeadModel"]))


@pytest.mark.parametrize("changes, pattern", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"vocab_size": 0}, "vocab_size"),
])
def test_bad_values_are_named(changes, pattern):
    with pytest.raises(CheckpointError, match=pattern):
        ModelConfig.from_dict(dict(BASE, **changes))


def test_missing_field_is_named():
    raw = dict(BASE)
    del raw["hidden_size"]
    with pytest.raises(CheckpointError, match="hidden_size"):
        ModelConfig.from_dict(raw)


def test_missing_dir_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model_config(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model_config(tmp_path)


def test_config_is_frozen(dirs):
    c = load_model_config(dirs["llama"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 8


def test_head_config_defaults():
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 160, "draft_vocab_size": 80}
    c = HeadConfig.from_dict(raw)
    assert c.rope_theta == 10000.0 and c.rope_scaling is None and c.bias
    assert (c.head_dim, c.draft_vocab_size, c.target_hidden_size) == (16, 80, None)
    c = HeadConfig.from_dict(dict(raw, draft_vocab_size=None, bias=False, rope_theta=5e5))
    assert c.draft_vocab_size == 160 and not c.bias and c.rope_theta == 5e5
    with pytest.raises(CheckpointError, match="draft_vocab_size 200 exceeds vocab_size 160"):
        HeadConfig.from_dict(dict(raw, draft_vocab_size=200))


HEAD = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 160}


def test_head_config_qkv_bias_defaults_to_false():
    """SafeAILab/EAGLE eagle/model/cnets1.py: q/k/v get biases only when the config has
    ``qkv_bias`` (and then as it says)."""
    assert not HeadConfig.from_dict(HEAD).qkv_bias
    assert HeadConfig.from_dict(dict(HEAD, qkv_bias=True)).qkv_bias
    assert not HeadConfig.from_dict(dict(HEAD, qkv_bias=False)).qkv_bias


def test_head_config_reads_aux_layer_ids_where_vllm_does():
    """vLLM's gpu_model_runner (_get_eagle3_aux_layers_from_config) reads
    ``eagle_aux_hidden_state_layer_ids`` at the top level, else under ``eagle_config``."""
    assert HeadConfig.from_dict(HEAD).aux_layer_ids is None
    top = dict(HEAD, eagle_aux_hidden_state_layer_ids=[1, 7, 12])
    assert HeadConfig.from_dict(top).aux_layer_ids == (1, 7, 12)
    nested = dict(HEAD, eagle_config={"eagle_aux_hidden_state_layer_ids": [3, 4, 5]})
    assert HeadConfig.from_dict(nested).aux_layer_ids == (3, 4, 5)
    both = dict(top, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 7, 12]})
    assert HeadConfig.from_dict(both).aux_layer_ids == (1, 7, 12)


@pytest.mark.parametrize("changes, pattern", [
    ({"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}, r"3 distinct target layer ids >= 0, "
                                                      r"got \[1, 1, 2\]"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2]}, r"got \[1, 2\]"),
    ({"eagle_aux_hidden_state_layer_ids": [-1, 2, 3]}, r"got \[-1, 2, 3\]"),
    ({"eagle_aux_hidden_state_layer_ids": [1.5, 2, 3]}, r"got \[1.5, 2, 3\]"),
    ({"eagle_aux_hidden_state_layer_ids": []}, r"got \[\]"),
    ({"eagle_aux_hidden_state_layer_ids": 5}, r"must be a list of 3 layer ids, got 5"),
    ({"eagle_aux_hidden_state_layer_ids": 5, "eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}, r"must be a list of 3 layer ids, got 5"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2, 3],
      "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}, "disagree"),
    ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state False"),
    ({"eagle_config": [1]}, "eagle_config must be a dict"),
])
def test_head_config_bad_aux_layer_ids_are_named(changes, pattern):
    with pytest.raises(CheckpointError, match=pattern):
        HeadConfig.from_dict(dict(HEAD, **changes))


def test_config_json_must_be_object(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(CheckpointError, match="JSON object"):
        load_model_config(tmp_path)
