"""Finding and loading a target's MTP layers (models/mtp_loader.py): the trunk of an MTP
checkpoint against transformers, which keys the trunk loader skips, what the MTP loader
reads, ``--method mtp`` through generate / bench / serve, and every refusal as one line
naming the value."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import write_tiny_llama
from mtp_checkpoints import write_deepseek_layout_target, write_mimo_target
from rocdraft.backends.registry import get_backend
from rocdraft.entrypoints.cli import main
from rocdraft.config import EngineConfig, SamplingParams, SpeculativeConfig
from rocdraft.engine import LLM
from rocdraft.errors import CheckpointError, RocdraftError
from rocdraft.models.llama import load_target
from rocdraft.models.mtp_loader import drop_mtp_keys, is_mtp_key, load_mtp_head

PROMPTS = [[1, 5, 7, 9, 11, 3], [2, 8]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_loader")
    return {"mimo": write_mimo_target(root / "mimo", cyclic=False, seed=4),
            "deepseek": write_deepseek_layout_target(root / "deepseek", cyclic=False, seed=5),
            "cyclic_mimo": write_mimo_target(root / "cyclic_mimo"),
            "plain": write_tiny_llama(root / "plain", tokenizer=False)}


def _copy_with(src: Path, dst: Path, config: dict | None = None, rename=None) -> Path:
    """A copy of checkpoint ``src`` with config fields replaced (None values removed) and
    keys renamed by ``rename(key) -> key``."""
    dst.mkdir(parents=True)
    raw = json.loads((src / "config.json").read_text())
    for name, value in (config or {}).items():
        if value is None:
            raw.pop(name, None)
        else:
            raw[name] = value
    (dst / "config.json").write_text(json.dumps(raw))
    state = load_file(str(src / "model.safetensors"))
    if rename is not None:
        state = {rename(k): v for k, v in state.items()}
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _one_line(excinfo, *fragments: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# --- the trunk -----------------------------------------------------------------------------

@torch.no_grad()
def _hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _transformers_trunk(directory: Path, layout: str):
    """transformers' Qwen2 (MiMo) or Llama model on the checkpoint's trunk tensors: the MTP
    keys removed, every other key loaded strictly."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    raw = json.loads((directory / "config.json").read_text())
    for name in ("num_nextn_predict_layers", "architectures", "model_type", "auto_map"):
        raw.pop(name, None)
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if layout == "mimo" else \
        (LlamaConfig, LlamaForCausalLM)
    model = model_cls(config_cls(**raw)).float().eval()
    state = load_file(str(directory / "model.safetensors"))
    trunk = {k: v for k, v in state.items()
             if not is_mtp_key(k, raw["num_hidden_layers"], 1)}
    assert len(trunk) < len(state)
    model.load_state_dict(trunk, strict=True)
    return model


@pytest.mark.parametrize("layout", ["mimo", "deepseek"])
def test_target_only_equals_transformers_on_the_trunk(ckpt, layout, attention_backend):
    """A MiMo checkpoint runs target-only as transformers' Qwen2ForCausalLM on its trunk (a
    DeepSeek-layout one as LlamaForCausalLM): the MTP keys are skipped, nothing else is."""
    reference = _transformers_trunk(ckpt[layout], layout)
    llm = LLM(str(ckpt[layout]), attention_backend=attention_backend)
    if layout == "mimo":
        assert llm.model_runner.target.config.architecture == "MiMoForCausalLM"
        assert llm.model_runner.target.config.attention_bias  # the Qwen2 trunk's q/k/v biases
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == \
        [_hf_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS]


def test_is_mtp_key_examples():
    assert is_mtp_key("model.mtp_layers.0.input_proj.weight", 28, 1)
    assert is_mtp_key("model.layers.28.eh_proj.weight", 28, 1)
    assert is_mtp_key("model.layers.29.enorm.weight", 28, 2)
    assert not is_mtp_key("model.layers.27.mlp.up_proj.weight", 28, 1)
    assert not is_mtp_key("model.layers.29.enorm.weight", 28, 1)
    assert not is_mtp_key("model.mtp_layers.1.input_proj.weight", 28, 1)
    assert not is_mtp_key("lm_head.weight", 28, 1)


@pytest.mark.parametrize("layout, fragment", [("mimo", "unexpected weight"),
                                              ("deepseek", "num_hidden_layers 2")])
def test_undeclared_mtp_keys_stay_refused(ckpt, tmp_path, layout, fragment):
    """Without num_nextn_predict_layers in config.json the MTP keys are stray keys, refused
    as before; declared, they are dropped from the trunk's state."""
    stray = _copy_with(ckpt[layout], tmp_path / "stray",
                       {"num_nextn_predict_layers": None})
    with pytest.raises(CheckpointError, match=fragment):
        load_target(stray, torch.float32, "cpu", get_backend("TORCH_SDPA"))
    target = load_target(ckpt[layout], torch.float32, "cpu", get_backend("TORCH_SDPA"))
    state = load_file(str(ckpt[layout] / "model.safetensors"))
    kept = drop_mtp_keys(state, target.config)
    assert all(not k.startswith(("model.mtp_layers.", "model.layers.2.")) for k in kept)
    assert len(kept) < len(state)


def test_tensor_parallel_trunk_loader_skips_the_mtp_keys(ckpt):
    """Each rank of a tensor-parallel target reads its trunk slices; the MTP keys are not
    refused (target-only MiMo under TP)."""
    from rocdraft.distributed.group import ParallelGroup
    from rocdraft.distributed.tp_model import load_tp_target

    for layout in ("mimo", "deepseek"):
        for rank in (0, 1):
            model = load_tp_target(ckpt[layout], ParallelGroup(rank, 2), torch.float32, "cpu",
                                   get_backend("TORCH_SDPA"))
            assert model.config.num_nextn_predict_layers == 1


def test_only_mtp_layer_zero_is_read(ckpt, tmp_path, monkeypatch):
    """The MTP loader reads layer 0's tensors and nothing else from the safetensors file."""
    import safetensors

    two = write_deepseek_layout_target(tmp_path / "two", num_mtp_layers=2, cyclic=False)
    target = load_target(two, torch.float32, "cpu", get_backend("TORCH_SDPA"))
    read, real_open = [], safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.inner.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    head = load_mtp_head(two, target, torch.float32, "cpu", get_backend("TORCH_SDPA"))
    assert read and all(k.startswith("model.layers.2.") for k in read)  # not layers.3.*
    assert head.kv_cache_spec()[0] == 1


# --- the command line ----------------------------------------------------------------------

def _run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _user_error(rc: int, out: str, err: str, *fragments: str) -> None:
    assert rc == 2 and out == "", (out, err)
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("rocdraft: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_generate_method_mtp_is_lossless(capsys, ckpt):
    args = ("generate", "--target", ckpt["cyclic_mimo"], "--prompt-ids", "1,5,7,9",
            "--prompt-ids", "4,4,4,4,4", "--max-new-tokens", 12, "--attention-backend",
            "TORCH_SDPA", "--json")
    rc, plain, err = _run(capsys, *args, "--method", "none")
    assert rc == 0, err
    rc, spec, err = _run(capsys, *args, "--method", "mtp", "--num-speculative-tokens", 3,
                         "--draft-policy", "fixed")
    assert rc == 0, err
    plain, spec = json.loads(plain), json.loads(spec)
    assert [o["token_ids"] for o in spec["outputs"]] == [o["token_ids"] for o in plain["outputs"]]
    assert spec["stats"]["method"] == "mtp"
    assert spec["stats"]["acceptance_length"] > 1.5


def test_bench_method_mtp(capsys, ckpt, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a b c\nd e\n")
    rc, out, err = _run(capsys, "bench", "--target", ckpt["cyclic_mimo"], "--method", "mtp",
                        "--num-speculative-tokens", 2, "--prompts-file", prompts,
                        "--max-new-tokens", 4, "--repeat", 1, "--batch-size", 2, "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["config"]["method"] == "mtp"
    assert report["results"][0]["greedy_outputs_identical"] is True


def test_serve_flags_build_an_mtp_engine(ckpt):
    pytest.importorskip("fastapi")
    from rocdraft.entrypoints.cli import build_parser
    from rocdraft.entrypoints.cli_options import make_engine

    args = build_parser("serve").parse_args(["serve", "--target", str(ckpt["cyclic_mimo"]),
                                             "--method", "mtp"])
    engine, method = make_engine(args)
    assert method == "mtp" and engine.config.speculative.method == "mtp"
    assert engine.config.draft is None


# --- bad inputs: one line each, naming the value ---------------------------------------------

def test_mtp_on_a_target_without_mtp_layers(ckpt, capsys):
    with pytest.raises(RocdraftError) as excinfo:
        LLM(str(ckpt["plain"]), speculative_config=SpeculativeConfig("mtp", 2))
    _one_line(excinfo, "has no MTP layers", "num_nextn_predict_layers", str(ckpt["plain"]))
    _user_error(*_run(capsys, "generate", "--target", ckpt["plain"], "--method", "mtp",
                      "--prompt-ids", "1,2"), "no MTP layers", "num_nextn_predict_layers")


@pytest.mark.parametrize("count", [0, -1, "1", True])
def test_mtp_layer_count_below_one_is_refused(ckpt, tmp_path, count):
    target = _copy_with(ckpt["mimo"], tmp_path / "zero", {"num_nextn_predict_layers": count})
    with pytest.raises(RocdraftError) as excinfo:
        LLM(str(target), speculative_config=SpeculativeConfig("mtp", 2))
    _one_line(excinfo, f"num_nextn_predict_layers is {count!r}")


@pytest.mark.parametrize("fields, fragment", [
    ({"q_lora_rank": 16, "kv_lora_rank": 8}, "q_lora_rank=16, kv_lora_rank=8"),
    ({"n_routed_experts": 4, "model_type": "deepseek_v3",
      "architectures": ["DeepseekV3ForCausalLM"]}, "n_routed_experts=4"),
])
def test_deepseek_moe_mla_config_is_refused_by_name(ckpt, tmp_path, fields, fragment):
    target = _copy_with(ckpt["deepseek"], tmp_path / "moe", fields)
    with pytest.raises(CheckpointError) as excinfo:
        LLM(str(target), speculative_config=SpeculativeConfig("mtp", 2))
    _one_line(excinfo, "DeepSeek MoE/MLA MTP block", fragment, "Llama/Qwen2 block")


@pytest.mark.parametrize("old, new", [
    ("mlp.gate_proj.", "mlp.experts.0.gate_proj."),
    ("self_attn.k_proj.", "self_attn.kv_a_proj_with_mqa."),
])
def test_deepseek_moe_mla_keys_are_refused_by_name(ckpt, tmp_path, old, new):
    """A Llama-config checkpoint whose MTP block holds MoE / MLA weights."""
    target = _copy_with(ckpt["deepseek"], tmp_path / "moe_keys",
                        rename=lambda k: k.replace(old, new) if k.startswith("model.layers.2.")
                        else k)
    with pytest.raises(CheckpointError) as excinfo:
        LLM(str(target), speculative_config=SpeculativeConfig("mtp", 2))
    _one_line(excinfo, "DeepSeek MoE/MLA MTP block", f"model.layers.2.{new}")


def test_draft_with_mtp_is_refused(ckpt, capsys):
    with pytest.raises(RocdraftError) as excinfo:
        EngineConfig(target=str(ckpt["mimo"]), draft="/some/head",
                     speculative=SpeculativeConfig("mtp"))
    _one_line(excinfo, "draft='/some/head'", "method 'mtp'", "drop draft")
    _user_error(*_run(capsys, "generate", "--target", ckpt["mimo"], "--method", "mtp",
                      "--draft", ckpt["plain"], "--prompt-ids", "1,2"),
                "--draft", "--method mtp", "target's own checkpoint")


def test_declared_and_stored_layer_counts_must_agree(ckpt, tmp_path):
    target = _copy_with(ckpt["mimo"], tmp_path / "two", {"num_nextn_predict_layers": 2})
    with pytest.raises(CheckpointError) as excinfo:
        LLM(str(target), speculative_config=SpeculativeConfig("mtp", 2))
    _one_line(excinfo, "num_nextn_predict_layers 2", "model.mtp_layers.{0}")


def test_mtp_with_tensor_parallelism_is_refused(ckpt):
    with pytest.raises(RocdraftError) as excinfo:
        LLM(str(ckpt["mimo"]), speculative_config=SpeculativeConfig("mtp", 2),
            tensor_parallel_size=2)
    _one_line(excinfo, "tensor_parallel_size 2")


def test_method_mtp_is_a_speculative_method():
    assert SpeculativeConfig("mtp", 3).method == "mtp"
    with pytest.raises(RocdraftError, match="'mtp'"):
        SpeculativeConfig("mtpp")
