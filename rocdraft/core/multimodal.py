"""Prompts with images, from the user's dict to what each step feeds the models.

A multimodal prompt is ``{"prompt": str, "images": [...]}`` or
``{"prompt_token_ids": [...], "images": [...]}``; images are PIL images, paths or bytes of
image files. The prompt holds one image-pad token per image (between vision-start and
vision-end, as the chat template writes it); rocdraft expands the i-th pad to image i's
token count, runs the target's vision tower once, when the request is made, and keeps the
embeddings with the request (``RequestImages``): a preempted request recomputes its KV from
them, and any chunk of its prompt splices the rows it covers.

Per step (``step_inputs``), with the step's requests laid out as in rocdraft/core/step_batch.py
(request r's tokens at ``query_start_loc[r] ...``, sequence indices ``start ...``):

- positions [3, num_tokens]: each image request's M-RoPE positions (models/mrope.py), the
  sequence index on all three rows for the others;
- the target's splice: image rows i in [start, start + n - d) at batch row
  ``qsl[r] + i - start``;
- the head's splice: its input at batch row j is the token at sequence index j's + 1, so
  image rows i in [start + 1, start + n - d] sit at ``qsl[r] + i - start - 1`` (the last one
  is the next chunk's first token, a partial prefill's ``backup_next_token_ids``).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch

from rocdraft.models.embed_splice import EmbedSplice, splice_or_none
from rocdraft.models.mrope import MropePositions, expand_image_pads, rope_index
from rocdraft.platform import host_to_device
from rocdraft.core.prompts import tokenize_prompt

_PROMPT_KEYS = ("prompt", "prompt_token_ids")


@dataclass(frozen=True)
class RequestImages:
    embeds: torch.Tensor  # [num_image_tokens, hidden_size], the vision tower's rows in order
    rows: list[int]  # the sequence index of each image-pad token of the prompt, ascending
    mrope: MropePositions

    def rows_in(self, start: int, end: int) -> tuple[int, int]:
        """(first, last + 1) of ``rows`` within sequence indices [start, end)."""
        return bisect.bisect_left(self.rows, start), bisect.bisect_left(self.rows, end)


def read_multimodal_prompt(prompt: dict, target, tokenizer
                           ) -> tuple[list[int], RequestImages | None, str | None]:
    """A prompt dict -> (expanded token ids, its images or None, None), or
    ([], None, why it cannot run)."""
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "images"})
    given = [k for k in _PROMPT_KEYS if k in prompt]
    if unknown or len(given) != 1:
        return [], None, (f"a prompt dict takes one of {list(_PROMPT_KEYS)} and optionally "
                          f"'images'; got keys {sorted(prompt)}")
    ids, error = tokenize_prompt(prompt[given[0]], tokenizer)
    if error:
        return [], None, error
    images = prompt.get("images") or []
    if not isinstance(images, (list, tuple)):
        return [], None, f"'images' must be a list of images, got {type(images).__name__}"
    if not images:
        return ids, None, None
    config = getattr(target, "vl_config", None)
    if config is None:
        arch = getattr(getattr(target, "config", None), "architecture", type(target).__name__)
        return [], None, (f"the target ({arch}) has no vision tower: {len(images)} image(s) "
                          f"need a vision-language target (Qwen2-VL)")
    pad = config.image_token_id
    num_pads = ids.count(pad)
    if num_pads != len(images):
        return [], None, (f"{len(images)} image(s) for {num_pads} image-pad token(s) (id "
                          f"{pad}) in the prompt; write one <|vision_start|><|image_pad|>"
                          f"<|vision_end|> per image")
    try:
        encoded = target.encode_images(list(images))
    except ValueError as e:
        return [], None, str(e)
    expanded = expand_image_pads(ids, list(encoded.token_counts), pad)
    mrope = rope_index(expanded, list(encoded.grids_thw), pad, config.merge_size)
    rows = [i for i, t in enumerate(expanded) if t == pad]
    return expanded, RequestImages(encoded.embeds, rows, mrope), None


def with_images(prompt, images: list, target, tokenizer) -> dict:
    """The CLI's ``--image``: a prompt (text or ids) and its images as a prompt dict; a prompt
    without image-pad tokens gets one vision-start, pad, vision-end per image in front (after
    a leading BOS); the engine refuses what is wrong (a text-only target, a pad count that
    differs)."""
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    config = getattr(target, "vl_config", None)
    ids, error = tokenize_prompt(prompt, tokenizer)
    if config is None or error or config.image_token_id in ids:
        return {key: prompt, "images": list(images)}
    marks = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
    at = 1 if ids and ids[0] == target.config.bos_token_id else 0
    return {"prompt_token_ids": ids[:at] + marks * len(images) + ids[at:],
            "images": list(images)}


def image_prompt_error(ids: list[int], images: RequestImages | None, target,
                       max_model_len: int) -> str | None:
    """The one-line refusal of a prompt whose images make it longer than max_model_len, or
    of image-pad tokens without images on a vision-language target, else None."""
    config = getattr(target, "vl_config", None)
    if images is None and config is not None and config.image_token_id in ids:
        return (f"the prompt holds {ids.count(config.image_token_id)} image-pad token(s) (id "
                f"{config.image_token_id}) but no images; pass {{'prompt' or "
                f"'prompt_token_ids': ..., 'images': [...]}}")
    if images is None or len(ids) < max_model_len:
        return None
    return (f"prompt of {len(ids)} tokens ({len(images.rows)} of them image tokens) does not "
            f"fit max_model_len {max_model_len}; use a smaller image (or fewer) or raise "
            f"max_model_len")


@dataclass(frozen=True)
class StepImageInputs:
    positions: torch.Tensor  # [3, num_tokens] int64 on the device
    target_splice: EmbedSplice | None
    head_splice: EmbedSplice | None


def step_inputs(requests: list[tuple[Any, int, int, int]], positions: list[int],
                query_start_loc: list[int], device) -> StepImageInputs | None:
    """requests: (request, start, num_tokens computed (n - d), num_drafts) per batch row;
    positions: the step's 1-D positions (sequence indices, tree drafts at root + depth)
    -> the step's M-RoPE positions and splices, or None when no request has images."""
    if not any(getattr(req, "images", None) is not None for req, *_ in requests):
        return None
    flat = torch.tensor(positions, dtype=torch.long)
    columns = []
    target_rows, target_embeds, head_rows, head_embeds = [], [], [], []
    for r, (req, start, computed, _) in enumerate(requests):
        segment = flat[query_start_loc[r]:query_start_loc[r + 1]]
        images = req.images
        if images is None:
            columns.append(segment.expand(3, -1))
            continue
        columns.append(images.mrope.at(segment))
        base = query_start_loc[r]
        first, last = images.rows_in(start, start + computed)
        target_rows += [base + i - start for i in images.rows[first:last]]
        target_embeds.append(images.embeds[first:last])
        first, last = images.rows_in(start + 1, start + computed + 1)
        head_rows += [base + i - start - 1 for i in images.rows[first:last]]
        head_embeds.append(images.embeds[first:last])
    return StepImageInputs(host_to_device(torch.cat(columns, dim=1).contiguous(), device),
                           splice_or_none(target_rows, target_embeds, device),
                           splice_or_none(head_rows, head_embeds, device))
