"""M-RoPE position math (models/mrope.py): the worked example of REFERENCE.md, a property test
against a naive token-by-token loop, the pad expansion and its refusals, and the draft-step
schedule addressing the cache by sequence index when positions trail it."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rocdraft.drafter.index_math import draft_step_schedule
from rocdraft.models.mrope import expand_image_pads, image_token_count, rope_index

PAD, VS, VE = 150, 152, 153


def test_worked_example():
    """``t t t VS I x6 VE t t``, grid (1, 4, 6): the table of the module docstring."""
    ids = [1, 2, 3, VS] + [PAD] * 6 + [VE, 4, 5]
    m = rope_index(ids, [(1, 4, 6)], PAD)
    assert m.prompt.tolist() == [[0, 1, 2, 3, 4, 4, 4, 4, 4, 4, 7, 8, 9],
                                 [0, 1, 2, 3, 4, 4, 4, 5, 5, 5, 7, 8, 9],
                                 [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8, 9]]
    assert m.delta == -3
    # decode: sequence index n takes n + delta on all rows (13 -> 10, 14 -> 11)
    assert m.at(torch.tensor([12, 13, 14])).tolist() == [[9, 10, 11]] * 3


def naive_rope_index(ids, grids, merge=2):
    """Token by token: a text token takes the next position on all rows; an image's first
    pad lays out the whole merged grid, then text resumes past its largest position."""
    rows, cur, i, images = [], 0, 0, list(grids)
    while i < len(ids):
        if ids[i] != PAD:
            rows.append((cur, cur, cur))
            cur += 1
            i += 1
            continue
        t, h, w = images.pop(0)
        h, w = h // merge, w // merge
        for ti in range(t):
            for hi in range(h):
                for wi in range(w):
                    rows.append((cur + ti, cur + hi, cur + wi))
        cur = max(max(r) for r in rows) + 1
        i += t * h * w
    return [list(c) for c in zip(*rows)], cur - len(ids)


@given(st.lists(st.tuples(st.integers(0, 4), st.just(1), st.integers(1, 4),
                          st.integers(1, 4)), min_size=0, max_size=3),
       st.integers(0, 5))
def test_rope_index_equals_naive_loop(segments, tail):
    """Random prompts: text runs and images of grids (1, 2h, 2w) (an image is one frame)."""
    ids, grids = [], []
    for text_len, t, h, w in segments:
        ids += [7] * text_len + [VS]
        grids.append((t, 2 * h, 2 * w))
        ids += [PAD] * image_token_count(grids[-1]) + [VE]
    ids += [9] * tail
    if not ids:
        ids = [3]
    m = rope_index(ids, grids, PAD)
    positions, delta = naive_rope_index(ids, grids)
    assert m.prompt.tolist() == positions
    assert m.delta == delta
    beyond = torch.arange(len(ids), len(ids) + 3)
    assert m.at(beyond).tolist() == [(beyond + delta).tolist()] * 3


def test_expand_image_pads_and_refusals():
    assert expand_image_pads([1, VS, PAD, VE, VS, PAD, VE], [2, 3], PAD) == \
        [1, VS, PAD, PAD, VE, VS, PAD, PAD, PAD, VE]
    with pytest.raises(ValueError, match="1 image-pad tokens .* for 2 images"):
        expand_image_pads([1, VS, PAD, VE], [2, 3], PAD)
    with pytest.raises(ValueError, match="more image-pad tokens"):
        rope_index([PAD] * 5, [(1, 2, 2)], PAD)
    with pytest.raises(ValueError, match="1 image grid"):
        rope_index([1, 2], [(1, 2, 2)], PAD)


def test_draft_steps_address_the_cache_by_sequence_index():
    """After an image the positions trail the sequence index (delta -3): the slots, seq_lens
    and the max_model_len clamp follow the index, the three position rows advance by one."""
    positions = torch.tensor([[10], [10], [10]])  # sequence index 13, delta -3
    seq_lens = torch.tensor([14], dtype=torch.int32)
    block_table = torch.tensor([[3, 7, 1, 5]], dtype=torch.int32)
    clamped, slots, lens = draft_step_schedule(positions, seq_lens, block_table, 3, 4, 16)
    assert clamped[:, :, 0].tolist() == [[11, 11, 11], [12, 12, 12], [0, 0, 0]]  # step-major;
    # index 16 reaches max_model_len
    assert slots.tolist() == [[5 * 4 + 2], [5 * 4 + 3], [-1]]  # indices 14, 15: block 5
    assert lens.tolist() == [[15], [16], [1]]
