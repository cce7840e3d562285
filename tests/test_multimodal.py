"""rocdraft/core/multimodal.py: a step's M-RoPE positions and splice rows when a chunk boundary
falls inside an image, the CLI's ``--image`` (placeholders added in front of a prompt without
image pads) and its refusals."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from checkpoints import write_tiny_llama
from rocdraft.entrypoints.cli import main
from rocdraft.config import SamplingParams
from rocdraft.engine import LLM
from rocdraft.models.mrope import rope_index
from rocdraft.core.multimodal import RequestImages, step_inputs
from vl_checkpoints import IMAGE_PAD, VISION_END, VISION_START, make_image, write_tiny_qwen2_vl


def image_request():
    """``t t t VS I x6 VE t t`` (REFERENCE.md's worked example), embeddings row r = r + 1."""
    ids = [1, 2, 3, VISION_START] + [IMAGE_PAD] * 6 + [VISION_END, 4, 5]
    images = RequestImages(torch.arange(1, 7).float().view(6, 1).expand(6, 2),
                           list(range(4, 10)), rope_index(ids, [(1, 4, 6)], IMAGE_PAD))
    return SimpleNamespace(images=images)


def test_chunk_boundary_inside_an_image():
    """Request 0 computes indices 6..8 (a chunk cut inside the image), request 1 (text) 2
    tokens: positions from the grid, target rows 6-8 at batch rows 0-2, head rows 6-9 one
    earlier (its last input is the next chunk's first token, index 9, an image pad)."""
    req, text = image_request(), SimpleNamespace(images=None)
    out = step_inputs([(req, 6, 3, 0), (text, 5, 2, 0)], [6, 7, 8, 5, 6], [0, 3, 5], "cpu")
    assert out.positions.tolist() == [[4, 4, 4, 5, 6], [4, 5, 5, 5, 6], [6, 4, 5, 5, 6]]
    assert out.target_splice.indices.tolist() == [0, 1, 2]
    assert out.target_splice.embeds[:, 0].tolist() == [3, 4, 5]
    assert out.head_splice.indices.tolist() == [0, 1, 2]  # indices 7, 8, 9 -> rows 0, 1, 2
    assert out.head_splice.embeds[:, 0].tolist() == [4, 5, 6]
    # decode past the prompt: n + delta, nothing spliced
    decode = step_inputs([(req, 13, 1, 0)], [13], [0, 1], "cpu")
    assert decode.positions.tolist() == [[10]] * 3 and decode.target_splice is None
    assert step_inputs([(text, 0, 2, 0)], [0, 1], [0, 2], "cpu") is None


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("mm")
    image = root / "cat.png"
    make_image(70, 100).save(image)
    return {"vl": str(write_tiny_qwen2_vl(root / "vl")), "image": str(image),
            "llama": str(write_tiny_llama(root / "llama"))}


def run_generate(capsys, *argv) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(["generate", *map(str, argv), "--json", "--max-new-tokens", "8", "--method",
               "none"])
    return rc, json.loads(capsys.readouterr().out)


def test_cli_image(capsys, paths):
    rc, result = run_generate(capsys, "--target", paths["vl"], "--image", paths["image"],
                              "the quick fox")
    assert rc == 0
    expected = LLM(paths["vl"]).generate(
        [{"prompt": "<|vision_start|><|image_pad|><|vision_end|>the quick fox",
          "images": [paths["image"]]}], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert result["outputs"][0]["token_ids"] == expected.token_ids
    assert result["outputs"][0]["prompt_token_ids"].count(IMAGE_PAD) == 8


def test_cli_image_refusals(capsys, paths, tmp_path):
    rc, result = run_generate(capsys, "--target", paths["llama"], "--image", paths["image"],
                              "the fox")
    assert rc != 0 and "has no vision tower" in result["outputs"][0]["error"]
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8 not really")
    rc, result = run_generate(capsys, "--target", paths["vl"], "--image", bad, "the fox")
    assert rc != 0 and "bad.jpg' is not a readable image file" in result["outputs"][0]["error"]
