"""Tiny random Qwen2-VL checkpoints (written by transformers' own classes) and test images.

Token ids in the tiny vocabulary (160): image pad 150, video pad 151, vision start 152,
vision end 153. The tower is 2 blocks of width 32 (2 heads of 16) feeding the LLM's 64.
``preprocessor_config.json`` keeps images small: 56 x 56 to 112 x 112 pixels (4 to 16
merged image tokens).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from checkpoints import TINY, _randomize, make_cyclic, write_tiny_tokenizer

IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 150, 151, 152, 153
MROPE_SECTION = [2, 3, 3]  # head_dim 16 -> 8 frequencies
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56,
                "max_pixels": 112 * 112, "patch_size": 14, "temporal_patch_size": 2,
                "merge_size": 2, "do_resize": True, "do_rescale": True, "do_normalize": True,
                "do_convert_rgb": True, "rescale_factor": 1 / 255,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711]}


def tiny_vl_config(qwen2_5: bool = False, **text_overrides):
    """Qwen2-VL's config, or with ``qwen2_5`` Qwen2.5-VL's: 4 blocks (1 and 3 full attention,
    0 and 2 windowed), windows of 56 pixels (2 x 2 merged tokens), so a 56 x 112 image has 2."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    text = {k: v for k, v in TINY.items() if k != "head_dim"}
    text.update(num_hidden_layers=2, rope_parameters={
        "rope_type": "default", "mrope_section": list(MROPE_SECTION), "rope_theta": 1e6})
    text.update(text_overrides)
    ids = dict(image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD,
               vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    if qwen2_5:
        return Qwen2_5_VLConfig(
            architectures=["Qwen2_5_VLForConditionalGeneration"], text_config=text,
            vision_config=dict(depth=4, hidden_size=32, out_hidden_size=TINY["hidden_size"],
                               num_heads=2, intermediate_size=48, window_size=56,
                               fullatt_block_indexes=[1, 3]), **ids)
    return Qwen2VLConfig(
        architectures=["Qwen2VLForConditionalGeneration"], text_config=text,
        vision_config=dict(depth=2, embed_dim=32, hidden_size=TINY["hidden_size"], num_heads=2,
                           mlp_ratio=2), **ids)


def write_tiny_qwen2_vl(directory: str | Path, seed: int = 0, cyclic: bool = False,
                        noise: float = 1.1, sharpness: float = 16.0,
                        language_model_keys: bool = False, qwen2_5: bool = False,
                        **text_overrides) -> Path:
    """A tiny float32 Qwen2-VL checkpoint: config.json, model.safetensors (on-disk keys
    ``visual.*``, ``model.*``, ``lm_head.weight``; with ``language_model_keys`` the in-memory
    ``model.visual.*`` / ``model.language_model.*`` layout), preprocessor_config.json and a
    tokenizer; ``qwen2_5``: Qwen2.5-VL's tower. ``cyclic``: the LLM follows a successor map
    (tests/checkpoints.py's cyclic pairs), so the cyclic EAGLE-1 head drafts right on a known
    share of positions."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    directory = Path(directory)
    config = tiny_vl_config(qwen2_5, **text_overrides)
    torch.manual_seed(seed)
    model_cls = Qwen2_5_VLForConditionalGeneration if qwen2_5 else \
        Qwen2VLForConditionalGeneration
    model = model_cls(config).float()
    _randomize(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(directory)
    path = directory / "model.safetensors"
    state = load_file(str(path))
    if cyclic:
        make_cyclic(state, seed, noise, sharpness)
    if language_model_keys:
        state = {("model.language_model." + k[6:] if k.startswith("model.") else
                  "model." + k if k.startswith("visual.") else k): v for k, v in state.items()}
    save_file({k: v.contiguous() for k, v in state.items()}, str(path),
              metadata={"format": "pt"})
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    write_vl_tokenizer(directory)
    return directory


SPECIAL = {IMAGE_PAD: "<|image_pad|>", VIDEO_PAD: "<|video_pad|>",
           VISION_START: "<|vision_start|>", VISION_END: "<|vision_end|>"}
# Qwen2-VL's template in miniature: an image part is vision-start, one pad, vision-end.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m.role }}{% if m.content is string %} {{ m.content }}"
                 "{% else %}{% for p in m.content %}{% if p.type == 'image' %}"
                 "<|vision_start|><|image_pad|><|vision_end|>{% else %} {{ p.text }}{% endif %}"
                 "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant"
                 "{% endif %}")


def write_vl_tokenizer(directory: Path) -> None:
    """tests/checkpoints.py's word-level tokenizer with ids 150-153 renamed to the vision
    special tokens (matched before the word split), and the chat template above."""
    from tokenizers import Tokenizer

    write_tiny_tokenizer(directory, TINY["vocab_size"])
    raw = json.loads((directory / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    for token_id, name in SPECIAL.items():
        vocab.pop(by_id[token_id])
        vocab[name] = token_id
    (directory / "tokenizer.json").write_text(json.dumps(raw))
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens(list(SPECIAL.values()))
    tok.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def write_mrope_head(directory: str | Path, target_dir: str | Path, seed: int = 0,
                     method: str = "eagle") -> Path:
    """The cyclic EAGLE-1 (or with ``method`` "eagle3" EAGLE-3) head of tests/checkpoints.py
    for a cyclic Qwen2-VL target, its config with the target's M-RoPE sections (vLLM's
    Qwen2.5-VL EAGLE heads use M-RoPE too)."""
    from checkpoints import write_cyclic_eagle1_head, write_cyclic_eagle3_head

    directory, target_dir = Path(directory), Path(target_dir)
    # The head writers read a flat (Qwen2-style) config.json beside the LLM's weights.
    flat = directory.parent / f"{directory.name}-target-text"
    flat.mkdir(parents=True, exist_ok=True)
    raw = json.loads((target_dir / "config.json").read_text())
    (flat / "config.json").write_text(json.dumps({"head_dim": 16, **raw, **raw["text_config"]}))
    if not (flat / "model.safetensors").exists():
        (flat / "model.safetensors").symlink_to((target_dir / "model.safetensors").resolve())
    writer = write_cyclic_eagle3_head if method == "eagle3" else write_cyclic_eagle1_head
    directory = writer(directory, flat, seed=seed)
    config = json.loads((directory / "config.json").read_text())
    config["rope_scaling"] = {"type": "mrope", "mrope_section": list(MROPE_SECTION)}
    config["rope_theta"] = 1e6
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def make_image(height: int = 70, width: int = 100, seed: int = 0):
    """A random RGB PIL image (70 x 100 resizes to 56 x 112: grid (1, 4, 8), 8 tokens)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def image_prompt(before: list[int], after: list[int], num_images: int = 1) -> list[int]:
    """Token ids ``before``, then per image vision-start, one image pad, vision-end, then
    ``after`` (the chat template's layout, before expansion)."""
    return before + [VISION_START, IMAGE_PAD, VISION_END] * num_images + after
