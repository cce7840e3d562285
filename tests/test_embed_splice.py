"""models/embed_splice.py: rows replaced in order, and the splice over the unpadded drafter's
kept tokens (rejected rows dropped, the rest renumbered)."""
from __future__ import annotations

import torch

from rocdraft.models.embed_splice import EmbedSplice, splice_or_none


def test_apply_and_kept():
    splice = EmbedSplice(torch.tensor([1, 3, 4]), torch.tensor([[10.0], [30.0], [40.0]]))
    hidden = torch.zeros(6, 1)
    assert splice.apply(hidden)[:, 0].tolist() == [0, 10, 0, 30, 40, 0]
    assert hidden.abs().sum() == 0  # a copy
    # [a0, a1, a2 (rejected), b0, b1, b2] keeps rows 0, 1, 3, 4, 5
    kept = splice.kept(torch.tensor([0, 1, 3, 4, 5]))
    assert kept.indices.tolist() == [1, 2, 3] and kept.embeds[:, 0].tolist() == [10, 30, 40]
    dropped = splice.kept(torch.tensor([0, 2, 5]))
    assert dropped is None
    partial = splice.kept(torch.tensor([0, 3, 5]))
    assert partial.indices.tolist() == [1] and partial.embeds[:, 0].tolist() == [30]
    assert splice_or_none([], [], "cpu") is None
