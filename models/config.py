"""Model configs parsed from Hugging Face ``config.json`` dicts.

``ModelConfig`` describes a target (Llama / Qwen2 / Mistral family); ``HeadConfig`` describes
an EAGLE-1 or EAGLE-3 draft head. Both are frozen and validated in ``__post_init__``.

RoPE settings come in two spellings, both accepted:

- hub checkpoints: top-level ``rope_theta`` and ``rope_scaling`` (``{"rope_type" | "type": ...}``);
- transformers 5: ``rope_parameters = {"rope_type": ..., "rope_theta": ..., ...}``.

They are normalised to ``rope_theta: float`` plus ``rope_scaling: dict | None`` (None for plain
RoPE), where ``rope_scaling`` always spells its type as ``rope_type`` and never holds the theta.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rocdraft.errors import CheckpointError

# MiMo (XiaomiMiMo/MiMo-7B) is a Qwen2 trunk plus MTP layers (models/mtp.py).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM",
                           "MiMoForCausalLM")
_ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "mistral": "MistralForCausalLM", "mimo": "MiMoForCausalLM"}
_QWEN2_TRUNKS = ("Qwen2ForCausalLM", "MiMoForCausalLM")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "mrope")
_ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                             "original_max_position_embeddings")}
DEFAULT_ROPE_THETA = 10000.0
NUM_AUX_LAYERS = 3  # EAGLE-3 fc reads 3 target layers (reference and vLLM alike)


def parse_rope(raw: dict[str, Any], default_theta: float = DEFAULT_ROPE_THETA
               ) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either spelling; see the module docstring."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise CheckpointError(f"rope_parameters must be a dict, got {params!r}")
    if scaling is not None and not isinstance(scaling, dict):
        raise CheckpointError(f"rope_scaling must be a dict or null, got {scaling!r}")
    merged: dict[str, Any] = {**(params or {}), **(scaling or {})}
    if merged and all(isinstance(v, dict) for v in merged.values()):
        raise CheckpointError(f"per-layer-type rope parameters {sorted(merged)} are not supported")
    theta = raw.get("rope_theta")
    if theta is None:
        theta = merged.get("rope_theta", default_theta)
    merged.pop("rope_theta", None)
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if "mrope_section" in merged:
        rope_type = "mrope" if rope_type == "default" else rope_type
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"unsupported rope type {rope_type!r}; supported: {list(ROPE_TYPES)}")
    if rope_type == "default" and not merged:
        return float(theta), None
    missing = [k for k in _ROPE_REQUIRED.get(rope_type, ()) if k not in merged]
    if missing:
        raise CheckpointError(f"rope type {rope_type!r} needs {missing}; got {sorted(merged)}")
    return float(theta), {"rope_type": rope_type, **merged}


def _eos_ids(*values: Any) -> tuple[int, ...]:
    """Union of eos ids (each an int, a list of ints or None), first-seen order kept."""
    ids: list[int] = []
    for value in values:
        for token in (value if isinstance(value, (list, tuple)) else [value]):
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return tuple(ids)


def _positive(owner: str, **fields: int) -> None:
    for name, value in fields.items():
        if not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"{owner}: {name} must be a positive integer, got {value!r}")


def _check_heads(owner: str, num_attention_heads: int, num_key_value_heads: int,
                 head_dim: int) -> None:
    if num_attention_heads % num_key_value_heads:
        raise CheckpointError(f"{owner}: num_attention_heads {num_attention_heads} is not a "
                              f"multiple of num_key_value_heads {num_key_value_heads}")
    if head_dim % 2:
        raise CheckpointError(f"{owner}: head_dim {head_dim} must be even for RoPE")


def _head_dim(raw: dict[str, Any]) -> int:
    return raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]


@dataclass(frozen=True)
class ModelConfig:
    """A target model's shape and settings (the fields the model code reads)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2: True)
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    sliding_window: int | None = None  # recorded, not applied (full attention everywhere)
    # MTP layers stored beside the trunk (models/mtp_loader.py); the trunk loader skips them.
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(f"unsupported architecture {self.architecture!r}; supported: "
                                  f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        _positive(self.architecture, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                  intermediate_size=self.intermediate_size,
                  num_hidden_layers=self.num_hidden_layers,
                  num_attention_heads=self.num_attention_heads,
                  num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                  max_position_embeddings=self.max_position_embeddings)
        _check_heads(self.architecture, self.num_attention_heads, self.num_key_value_heads,
                     self.head_dim)
        mtp = self.num_nextn_predict_layers
        if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
            raise CheckpointError(f"{self.architecture}: num_nextn_predict_layers must be an "
                                  f"integer >= 0, got {mtp!r}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise CheckpointError(f"rms_norm_eps ({self.rms_norm_eps}) and rope_theta "
                                  f"({self.rope_theta}) must be positive")

    @staticmethod
    def from_dict(raw: dict[str, Any], generation_config: dict[str, Any] | None = None
                  ) -> "ModelConfig":
        """Parse a config.json dict (plus generation_config.json, for extra eos ids)."""
        architectures = raw.get("architectures") or []
        arch = architectures[0] if architectures else _ARCH_BY_MODEL_TYPE.get(
            raw.get("model_type"), f"<none; model_type {raw.get('model_type')!r}>")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(f"unsupported architecture {arch!r}; supported: "
                                  f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{arch}: hidden_act {raw['hidden_act']!r} is not supported "
                                  f"(only 'silu')")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in raw]
        if missing:
            raise CheckpointError(f"{arch} config lacks {missing}")
        gen = generation_config or {}
        theta, scaling = parse_rope(raw)
        is_qwen2 = arch in _QWEN2_TRUNKS
        window = raw.get("sliding_window")
        if is_qwen2 and not raw.get("use_sliding_window", False):
            window = None
        bos = raw.get("bos_token_id", gen.get("bos_token_id"))
        return ModelConfig(
            architecture=arch, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            head_dim=_head_dim(raw), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=True if is_qwen2 else bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), gen.get("eos_token_id")),
            bos_token_id=None if bos is None else int(bos), sliding_window=window,
            num_nextn_predict_layers=raw.get("num_nextn_predict_layers") or 0)


@dataclass(frozen=True)
class HeadConfig:
    """An EAGLE draft head's config.json (EAGLE-1 and EAGLE-3 share the fields they use).

    The head's RoPE base is its own ``rope_theta`` (default 10000), never the target's.
    """

    architecture: str  # informational only: formats are recognised by weight keys
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int  # EAGLE-3: size of the head's own lm_head; else == vocab_size
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    target_hidden_size: int | None = None  # EAGLE-3 fc input is 3 * this (None: hidden_size)
    bias: bool = True  # EAGLE-1 fc bias ("bias" absent means true)
    qkv_bias: bool = False  # EAGLE-1 q/k/v biases (Qwen2 heads: "qkv_bias": true)
    # EAGLE-3: the target layers whose residual-stream inputs feed fc (None: 2, L//2, L-3).
    aux_layer_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        owner = f"draft head ({self.architecture})"
        _positive(owner, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                  num_attention_heads=self.num_attention_heads,
                  num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                  vocab_size=self.vocab_size, draft_vocab_size=self.draft_vocab_size,
                  num_hidden_layers=self.num_hidden_layers,
                  max_position_embeddings=self.max_position_embeddings)
        _check_heads(owner, self.num_attention_heads, self.num_key_value_heads, self.head_dim)
        if self.draft_vocab_size > self.vocab_size:
            raise CheckpointError(f"{owner}: draft_vocab_size {self.draft_vocab_size} exceeds "
                                  f"vocab_size {self.vocab_size}")
        if self.target_hidden_size is not None:
            _positive(owner, target_hidden_size=self.target_hidden_size)
        ids = self.aux_layer_ids
        if ids is not None and (len(ids) != NUM_AUX_LAYERS or len(set(ids)) != len(ids) or any(
                not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids)):
            raise CheckpointError(f"{owner}: eagle_aux_hidden_state_layer_ids must list "
                                  f"{NUM_AUX_LAYERS} distinct target layer ids >= 0, got "
                                  f"{list(ids)}")

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> "HeadConfig":
        architectures = raw.get("architectures") or ["<unnamed>"]
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                               "vocab_size") if k not in raw]
        if missing:
            raise CheckpointError(f"draft head config ({architectures[0]}) lacks {missing}")
        theta, scaling = parse_rope(raw)
        return HeadConfig(
            architecture=architectures[0], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            head_dim=_head_dim(raw), vocab_size=raw["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            num_hidden_layers=raw.get("num_hidden_layers") or 1,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_scaling=scaling, max_position_embeddings=raw.get("max_position_embeddings", 2048),
            target_hidden_size=raw.get("target_hidden_size"),
            bias=bool(raw.get("bias", True)), qkv_bias=bool(raw.get("qkv_bias", False)),
            aux_layer_ids=_aux_layer_ids(raw, architectures[0]))


def _aux_layer_ids(raw: dict[str, Any], arch: str) -> tuple[int, ...] | None:
    """``eagle_aux_hidden_state_layer_ids`` at the top level or under ``eagle_config``, where
    vLLM reads them (gpu_model_runner ``_get_eagle3_aux_layers_from_config``); None if absent."""
    eagle_config = raw.get("eagle_config")
    if eagle_config is not None and not isinstance(eagle_config, dict):
        raise CheckpointError(f"draft head config ({arch}): eagle_config must be a dict, got "
                              f"{eagle_config!r}")
    eagle_config = eagle_config or {}
    if eagle_config.get("use_aux_hidden_state", True) is not True:
        raise CheckpointError(f"draft head config ({arch}): eagle_config.use_aux_hidden_state "
                              f"{eagle_config['use_aux_hidden_state']!r} is not supported (EAGLE-3 "
                              f"heads read 3 aux hidden states)")
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    nested = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    for ids in (top, nested):
        if ids is not None and not isinstance(ids, (list, tuple)):
            raise CheckpointError(f"draft head config ({arch}): eagle_aux_hidden_state_layer_ids "
                                  f"must be a list of {NUM_AUX_LAYERS} layer ids, got {ids!r}")
    if top is not None and nested is not None and list(top) != list(nested):
        raise CheckpointError(f"draft head config ({arch}): eagle_aux_hidden_state_layer_ids "
                              f"{list(top)} and eagle_config.eagle_aux_hidden_state_layer_ids "
                              f"{list(nested)} disagree")
    ids = top if top is not None else nested
    return None if ids is None else tuple(ids)


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def checkpoint_dir(path: str | Path) -> Path:
    """``path`` as a Path, or a CheckpointError when it is not an existing directory."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {str(directory)!r} "
                              f"{'is not a directory' if directory.exists() else 'does not exist'}")
    return directory


def read_config_json(path: str | Path) -> dict[str, Any]:
    """config.json of the checkpoint directory ``path`` (CheckpointError when absent)."""
    directory = checkpoint_dir(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"no config.json in checkpoint directory {str(directory)!r}")
    return read_json(config_file)


def load_model_config(path: str | Path) -> ModelConfig:
    """ModelConfig of a HF checkpoint directory (config.json + optional generation_config.json)."""
    raw = read_config_json(path)
    gen_file = Path(path) / "generation_config.json"
    generation = read_json(gen_file) if gen_file.is_file() else None
    return ModelConfig.from_dict(raw, generation)
