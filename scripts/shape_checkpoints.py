"""Random-weight checkpoints with real models' configs, for scripts/bench_shapes.py.

``SHAPES`` holds the Hugging Face config.json fields of Llama-3.1-8B, Llama-3.2-1B and
Qwen2.5-7B (plus ``tiny`` for CI); ``write_checkpoint`` writes a target of that shape, or an
EAGLE-1 head of its shape (one layer, ``fc`` over the embedding and the target feature, no
embedding of its own: the loader shares the target's), as sharded safetensors with
``model.safetensors.index.json``; ``weight_bytes_per_step`` is what a decode step reads (the
roofline's numerator). Random weights time exactly like the real ones (same shapes, same
kernels) and say nothing about acceptance.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-5,
          "bos_token_id": 128000, "eos_token_id": 128001, "rope_theta": 500000.0,
          "max_position_embeddings": 131072}
# The real configs (Hugging Face config.json of each model; random weights here).
SHAPES: dict[str, dict] = {
    "llama-3.1-8b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                     "rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": False},
    "llama-3.2-1b": {**_LLAMA, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                     "rope_scaling": {**LLAMA3_ROPE, "factor": 32.0},
                     "tie_word_embeddings": True},
    "qwen2.5-7b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                   "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 152064,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                   "max_position_embeddings": 131072, "sliding_window": 131072,
                   "use_sliding_window": False, "max_window_layers": 28,
                   "tie_word_embeddings": False, "bos_token_id": 151643,
                   "eos_token_id": 151643},
    # CI: the same code paths in seconds on a CPU.
    "tiny": {**_LLAMA, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "vocab_size": 256, "rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": False,
             "bos_token_id": 1, "eos_token_id": 2},
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SHARD_BYTES = 4 << 30


def linear_shapes(cfg: dict, head: bool = False) -> dict[str, tuple[int, ...]]:
    """Every weight of the target (or of an EAGLE-1 head of its shape) by checkpoint key."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    bias = cfg["model_type"] == "qwen2" and not head
    shapes: dict[str, tuple[int, ...]] = {}
    layers = 1 if head else cfg["num_hidden_layers"]
    for i in range(layers):
        p = f"layers.{i}" if head else f"model.layers.{i}"
        shapes.update({f"{p}.self_attn.q_proj.weight": (q, h),
                       f"{p}.self_attn.k_proj.weight": (kv, h),
                       f"{p}.self_attn.v_proj.weight": (kv, h),
                       f"{p}.self_attn.o_proj.weight": (h, q),
                       f"{p}.mlp.gate_proj.weight": (inter, h),
                       f"{p}.mlp.up_proj.weight": (inter, h),
                       f"{p}.mlp.down_proj.weight": (h, inter),
                       f"{p}.post_attention_layernorm.weight": (h,)})
        if not head:
            shapes[f"{p}.input_layernorm.weight"] = (h,)
        if bias:
            shapes.update({f"{p}.self_attn.q_proj.bias": (q,), f"{p}.self_attn.k_proj.bias": (kv,),
                           f"{p}.self_attn.v_proj.bias": (kv,)})
    if head:
        shapes["fc.weight"] = (h, 2 * h)
        return shapes
    shapes["model.embed_tokens.weight"] = (cfg["vocab_size"], h)
    shapes["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def weight_bytes_per_step(cfg: dict, dtype: torch.dtype) -> int:
    """Bytes a decode step must read: every linear weight of every layer and lm_head once
    (embedding rows and norms are negligible and not counted)."""
    total = sum(torch.Size(s).numel() for k, s in linear_shapes(cfg).items()
                if k.endswith("proj.weight"))
    total += cfg["vocab_size"] * cfg["hidden_size"]  # lm_head (tied or not)
    return total * dtype.itemsize


def _random(shape: tuple[int, ...], key: str, dtype: torch.dtype, device: str,
            gen: torch.Generator) -> torch.Tensor:
    if key.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    scale = 0.02 if key.endswith(".bias") or "embed_tokens" in key else shape[-1] ** -0.5
    return (t * scale).to(dtype).cpu()


def write_checkpoint(directory: Path, cfg: dict, dtype: torch.dtype, device: str,
                     head: bool = False) -> float:
    """Sharded safetensors + index + config.json in ``directory`` (skipped when a complete one
    with the same config is there) -> seconds spent writing (0.0 when reused)."""
    from safetensors.torch import save_file

    config = dict(cfg, torch_dtype=str(dtype).removeprefix("torch."))
    if head:
        config = {k: v for k, v in config.items() if k not in ("rope_scaling",)}
        config.update(architectures=["LlamaForCausalLM"], model_type="llama",
                      num_hidden_layers=1, bias=False, rope_theta=10000.0,
                      max_position_embeddings=2048)
    marker = directory / "complete.json"
    if marker.exists() and json.loads(marker.read_text()) == config:
        return 0.0
    start = time.perf_counter()
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    gen = torch.Generator(device=device).manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, shape in linear_shapes(cfg, head).items():
        t = _random(shape, key, dtype, device, gen)
        if size and size + t.nbytes > SHARD_BYTES:
            save_file(shards[-1], str(directory / f"part-{len(shards)}"))
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += t.nbytes
    save_file(shards[-1], str(directory / f"part-{len(shards)}"))
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        os.replace(directory / f"part-{i}", directory / name)
        weight_map.update({key: name for key in shard})
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    marker.write_text(json.dumps(config))
    return time.perf_counter() - start


def checkpoint_root(requested: str | None, needed: int) -> Path:
    """/dev/shm when it has room for ``needed`` bytes (+10%), else the temp folder."""
    if requested:
        return Path(requested)
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > needed * 1.1:
        return shm / "rocdraft-bench-shapes"
    return Path(tempfile.gettempdir()) / "rocdraft-bench-shapes"
