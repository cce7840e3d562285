"""Qwen2-VL preprocessing (models/image_processing.py) against transformers'
``Qwen2VLImageProcessorPil`` on the same images, smart_resize's rules, and the refusals of
files that are not images."""
from __future__ import annotations

import pytest
import torch

from rocdraft.models.image_processing import (ImageProcessorConfig, load_image,
                                              preprocess_image, smart_resize)
from vl_checkpoints import PREPROCESSOR, make_image


def test_smart_resize_rules():
    big = dict(min_pixels=3136, max_pixels=12_845_056)
    assert smart_resize(480, 640, **big) == (476, 644)
    assert smart_resize(70, 70, **big) == (56, 56)  # round half to even: 2.5 -> 2
    assert smart_resize(10, 10, **big) == (56, 56)  # below min_pixels: scaled up
    assert smart_resize(2000, 3000, max_pixels=1_003_520) == (812, 1204)  # scaled down
    with pytest.raises(ValueError, match="aspect ratio must be at most 200, got 201.0"):
        smart_resize(10, 2010)


@pytest.mark.parametrize("size", [(70, 100), (56, 112), (30, 40), (300, 500), (57, 57)])
def test_equals_transformers_pil_processor(size):
    from transformers import Qwen2VLImageProcessorPil

    reference = Qwen2VLImageProcessorPil(
        size={"shortest_edge": PREPROCESSOR["min_pixels"],
              "longest_edge": PREPROCESSOR["max_pixels"]})
    image = make_image(*size, seed=sum(size))
    expected = reference(images=[image], return_tensors="pt")
    got = preprocess_image(image, ImageProcessorConfig.from_dict(PREPROCESSOR))
    assert [list(got.grid_thw)] == expected["image_grid_thw"].tolist()
    torch.testing.assert_close(got.pixel_values, expected["pixel_values"], atol=1e-5, rtol=0)


def test_config_spellings():
    new = ImageProcessorConfig.from_dict({"size": {"shortest_edge": 100, "longest_edge": 9000}})
    old = ImageProcessorConfig.from_dict({"min_pixels": 100, "max_pixels": 9000})
    assert new == old and new.max_pixels == 9000


def test_paths_and_bytes_and_refusals(tmp_path):
    image = make_image(40, 50)
    path = tmp_path / "x.png"
    image.save(path)
    config = ImageProcessorConfig.from_dict(PREPROCESSOR)
    from_path = preprocess_image(str(path), config)
    from_bytes = preprocess_image(path.read_bytes(), config)
    assert torch.equal(from_path.pixel_values, preprocess_image(image, config).pixel_values)
    assert torch.equal(from_bytes.pixel_values, from_path.pixel_values)
    text = tmp_path / "notes.txt"
    text.write_text("not an image")
    with pytest.raises(ValueError, match="notes.txt' is not a readable image file"):
        load_image(text)
    corrupt = tmp_path / "broken.png"
    corrupt.write_bytes(path.read_bytes()[:60])
    with pytest.raises(ValueError, match="broken.png' is not a readable image file"):
        load_image(corrupt)
    with pytest.raises(ValueError, match="missing.png' does not exist"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(ValueError, match="got int"):
        load_image(3)
