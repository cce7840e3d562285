"""Qwen2-VL image preprocessing with Pillow and torch (no torchvision, no hub downloads).

Follows the checkpoint's ``preprocessor_config.json`` as transformers'
``Qwen2VLImageProcessorPil`` does (tests/test_image_processing.py compares the two):

1. RGB; ``smart_resize`` to multiples of ``patch_size * merge_size`` (28) within
   ``[min_pixels, max_pixels]``; BICUBIC on uint8 (Pillow);
2. ``x * rescale_factor``, then ``(x - image_mean) / image_std`` per channel (float32);
3. patchify: the frame duplicated to ``temporal_patch_size`` (2) frames, cut into 14 x 14
   patches, each flattened as (channel, frame, row, column) -> [gh * gw, 3 * 2 * 14 * 14],
   in the order of 2 x 2 merge blocks (the vision tower merges 4 consecutive rows).

``image_grid_thw`` is (1, gh, gw) with gh = H / 14, gw = W / 14.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rocdraft.errors import CheckpointError
from rocdraft.models.config import read_json

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ImageProcessorConfig:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280  # the class default, 1,003,520
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels",
                     "max_pixels"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise CheckpointError(f"preprocessor_config.json: {name} must be a positive "
                                      f"integer, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise CheckpointError(f"preprocessor_config.json: min_pixels {self.min_pixels} "
                                  f"exceeds max_pixels {self.max_pixels}")

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> "ImageProcessorConfig":
        size = raw.get("size") or {}
        fields: dict[str, Any] = {}
        for name in ("patch_size", "temporal_patch_size", "merge_size"):
            if raw.get(name) is not None:
                fields[name] = int(raw[name])
        min_pixels = raw.get("min_pixels", size.get("shortest_edge"))
        max_pixels = raw.get("max_pixels", size.get("longest_edge"))
        if min_pixels is not None:
            fields["min_pixels"] = int(min_pixels)
        if max_pixels is not None:
            fields["max_pixels"] = int(max_pixels)
        if raw.get("rescale_factor") is not None:
            fields["rescale_factor"] = float(raw["rescale_factor"])
        for name in ("image_mean", "image_std"):
            if raw.get(name) is not None:
                fields[name] = tuple(float(v) for v in raw[name])
        return ImageProcessorConfig(**fields)


def load_image_processor_config(path: str | Path) -> ImageProcessorConfig:
    """The checkpoint's preprocessor_config.json, or the class defaults when absent."""
    file = Path(path) / "preprocessor_config.json"
    return ImageProcessorConfig.from_dict(read_json(file)) if file.is_file() \
        else ImageProcessorConfig()


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """(height, width) rounded to multiples of ``factor`` with the pixel count in
    [min_pixels, max_pixels] and the aspect ratio nearly kept: (480, 640) -> (476, 644)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image of {height}x{width} pixels: the aspect ratio must be at most "
                         f"{MAX_ASPECT_RATIO}, got {max(height, width) / min(height, width):.1f}")
    h_bar = round(height / factor) * factor  # Python's round: half to even (70 -> 56)
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def load_image(image: Any):
    """A PIL image, a path, or the bytes of an image file -> an RGB PIL image; a ValueError
    naming the input when it is not a readable image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (bytes, bytearray)):
        source, name = io.BytesIO(image), f"<{len(image)} bytes>"
    elif isinstance(image, (str, Path)):
        source, name = str(image), repr(str(image))
        if not Path(source).is_file():
            raise ValueError(f"image file {name} does not exist")
    else:
        raise ValueError(f"an image must be a PIL image, a path or bytes, got "
                         f"{type(image).__name__}")
    try:
        with Image.open(source) as opened:
            opened.load()
            return opened.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ValueError(f"image {name} is not a readable image file: {e}") from None


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # [gh * gw, 3 * temporal_patch_size * patch_size ** 2] float32
    grid_thw: tuple[int, int, int]  # (1, gh, gw) in patches

    @property
    def num_patches(self) -> int:
        return self.pixel_values.shape[0]


def preprocess_image(image: Any, config: ImageProcessorConfig) -> ProcessedImage:
    """One image (PIL, path or bytes) -> its patches and grid (module docstring)."""
    from PIL import Image

    rgb = load_image(image)
    factor = config.patch_size * config.merge_size
    height, width = smart_resize(rgb.height, rgb.width, factor, config.min_pixels,
                                 config.max_pixels)
    if (height, width) != (rgb.height, rgb.width):
        rgb = rgb.resize((width, height), resample=Image.BICUBIC)
    pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(height, width, 3).permute(2, 0, 1).float()  # [3, H, W]
    mean = torch.tensor(config.image_mean).view(3, 1, 1)
    std = torch.tensor(config.image_std).view(3, 1, 1)
    pixels = (pixels * config.rescale_factor - mean) / std
    return ProcessedImage(patchify(pixels, config), (1, height // config.patch_size,
                                                       width // config.patch_size))


def patchify(pixels: torch.Tensor, config: ImageProcessorConfig) -> torch.Tensor:
    """pixels [3, H, W] float32 -> [gh * gw, 3 * T * p * p] (T = temporal_patch_size, the
    frame repeated); rows in 2 x 2 merge-block order, columns (c, t, py, px)."""
    channels, height, width = pixels.shape
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    gh, gw = height // p, width // p
    x = pixels.reshape(channels, gh // m, m, p, gw // m, m, p)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, p, p]
    x = x.unsqueeze(5).expand(gh // m, gw // m, m, m, channels, t, p, p)
    return x.reshape(gh * gw, channels * t * p * p).contiguous()
