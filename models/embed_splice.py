"""Rows of a forward's input embeddings replaced by multimodal embeddings (image tokens).

The target splices each image's vision-tower rows over its image-pad tokens (transformers'
``masked_scatter`` in prompt order); the EAGLE head splices the same rows one token earlier,
since its input at index i is the token at index i + 1 (the seed passes the multimodal
embeddings to the draft model).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EmbedSplice:
    indices: torch.Tensor  # [m] int64: rows of the forward's tokens
    embeds: torch.Tensor  # [m, hidden_size]: what replaces them

    def apply(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_tokens, hidden_size] -> a copy with the rows replaced."""
        return hidden.index_copy(0, self.indices, self.embeds.to(hidden.dtype))

    def kept(self, token_indices: torch.Tensor) -> "EmbedSplice | None":
        """The splice over ``hidden[token_indices]`` (token_indices ascending, e.g. the
        unpadded drafter's kept tokens): rows not kept are dropped, the rest renumbered."""
        where = torch.searchsorted(token_indices, self.indices)
        found = where < token_indices.shape[0]
        found[found.clone()] = token_indices[where[found]] == self.indices[found]
        if not bool(found.any()):
            return None
        return EmbedSplice(where[found], self.embeds[found])


def splice_or_none(indices: list[int], embeds: list[torch.Tensor], device
                   ) -> EmbedSplice | None:
    """An EmbedSplice from host lists (None when empty), moved to ``device``."""
    if not indices:
        return None
    return EmbedSplice(torch.tensor(indices, dtype=torch.long, device=device),
                       torch.cat(embeds).to(device))
