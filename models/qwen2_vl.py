"""Qwen2-VL and Qwen2.5-VL targets: the Qwen2 decoder with M-RoPE plus the vision tower, from
a Hugging Face ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration``
checkpoint (the towers differ, models/vision.py; the decoder and positions do not).

Keys: on disk (Hub, ``save_pretrained``) ``visual.*``, ``model.*`` (the Qwen2 LLM) and
``lm_head.weight`` (absent when tied); newer transformers name them ``model.visual.*`` and
``model.language_model.*`` in memory: both layouts are read. config.json holds the LLM's
fields at the top (transformers 4) or under ``text_config`` (transformers 5), the tower's
under ``vision_config``, and the special token ids (image pad, vision start / end) at the top.

The decoder is ``LlamaForCausalLM`` (models/llama.py) with Qwen2's q/k/v biases and M-RoPE
(``rope_scaling.mrope_section``: three contiguous sections of the head_dim / 2 frequencies,
turned by the temporal, height and width rows of the positions). Image embeddings are
spliced over the image-pad tokens (models/embed_splice.py) and positions follow the image
grid (models/mrope.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rocdraft.backends.base import AttentionBackend
from rocdraft.errors import CheckpointError
from rocdraft.models.config import ModelConfig, read_config_json, read_json
from rocdraft.models.image_processing import (ImageProcessorConfig, load_image_processor_config,
                                              preprocess_image)
from rocdraft.models.llama import _ALLOWED_UNUSED, LlamaForCausalLM, _check_layer_count
from rocdraft.models.mrope import image_token_count
from rocdraft.models.vision import VisionConfig, VisionTower
from rocdraft.models.weights import copy_weights, load_state_dict

VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
_VL_MODEL_TYPES = {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                   "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


def vl_architecture(raw: dict[str, Any]) -> str | None:
    """The vision-language architecture a config.json names, else None."""
    names = list(raw.get("architectures") or []) + [_VL_MODEL_TYPES.get(raw.get("model_type"))]
    return next((name for name in names if name in VL_ARCHITECTURES), None)


def is_vl_checkpoint(path: str | Path) -> bool:
    return vl_architecture(read_config_json(path)) is not None


def check_mrope_section(scaling: dict[str, Any] | None, head_dim: int, where: str) -> None:
    """CheckpointError unless the M-RoPE sections sum to head_dim / 2."""
    section = (scaling or {}).get("mrope_section")
    if section is None:
        return
    if not isinstance(section, (list, tuple)) or len(section) != 3 \
            or sum(section) != head_dim // 2:
        raise CheckpointError(f"{where}: mrope_section {section} must be 3 sections summing to "
                              f"head_dim / 2 = {head_dim // 2} (head_dim {head_dim})")


@dataclass(frozen=True)
class VisionLanguageConfig:
    text: ModelConfig
    vision: VisionConfig
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    video_token_id: int | None = None

    @property
    def merge_size(self) -> int:
        return self.vision.spatial_merge_size

    @staticmethod
    def from_dict(raw: dict[str, Any], generation_config: dict[str, Any] | None = None
                  ) -> "VisionLanguageConfig":
        arch = vl_architecture(raw)
        if arch is None:
            raise CheckpointError(f"not a vision-language config: architectures "
                                  f"{raw.get('architectures')}; supported: {VL_ARCHITECTURES}")
        nested = raw.get("text_config") or {}
        text = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
        text.update({k: v for k, v in nested.items() if v is not None or k not in text})
        text.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
        if "tie_word_embeddings" in raw:  # transformers 5 writes it at the top only
            text["tie_word_embeddings"] = raw["tie_word_embeddings"]
        text_config = ModelConfig.from_dict(text, generation_config)
        check_mrope_section(text_config.rope_scaling, text_config.head_dim,
                            f"{arch} text config")
        if text_config.rope_scaling is None or "mrope_section" not in text_config.rope_scaling:
            raise CheckpointError(f"{arch} config has no rope_scaling.mrope_section (rope "
                                  f"settings {text_config.rope_scaling})")
        vision = VisionConfig.from_dict(raw.get("vision_config") or {},
                                        qwen2_5=arch == "Qwen2_5_VLForConditionalGeneration")
        if vision.out_hidden_size != text_config.hidden_size:
            field = "out_hidden_size" if vision.windowed else "hidden_size"
            raise CheckpointError(f"{arch}: vision_config.{field} {vision.out_hidden_size} "
                                  f"(the merger's output) differs from the LLM hidden_size "
                                  f"{text_config.hidden_size}")
        ids = {}
        for name, default in (("image_token_id", 151655), ("vision_start_token_id", 151652),
                              ("vision_end_token_id", 151653), ("video_token_id", 151656)):
            value = raw.get(name, nested.get(name, default))
            ids[name] = int(value)
        for name in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            if not 0 <= ids[name] < text_config.vocab_size:
                raise CheckpointError(f"{arch}: {name} {ids[name]} is outside the vocabulary "
                                      f"[0, {text_config.vocab_size})")
        return VisionLanguageConfig(text_config, vision, **ids)


def load_vl_config(path: str | Path) -> VisionLanguageConfig:
    raw = read_config_json(path)
    gen_file = Path(path) / "generation_config.json"
    return VisionLanguageConfig.from_dict(raw, read_json(gen_file) if gen_file.is_file() else None)


@dataclass(frozen=True)
class ImageEmbeddings:
    """One prompt's images through the vision tower."""

    embeds: torch.Tensor  # [sum of token counts, hidden_size], images in order
    grids_thw: tuple[tuple[int, int, int], ...]
    token_counts: tuple[int, ...]  # image-pad tokens of each image


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    """The Qwen2 decoder (``LlamaForCausalLM``'s forward, with an ``EmbedSplice``) plus
    ``visual``, the vision tower, and the image preprocessing settings."""

    def __init__(self, config: VisionLanguageConfig, attn_backend: type[AttentionBackend],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 image_processor: ImageProcessorConfig | None = None) -> None:
        super().__init__(config.text, attn_backend, dtype, device)
        self.vl_config = config
        self.visual = VisionTower(config.vision, dtype, device)
        self.image_processor = image_processor or ImageProcessorConfig()

    @torch.no_grad()
    def encode_images(self, images: list[Any]) -> ImageEmbeddings:
        """PIL images, paths or bytes -> their embeddings (ValueError naming a bad image)."""
        processed = [preprocess_image(image, self.image_processor) for image in images]
        grids = tuple(p.grid_thw for p in processed)
        device = self.embed_tokens.weight.device
        pixels = torch.cat([p.pixel_values for p in processed]).to(device)
        embeds = self.visual(pixels, list(grids))
        counts = tuple(image_token_count(g, self.vl_config.merge_size) for g in grids)
        return ImageEmbeddings(embeds, grids, counts)


def _checkpoint_key(name: str) -> str:
    if name.startswith(("lm_head.", "visual.")):
        return name
    return f"model.{name}"


def _on_disk_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model.language_model.*`` -> ``model.*``, ``model.visual.*`` -> ``visual.*``."""
    out = {}
    for key, value in state.items():
        if key.startswith("model.language_model."):
            key = "model." + key[len("model.language_model."):]
        elif key.startswith("model.visual."):
            key = key[len("model."):]
        out[key] = value
    return out


def load_qwen2_vl(path: str | Path, dtype: torch.dtype, device: torch.device | str,
                  attn_backend: type[AttentionBackend]) -> Qwen2VLForConditionalGeneration:
    """The target and its vision tower from a Qwen2-VL checkpoint directory, every weight
    checked and copied."""
    config = load_vl_config(path)
    state = _on_disk_keys(load_state_dict(path))
    model = Qwen2VLForConditionalGeneration(config, attn_backend, dtype, "meta",
                                            load_image_processor_config(path))
    model.to_empty(device=device)
    model.tie_weights()
    model.rotary_emb.reset_inv_freq()
    where = f"target checkpoint {path}"
    _check_layer_count(state, config.text.num_hidden_layers, where)
    tied = config.text.tie_word_embeddings
    skip = ("lm_head.",) if tied else ()
    copy_weights(model, state, _checkpoint_key, skip=skip, where=where,
                 allowed_unused=_ALLOWED_UNUSED + (("lm_head.weight",) if tied else ()))
    return model.eval().requires_grad_(False)
