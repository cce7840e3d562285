"""models/weights.py and load_target: every checkpoint layout, and every bad input named."""
from __future__ import annotations

import collections
import json
import pickle
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import write_tiny_llama
from rocdraft.backends.registry import get_backend
from rocdraft.errors import CheckpointError
from rocdraft.models.llama import load_target
from rocdraft.models.weights import load_state_dict, weight_files

SDPA = get_backend("TORCH_SDPA")  # loading does not run attention


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("w") / "tiny", kind="qwen2", tokenizer=False)


@pytest.fixture
def copy_of(tiny, tmp_path):
    """A fresh copy of the tiny checkpoint (config + generation config, no weights)."""
    def make(with_weights: bool = False):
        d = tmp_path / "ckpt"
        d.mkdir()
        for name in ("config.json", "generation_config.json"):
            shutil.copy(tiny / name, d / name)
        if with_weights:
            shutil.copy(tiny / "model.safetensors", d / "model.safetensors")
        return d
    return make


def _reference_state(tiny):
    return load_file(str(tiny / "model.safetensors"))


def _assert_loaded(model, state):
    for name, tensor in model.state_dict().items():
        key = name if name.startswith("lm_head.") else f"model.{name}"
        torch.testing.assert_close(tensor, state[key], rtol=0, atol=0)


def test_single_safetensors(tiny):
    assert [f.name for f in weight_files(tiny)] == ["model.safetensors"]
    _assert_loaded(load_target(tiny, torch.float32, "cpu", SDPA), _reference_state(tiny))


def test_sharded_safetensors_with_index(tiny, tmp_path):
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    files = weight_files(tmp_path / "sharded")
    assert len(files) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    _assert_loaded(load_target(tmp_path / "sharded", torch.float32, "cpu", SDPA),
                   _reference_state(tiny))


def test_pytorch_model_bin(tiny, copy_of):
    d = copy_of()
    torch.save(_reference_state(tiny), d / "pytorch_model.bin")
    assert [f.name for f in weight_files(d)] == ["pytorch_model.bin"]
    _assert_loaded(load_target(d, torch.float32, "cpu", SDPA), _reference_state(tiny))


def test_sharded_bin_with_index(tiny, copy_of):
    d = copy_of()
    state = _reference_state(tiny)
    keys = sorted(state)
    halves = {"pytorch_model-00001-of-00002.bin": keys[::2],
              "pytorch_model-00002-of-00002.bin": keys[1::2]}
    for name, part in halves.items():
        torch.save({k: state[k] for k in part}, d / name)
    weight_map = {k: name for name, part in halves.items() for k in part}
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert load_state_dict(d).keys() == state.keys()


def test_dtype_conversion(tiny):
    model = load_target(tiny, torch.bfloat16, "cpu", SDPA)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary_emb.inv_freq.dtype == torch.float32


def test_bin_is_loaded_with_weights_only(tiny, copy_of):
    d = copy_of()
    torch.save({"model.norm.weight": torch.ones(3), "evil": shutil.copy}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"holds objects other than tensors \(such as "
                                              r"shutil\.copy\).*will not unpickle.*safetensors"):
        load_state_dict(d)


def test_refused_pickle_is_one_line_without_torchs_advice_or_warnings(copy_of, capfd):
    """A plain pickle (protocol 4) makes torch warn in two lines and advise weights_only=False;
    rocdraft says in one line that it will not unpickle it, and nothing is printed."""
    d = copy_of()
    with open(d / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.norm.weight": collections.Counter()}, f, protocol=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError) as info:
            load_state_dict(d)
    message = str(info.value)
    assert "\n" not in message and "weights_only=False" not in message
    assert "holds objects other than tensors" in message and "safetensors" in message
    assert caught == [] and capfd.readouterr() == ("", "")


def test_bin_with_non_tensor_entries_is_refused(tiny, copy_of):
    d = copy_of()
    torch.save({**_reference_state(tiny), "step": 3}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"holds 1 non-tensor entry: step"):
        load_state_dict(d)


def test_rotary_inv_freq_is_allowed_and_other_unused_keys_are_refused(tiny, copy_of):
    d = copy_of()
    state = _reference_state(tiny)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(state, str(d / "model.safetensors"))
    load_target(d, torch.float32, "cpu", SDPA)
    state.update({f"model.extra.{i}.weight": torch.ones(2) for i in range(6)})
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"6 unexpected weight\(s\) the model does not "
                                              r"use: model\.extra\.0\.weight, .* \(\+2 more\)"):
        load_target(d, torch.float32, "cpu", SDPA)


def test_config_with_fewer_layers_than_the_checkpoint_is_refused(tiny, copy_of):
    d = copy_of(with_weights=True)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(CheckpointError, match=r"num_hidden_layers 2 but the checkpoint has "
                                              r"weights for layer\(s\) up to model\.layers\.2 "
                                              r"\(3 layers\)"):
        load_target(d, torch.float32, "cpu", SDPA)


def test_tied_checkpoint_may_store_lm_head(tmp_path):
    tied = write_tiny_llama(tmp_path / "tied", kind="llama3", tokenizer=False)
    state = load_file(str(tied / "model.safetensors"))
    assert "lm_head.weight" not in state
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(tied / "model.safetensors"))
    model = load_target(tied, torch.float32, "cpu", SDPA)
    assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.int64])
def test_non_floating_weight_is_refused_by_key_and_dtype(tiny, copy_of, dtype):
    d = copy_of()
    state = _reference_state(tiny)
    state["model.layers.1.mlp.up_proj.weight"] = torch.ones(128, 64, dtype=dtype)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"weight model\.layers\.1\.mlp\.up_proj\.weight "
                                              rf"has dtype {dtype}, expected a floating-point"):
        load_target(d, torch.float32, "cpu", SDPA)


def test_missing_weight_is_named(tiny, copy_of):
    d = copy_of()
    state = _reference_state(tiny)
    del state["model.layers.1.self_attn.q_proj.bias"]
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing weight\(s\) model\.layers\.1\.self_attn"
                                              r"\.q_proj\.bias"):
        load_target(d, torch.float32, "cpu", SDPA)


def test_wrong_shape_names_key_and_both_shapes(tiny, copy_of):
    d = copy_of()
    state = _reference_state(tiny)
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 64)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape "
                                              r"\[64, 64\], expected \[128, 64\]"):
        load_target(d, torch.float32, "cpu", SDPA)


def test_missing_dir_config_and_weights(tmp_path, copy_of):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_target(tmp_path / "absent", torch.float32, "cpu", SDPA)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_target(tmp_path / "empty", torch.float32, "cpu", SDPA)
    with pytest.raises(CheckpointError, match=r"no weights in .*found \['config.json'"):
        load_target(copy_of(), torch.float32, "cpu", SDPA)


def test_index_naming_absent_shard(copy_of):
    d = copy_of()
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors"):
        weight_files(d)


def test_unsupported_architecture_named_at_load(copy_of):
    d = copy_of(with_weights=True)
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["GemmaForCausalLM"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="GemmaForCausalLM"):
        load_target(d, torch.float32, "cpu", SDPA)


def test_hub_style_rope_config_loads_like_transformers5(tmp_path):
    """Hub checkpoints spell RoPE as rope_theta + rope_scaling; transformers 5 writes
    rope_parameters. Both give the same config."""
    from rocdraft.models.config import load_model_config
    tf5 = write_tiny_llama(tmp_path / "tf5", kind="llama3", tokenizer=False)
    hub = tmp_path / "hub"
    shutil.copytree(tf5, hub)
    config = json.loads((hub / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    (hub / "config.json").write_text(json.dumps(config))
    assert load_model_config(hub) == load_model_config(tf5)
    assert load_model_config(hub).rope_scaling["rope_type"] == "llama3"
