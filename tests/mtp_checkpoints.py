"""Test utilities: tiny targets with MTP layers in the two real key layouts.

- ``write_mimo_target``: a Qwen2 trunk (written by transformers) whose config says
  ``MiMoForCausalLM`` / ``model_type: "mimo"`` and whose model.safetensors also holds
  ``model.mtp_layers.{j}.*`` (token_layernorm, hidden_layernorm, input_proj [H, 2H],
  final_layernorm, a Qwen2 block with q/k/v biases), as XiaomiMiMo/MiMo-7B ships them.
- ``write_deepseek_layout_target``: a Llama trunk plus ``model.layers.{L+j}.*`` (enorm, hnorm,
  eh_proj [H, 2H], shared_head.norm, shared_head.head and embed_tokens copies of the trunk's,
  a Llama block), DeepSeek-V3's layout over a Llama block.

``cyclic=True`` builds them on a cyclic target (tests/checkpoints.py): the target mostly
follows a fixed successor map, and MTP layer 0 passes the next token's embedding through
(identity on its half of the projection, ``noise`` on the hidden half and on the block's
o_proj / down_proj, unit norms), so its draft is the successor of the next token: right
wherever the target follows the map. Further MTP layers stay random (models/mtp.py drafts
with layer 0 only). ``cyclic=False``: every MTP weight random at the scale of
tests/checkpoints.py, for formula tests.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from checkpoints import _layer_weights, _linear, _norm, write_cyclic_llama, write_tiny_llama


def _block(g: torch.Generator, prefix: str, config: dict, qkv_bias: bool
           ) -> dict[str, torch.Tensor]:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads, head_dim = config["num_key_value_heads"], config["head_dim"]
    state = _layer_weights(g, prefix, hidden, hidden, config["intermediate_size"], heads,
                           kv_heads, head_dim)
    state[f"{prefix}.input_layernorm.weight"] = _norm(g, hidden)
    if qkv_bias:
        for name, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            state[f"{prefix}.self_attn.{name}_proj.bias"] = \
                0.1 * torch.randn(rows * head_dim, generator=g)
    return state


def _passthrough(g: torch.Generator, state: dict, prefix: str, proj: str, hidden: int,
                 embedding_first: bool, noise: float, norms: tuple[str, ...]) -> None:
    """Make layer ``prefix`` pass the (normed) embedding through: identity on its half of
    ``proj``, ``noise`` elsewhere, unit norms."""
    eye, rest = torch.eye(hidden), noise * _linear(g, hidden, hidden)
    state[f"{prefix}.{proj}.weight"] = torch.cat([eye, rest] if embedding_first
                                                 else [rest, eye], dim=1)
    for key in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        state[f"{prefix}.{key}"] = noise * state[f"{prefix}.{key}"]
    for name in norms + ("input_layernorm", "post_attention_layernorm"):
        state[f"{prefix}.{name}.weight"] = torch.ones(hidden)


def _rewrite(directory: Path, extra: dict[str, torch.Tensor], config_updates: dict) -> Path:
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    state = load_file(str(path))
    state.update(extra)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path),
              metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config.update(config_updates)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def _trunk(directory: Path, kind: str, cyclic: bool, seed: int) -> tuple[Path, dict]:
    if cyclic:
        directory = write_cyclic_llama(directory, seed=seed, kind=kind)
    else:
        directory = write_tiny_llama(directory, kind=kind, seed=seed, num_hidden_layers=2)
    return directory, json.loads((directory / "config.json").read_text())


def write_mimo_target(directory: str | Path, num_mtp_layers: int = 1, cyclic: bool = True,
                      seed: int = 0, noise: float = 0.2) -> Path:
    """A MiMo-layout target (see the module docstring); the trunk is a Qwen2 model that
    ``Qwen2ForCausalLM`` loads from the same tensors minus ``model.mtp_layers.*``."""
    directory, config = _trunk(Path(directory), "qwen2", cyclic, seed)
    hidden = config["hidden_size"]
    g = torch.Generator().manual_seed(seed + 7)
    extra = {}
    for j in range(num_mtp_layers):
        prefix = f"model.mtp_layers.{j}"
        extra.update(_block(g, prefix, config, qkv_bias=True))
        for name in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
            extra[f"{prefix}.{name}.weight"] = _norm(g, hidden)
        extra[f"{prefix}.input_proj.weight"] = _linear(g, hidden, 2 * hidden)
        if cyclic and j == 0:
            _passthrough(g, extra, prefix, "input_proj", hidden, embedding_first=False,
                         noise=noise, norms=("token_layernorm", "hidden_layernorm",
                                             "final_layernorm"))
    return _rewrite(directory, extra, {"architectures": ["MiMoForCausalLM"],
                                       "model_type": "mimo",
                                       "num_nextn_predict_layers": num_mtp_layers})


def write_deepseek_layout_target(directory: str | Path, num_mtp_layers: int = 1,
                                 cyclic: bool = True, seed: int = 0, noise: float = 0.2,
                                 kind: str = "llama") -> Path:
    """A Llama (or ``kind``) target with DeepSeek-V3-layout MTP layers at
    ``model.layers.{L+j}`` (see the module docstring)."""
    from safetensors.torch import load_file

    directory, config = _trunk(Path(directory), kind, cyclic, seed)
    hidden, num_layers = config["hidden_size"], config["num_hidden_layers"]
    trunk = load_file(str(directory / "model.safetensors"))
    g = torch.Generator().manual_seed(seed + 7)
    extra = {}
    for j in range(num_mtp_layers):
        prefix = f"model.layers.{num_layers + j}"
        extra.update(_block(g, prefix, config, qkv_bias=kind == "qwen2"))
        for name in ("enorm", "hnorm", "shared_head.norm"):
            extra[f"{prefix}.{name}.weight"] = _norm(g, hidden)
        extra[f"{prefix}.eh_proj.weight"] = _linear(g, hidden, 2 * hidden)
        extra[f"{prefix}.embed_tokens.weight"] = trunk["model.embed_tokens.weight"].clone()
        extra[f"{prefix}.shared_head.head.weight"] = trunk.get(
            "lm_head.weight", trunk["model.embed_tokens.weight"]).clone()
        if cyclic and j == 0:
            _passthrough(g, extra, prefix, "eh_proj", hidden, embedding_first=True,
                         noise=noise, norms=("enorm", "hnorm", "shared_head.norm"))
    return _rewrite(directory, extra, {"num_nextn_predict_layers": num_mtp_layers})


def mtp_tensors(directory: str | Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under ``prefix`` (e.g. ``model.mtp_layers.0.``), the prefix stripped."""
    from safetensors.torch import load_file

    state = load_file(str(Path(directory) / "model.safetensors"))
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
