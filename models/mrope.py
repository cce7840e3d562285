"""M-RoPE positions of a multimodal prompt (Qwen2-VL / Qwen2.5-VL ``get_rope_index``), pure
functions on the host.

An M-RoPE target takes positions ``[3, num_tokens]`` (temporal, height, width). Text tokens
(vision-start and vision-end included) take the same position on all three rows; an image of
patch grid (t, h, w) covers ``t * (h // m) * (w // m)`` image-pad tokens (m = the spatial merge
size, 2) laid out over the merged grid in raster order, each at
``(cur + t_i, cur + h_i, cur + w_i)``; the text after it resumes at the image's largest
position + 1. Generated tokens (and drafts) beyond the prompt take ``n + delta`` on every
row, where n is the sequence index and ``delta = max(prompt positions) + 1 - prompt_len``
(<= 0: an image spends fewer positions than tokens).

Worked example, ``t t t VS I I I I I I VE t t`` with one image of grid (1, 4, 6) (merged
2 x 3, six pads)::

    index  0 1 2 3 4 5 6 7 8 9 10 11 12 | 13 14 (generated)
    T      0 1 2 3 4 4 4 4 4 4  7  8  9 | 10 11
    H      0 1 2 3 4 4 4 5 5 5  7  8  9 | 10 11
    W      0 1 2 3 4 5 6 4 5 6  7  8  9 | 10 11
    delta = 9 + 1 - 13 = -3

The sequence index (not the position) keeps addressing the KV cache: slots, seq_lens and the
max_model_len clamp of draft steps follow it (drafter/index_math.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MropePositions:
    """A prompt's M-RoPE positions: ``prompt`` [3, prompt_len] int64 and ``delta``."""

    prompt: torch.Tensor
    delta: int

    @property
    def prompt_len(self) -> int:
        return self.prompt.shape[1]

    def at(self, indices: torch.Tensor) -> torch.Tensor:
        """Sequence indices [n] int64 -> positions [3, n]: the prompt's columns, else
        ``index + delta`` on all rows (generated tokens, drafts)."""
        inside = indices < self.prompt_len
        prompt_cols = self.prompt[:, indices.clamp(max=max(self.prompt_len - 1, 0))]
        return torch.where(inside, prompt_cols, (indices + self.delta).expand(3, -1))


def image_token_count(grid_thw: tuple[int, int, int], merge_size: int = 2) -> int:
    """Image-pad tokens (merged patches) of an image of patch grid (t, h, w)."""
    t, h, w = grid_thw
    return t * (h // merge_size) * (w // merge_size)


def rope_index(token_ids: list[int], grids_thw: list[tuple[int, int, int]],
               image_token_id: int, merge_size: int = 2) -> MropePositions:
    """One prompt's positions (``get_rope_index`` without padding).

    token_ids [prompt_len] (image pads already expanded), grids_thw: each image's patch grid
    in prompt order; image i takes the next ``image_token_count(grids_thw[i])`` pads.
    -> MropePositions ([3, prompt_len], delta). A ValueError when the pads and the grids
    disagree (a run of pads left over, or an image without its pads).
    """
    columns: list[torch.Tensor] = []
    cur = index = 0
    images = iter(grids_thw)
    num_images = 0
    while index < len(token_ids):
        if token_ids[index] != image_token_id:
            end = index
            while end < len(token_ids) and token_ids[end] != image_token_id:
                end += 1
            columns.append(torch.arange(cur, cur + end - index).expand(3, -1))
            cur += end - index
            index = end
            continue
        grid = next(images, None)
        if grid is None:
            raise ValueError(f"the prompt has more image-pad tokens (id {image_token_id}) "
                             f"than the {num_images} image grids account for")
        num_images += 1
        t, h, w = grid[0], grid[1] // merge_size, grid[2] // merge_size
        count = t * h * w
        if token_ids[index:index + count] != [image_token_id] * count:
            raise ValueError(f"image {num_images - 1} of grid {tuple(grid)} needs {count} "
                             f"consecutive image-pad tokens at index {index}")
        t_idx = torch.arange(t).view(t, 1, 1).expand(t, h, w).reshape(-1)
        h_idx = torch.arange(h).view(1, h, 1).expand(t, h, w).reshape(-1)
        w_idx = torch.arange(w).view(1, 1, w).expand(t, h, w).reshape(-1)
        columns.append(torch.stack([t_idx, h_idx, w_idx]) + cur)
        cur += max(t, h, w)
        index += count
    leftover = sum(1 for _ in images)
    if leftover:
        raise ValueError(f"{leftover} image grid(s) have no image-pad tokens in the prompt "
                         f"({num_images} images found)")
    prompt = torch.cat(columns, dim=1) if columns else torch.zeros(3, 0, dtype=torch.long)
    return MropePositions(prompt.long(), cur - len(token_ids))


def expand_image_pads(token_ids: list[int], counts: list[int], image_token_id: int
                      ) -> list[int]:
    """The i-th image-pad token repeated ``counts[i]`` times (the processor's prompt
    expansion); a ValueError naming the numbers when pads and images disagree."""
    num_pads = sum(1 for t in token_ids if t == image_token_id)
    if num_pads != len(counts):
        raise ValueError(f"the prompt holds {num_pads} image-pad tokens (id {image_token_id}) "
                         f"for {len(counts)} images; write one <|image_pad|> per image between "
                         f"<|vision_start|> and <|vision_end|>")
    out: list[int] = []
    pads = iter(counts)
    for token in token_ids:
        out += [token] * next(pads) if token == image_token_id else [token]
    return out
