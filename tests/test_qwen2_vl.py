"""Qwen2-VL targets (models/qwen2_vl.py, models/vision.py, rocdraft/core/multimodal.py): greedy
target-only output equal to transformers' Qwen2VLForConditionalGeneration on the same
checkpoint and pixels, with and without images, in both key layouts; the vision tower alone;
chunked prefill with a chunk boundary inside an image and preemption; speculative decoding
lossless with an M-RoPE EAGLE head drafting from the spliced embeddings, drafts accepted;
and the bad inputs, each refused in one line naming the value."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rocdraft.config import SamplingParams, SpeculativeConfig
from rocdraft.engine import LLM
from rocdraft.errors import CheckpointError, RocdraftError
from vl_checkpoints import (IMAGE_PAD, VISION_END, VISION_START, image_prompt, make_image,
                            write_mrope_head, write_tiny_qwen2_vl)
from checkpoints import write_tiny_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    target = write_tiny_qwen2_vl(root / "target")
    cyclic = write_tiny_qwen2_vl(root / "cyclic", seed=3, cyclic=True, noise=2.2)
    # EAGLE-3 reads 3 target layers
    cyclic3 = write_tiny_qwen2_vl(root / "cyclic3", seed=3, cyclic=True, noise=1.6,
                                  num_hidden_layers=3)
    return {"target": str(target),
            "in_memory_keys": str(write_tiny_qwen2_vl(root / "lm_keys", language_model_keys=True)),
            "qwen2_5": str(write_tiny_qwen2_vl(root / "qwen2_5", seed=1, qwen2_5=True)),
            "cyclic": str(cyclic), "head": str(write_mrope_head(root / "head", cyclic)),
            "cyclic3": str(cyclic3),
            "head3": str(write_mrope_head(root / "head3", cyclic3, method="eagle3")),
            "text_only": str(write_tiny_llama(root / "llama"))}


@pytest.fixture(scope="module")
def images():
    return [make_image(70, 100, seed=1), make_image(60, 60, seed=2)]


def transformers_model(path: str):
    """transformers' Qwen2VLForConditionalGeneration (or Qwen2.5-VL's) from ``path``."""
    import transformers

    arch = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(path).float().eval()


def transformers_greedy(path: str, ids: list[int], images: list, max_new_tokens: int = 12
                        ) -> list[int]:
    """Greedy tokens of transformers' model: the processor's pixels and grids, the pads
    expanded as its processor does."""
    from transformers import Qwen2VLImageProcessorPil

    model = transformers_model(path)
    kwargs = {}
    if images:
        pixels = Qwen2VLImageProcessorPil.from_pretrained(path)(images=images,
                                                                return_tensors="pt")
        counts = iter((pixels["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [t for token in ids
               for t in ([token] * next(counts) if token == IMAGE_PAD else [token])]
        kwargs = dict(pixel_values=pixels["pixel_values"],
                      image_grid_thw=pixels["image_grid_thw"],
                      mm_token_type_ids=(torch.tensor([ids]) == IMAGE_PAD).int())
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, **kwargs)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", ["target", "qwen2_5"])
def test_vision_tower_equals_transformers(vl, images, kind):
    """Qwen2-VL's tower, and Qwen2.5-VL's with windows (a 56 x 112 image: 2 windows, a 56 x 56
    one: 1) and full-attention blocks."""
    from transformers import Qwen2VLImageProcessorPil

    model = transformers_model(vl[kind])
    pixels = Qwen2VLImageProcessorPil.from_pretrained(vl[kind])(images=images,
                                                                 return_tensors="pt")
    with torch.no_grad():
        out = model.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"])
    expected = torch.cat(list(out.pooler_output))
    ours = LLM(vl[kind]).model_runner.target.encode_images(images)
    assert ours.grids_thw == tuple(map(tuple, pixels["image_grid_thw"].tolist()))
    torch.testing.assert_close(ours.embeds, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["target", "in_memory_keys", "qwen2_5"])
def test_greedy_equals_transformers(vl, images, layout):
    """Text only, one image, two images (one in the middle of the text); Qwen2-VL in both key
    layouts, and Qwen2.5-VL."""
    llm = LLM(vl[layout])
    one = image_prompt([1, 5, 9], [20, 33, 7])
    two = [1, 4] + image_prompt([8], [11, 12]) + image_prompt([6], [30])[1:]
    cases = [([1, 5, 9, 20, 33, 7], []), (one, images[:1]), (two, images)]
    prompts = [{"prompt_token_ids": ids, "images": imgs} for ids, imgs in cases]
    outs = llm.generate(prompts, GREEDY)
    for out, (ids, imgs) in zip(outs, cases):
        assert out.error is None
        assert out.token_ids == transformers_greedy(vl[layout], ids, imgs)


def test_string_prompts_and_paths(vl, images, tmp_path):
    """A text prompt (the tiny word tokenizer has no special tokens: the pads are ids) and an
    image given by its path give what the ids and the PIL image give."""
    path = tmp_path / "image.png"
    images[0].save(path)
    llm = LLM(vl["target"])
    by_ids = llm.generate([{"prompt_token_ids": image_prompt([1, 5], [9]),
                            "images": [images[0]]}], GREEDY)[0]
    by_path = llm.generate([{"prompt_token_ids": image_prompt([1, 5], [9]),
                             "images": [str(path)]}], GREEDY)[0]
    assert by_ids.token_ids == by_path.token_ids
    text = llm.generate([{"prompt": "the quick fox"}], GREEDY)[0]
    assert text.token_ids == llm.generate(["the quick fox"], GREEDY)[0].token_ids


def test_chunked_prefill_inside_an_image_and_preemption(vl, images):
    """Chunks of 5 tokens cut the first image's 8 tokens (indices 4-11); a tight KV cache
    preempts requests, which recompute from their kept image embeddings."""
    prompts = [{"prompt_token_ids": image_prompt([1, 5, 9], [20, 33, 7]),
                "images": images[:1]},
               {"prompt_token_ids": image_prompt([2], [3]) + [4, 5], "images": images[1:]},
               {"prompt_token_ids": list(range(1, 12))}]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [LLM(vl["target"]).generate([p], params)[0].token_ids for p in prompts]
    chunked = LLM(vl["target"], max_num_batched_tokens=5)
    assert [o.token_ids for o in chunked.generate(prompts, params)] == expected
    tight = LLM(vl["target"], block_size=4, num_kv_blocks=16, max_model_len=48)
    assert [o.token_ids for o in tight.generate(prompts, params)] == expected
    assert tight.last_stats.num_preemptions > 0


SEEDED = [SamplingParams(temperature=0.9, top_k=50, max_tokens=12, seed=s, ignore_eos=True)
          for s in (11, 12, 13)]


def spec_prompts(images):
    return [{"prompt_token_ids": image_prompt([1, 5, 9], [20, 33, 7]), "images": images[:1]},
            {"prompt_token_ids": [1, 4] + image_prompt([8], [11]) + image_prompt([6], [30])[1:],
             "images": images},
            {"prompt_token_ids": [1, 2, 3, 4, 5]}]


@pytest.fixture(scope="module")
def spec_reference(vl, images):
    llm = LLM(vl["cyclic"], attention_backend="TORCH_SDPA")
    return {"greedy": [o.token_ids for o in llm.generate(spec_prompts(images), GREEDY)],
            "seeded": [o.token_ids for o in llm.generate(spec_prompts(images), SEEDED)]}


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_speculative_lossless_with_images(vl, images, spec_reference, padded, sampling,
                                          attention_backend):
    """EAGLE-1 (M-RoPE head) on the cyclic Qwen2-VL target, k = 3, chunks of 8 tokens (a
    boundary inside an image, a partial prefill beside decodes): the target-only tokens,
    with drafts accepted (acceptance length well above 1) and rejected."""
    llm = LLM(vl["cyclic"], draft=vl["head"], attention_backend=attention_backend,
              speculative_config=SpeculativeConfig(method="eagle", num_speculative_tokens=3,
                                                   padded_drafting=padded,
                                                   draft_policy="fixed"),
              max_num_batched_tokens=8)
    params = GREEDY if sampling == "greedy" else SEEDED
    outs = llm.generate(spec_prompts(images), params)
    assert [o.error for o in outs] == [None] * 3
    assert [o.token_ids for o in outs] == spec_reference[sampling]
    stats = llm.last_stats
    assert 1.4 < stats.acceptance_length < 4, stats.accepted_at_position  # ~1.7


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_eagle3_lossless_with_images(vl, images, padded, attention_backend):
    """An EAGLE-3 head (aux hidden states of 3 target layers, M-RoPE, d2t vocabulary) on a
    3-layer cyclic Qwen2-VL target: greedy and seeded equal target-only, drafts accepted."""
    reference = LLM(vl["cyclic3"], attention_backend="TORCH_SDPA")
    llm = LLM(vl["cyclic3"], draft=vl["head3"], attention_backend=attention_backend,
              speculative_config=SpeculativeConfig(method="eagle3", num_speculative_tokens=3,
                                                   padded_drafting=padded,
                                                   draft_policy="fixed"),
              max_num_batched_tokens=8)
    for params in (GREEDY, SEEDED):
        expected = [o.token_ids for o in reference.generate(spec_prompts(images), params)]
        assert [o.token_ids for o in llm.generate(spec_prompts(images), params)] == expected
        assert 1.3 < llm.last_stats.acceptance_length < 4  # ~1.7 to 2.2


def test_head_drafts_from_spliced_embeddings(vl, images, monkeypatch):
    """The head's first forward sees the image rows: without them (text embeddings of the
    pads) the drafts after the image differ, the output does not."""
    prompts = spec_prompts(images)[:1]
    config = SpeculativeConfig(method="eagle", num_speculative_tokens=3, draft_policy="fixed")
    llm = LLM(vl["cyclic"], draft=vl["head"], speculative_config=config)
    seen = []
    original = llm.draft_runner.proposer.first_forward

    def spy(*args, **kwargs):
        splice = args[7] if len(args) > 7 else kwargs.get("splice")
        seen.append(None if splice is None else splice.indices.tolist())
        return original(*args, **kwargs)
    monkeypatch.setattr(llm.draft_runner.proposer, "first_forward", spy)
    llm.generate(prompts, GREEDY)
    # The prefill step: the 8 image rows (sequence indices 4-11) one row earlier (3-10).
    assert seen[0] == list(range(3, 11))


# --- bad inputs ----------------------------------------------------------------------------

def test_image_on_a_text_only_target(vl, images):
    out = LLM(vl["text_only"]).generate([{"prompt_token_ids": [1, 2], "images": images[:1]}],
                                        GREEDY)[0]
    assert out.finish_reason == "error"
    assert "has no vision tower: 1 image(s) need a vision-language target" in out.error


def test_bad_images_and_pad_counts(vl, images, tmp_path):
    llm = LLM(vl["target"], max_model_len=40)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(RocdraftError, match="notes.txt' is not a readable image file"):
        llm.add_request("a", {"prompt_token_ids": image_prompt([1], [2]), "images": [text]})
    with pytest.raises(RocdraftError, match=r"2 image\(s\) for 1 image-pad token\(s\)"):
        llm.add_request("b", {"prompt_token_ids": image_prompt([1], [2]), "images": images})
    big = make_image(112, 112)  # 16 tokens: 3 of them exceed 40
    with pytest.raises(RocdraftError, match=r"prompt of 5\d tokens \(48 of them image tokens\) "
                                            r"does not fit max_model_len 40"):
        llm.add_request("c", {"prompt_token_ids": image_prompt([1], [2], 3),
                              "images": [big] * 3})
    with pytest.raises(RocdraftError, match="takes one of"):
        llm.add_request("d", {"text": "hi", "images": []})
    with pytest.raises(RocdraftError, match=r"holds 1 image-pad token\(s\) \(id 150\) but no "
                                            r"images"):
        llm.add_request("e", image_prompt([1], [2]))
    assert not llm.has_unfinished_requests()


def test_mrope_sections_must_sum_to_half_the_head_dim(tmp_path):
    path = write_tiny_qwen2_vl(tmp_path / "bad", rope_parameters={
        "rope_type": "default", "mrope_section": [2, 3, 4], "rope_theta": 1e6})
    with pytest.raises(CheckpointError, match=r"mrope_section \[2, 3, 4\] must be 3 sections "
                                              r"summing to head_dim / 2 = 8"):
        LLM(str(path))


def test_trees_refused_on_a_vision_language_target(vl):
    config = SpeculativeConfig(method="eagle", num_speculative_tokens=2,
                               speculative_token_tree="[(0,), (1,), (0, 0)]")
    with pytest.raises(RocdraftError, match="tree drafting on the vision-language target"):
        LLM(vl["cyclic"], draft=vl["head"], speculative_config=config)


def test_placeholder_ids_in_the_vocabulary():
    assert (IMAGE_PAD, VISION_START, VISION_END) == (150, 152, 153)


def test_drafts_clamped_at_max_model_len_with_images(vl, images, spec_reference):
    """max_model_len 30: the last steps' drafts run past it (their M-RoPE positions trail the
    sequence index by 6 after two images). Equal to target-only under the same limit, with
    a fixed draft count and under the cost policy (the default; it measures its step costs on
    this target)."""
    prompts = spec_prompts(images)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [o.token_ids for o in LLM(vl["cyclic"], max_model_len=30).generate(prompts,
                                                                                   params)]
    for policy in ("fixed", "cost"):
        llm = LLM(vl["cyclic"], draft=vl["head"], max_model_len=30,
                  speculative_config=SpeculativeConfig(method="eagle", num_speculative_tokens=4,
                                                       draft_policy=policy))
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected
        assert [o.finish_reason for o in outs] == ["length"] * 3
        if policy == "fixed":
            assert llm.last_stats.acceptance_length > 1.4


def test_draft_steps_write_the_slots_of_their_sequence_index(vl, images, monkeypatch):
    """After two images the M-RoPE positions trail the sequence index by 6: draft step i of
    the prefill step writes the head's KV at index P - 1 + i (P the expanded prompt length),
    not at the trailing position, which would overwrite the prompt's entries."""
    import rocdraft.drafter.eagle as eagle_module

    recorded = []

    class Recording(eagle_module.DraftStepIndexer):
        def step(self, index):
            clamped, slots, seq_lens = super().step(index)
            recorded.append((clamped.clone(), slots.clone(), seq_lens.clone()))
            return clamped, slots, seq_lens
    monkeypatch.setattr(eagle_module, "DraftStepIndexer", Recording)
    llm = LLM(vl["cyclic"], draft=vl["head"], block_size=4,
              speculative_config=SpeculativeConfig(method="eagle", num_speculative_tokens=3,
                                                   draft_policy="fixed"))
    llm.add_request("r", spec_prompts(images)[1], GREEDY)
    req = llm.requests["r"]
    prompt_len, delta = req.num_tokens, req.images.mrope.delta
    assert delta == -6
    llm.step()  # prefill: the head's first forward, then 2 draft steps
    blocks = req.block_ids
    for i, (clamped, slots, seq_lens) in enumerate(recorded[:2], start=1):
        index = prompt_len - 1 + i
        assert slots.tolist() == [blocks[index // 4] * 4 + index % 4]
        assert seq_lens.tolist() == [index + 1]
        assert clamped.tolist() == [[index + delta]] * 3


def test_speculative_with_images_under_preemption(vl, images, spec_reference):
    """A KV cache too small for the three requests at once: image requests are preempted
    mid-decode and recompute their prompt (images spliced again) and drafts; greedy output
    equals target-only."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in LLM(vl["cyclic"]).generate(spec_prompts(images), params)]
    llm = LLM(vl["cyclic"], draft=vl["head"], block_size=4, num_kv_blocks=20, max_model_len=64,
              speculative_config=SpeculativeConfig(method="eagle", num_speculative_tokens=3,
                                                   draft_policy="fixed"))
    outs = llm.generate(spec_prompts(images), params)
    assert [o.token_ids for o in outs] == expected
    assert llm.last_stats.num_preemptions > 0
    assert llm.last_stats.acceptance_length > 1.4


def test_hub_config_layout(vl, images, tmp_path):
    """The Hub's (transformers 4) config.json: the LLM's fields at the top, ``rope_scaling``
    ``{"type": "mrope", "mrope_section"}`` and ``rope_theta``, ``in_chans`` in the vision
    config: the same model, the same tokens."""
    import shutil

    path = tmp_path / "hub"
    shutil.copytree(vl["target"], path)
    raw = json.loads((path / "config.json").read_text())
    text = raw.pop("text_config")
    rope = text.pop("rope_parameters")
    raw.update(text, model_type="qwen2_vl", rope_theta=rope["rope_theta"],
               rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    raw["vision_config"]["in_chans"] = 3
    (path / "config.json").write_text(json.dumps(raw))
    prompt = [{"prompt_token_ids": image_prompt([1, 5, 9], [20, 33, 7]), "images": images[:1]}]
    assert LLM(str(path)).generate(prompt, GREEDY)[0].token_ids == \
        LLM(vl["target"]).generate(prompt, GREEDY)[0].token_ids


def test_head_mrope_sections_must_sum_to_half_the_head_dim(vl, tmp_path):
    import shutil

    head = tmp_path / "head"
    shutil.copytree(vl["head"], head)
    config = json.loads((head / "config.json").read_text())
    config["rope_scaling"] = {"type": "mrope", "mrope_section": [4, 4, 4]}
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises((CheckpointError, ValueError),
                       match=r"mrope_section \[4, 4, 4\] must sum to head_dim // 2 = 8"):
        LLM(vl["cyclic"], draft=str(head),
            speculative_config=SpeculativeConfig(method="eagle", num_speculative_tokens=2))
