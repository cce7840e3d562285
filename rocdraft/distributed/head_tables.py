"""Whole copies of the target's vocabulary tables for the EAGLE head on rank 0.

Under tensor parallelism the target's ``embed_tokens`` and ``lm_head`` are sharded by
vocabulary rows (``distributed.layers``), so a head sharing them would hold collectives and
every draft call would need the workers. Instead the head runs on rank 0 alone, replicated
whole, against whole copies of those tables read here from the target's checkpoint
(``ShardReader``, the whole tensor: the memory map gives the bytes, nothing else is loaded):

- ``embed_tokens``: ``model.embed_tokens.weight`` [vocab_size, hidden_size];
- ``lm_head``: ``lm_head.weight``, or the embedding itself when the checkpoint ties them
  (``tie_word_embeddings``), as the target does.

Why rank 0 only: the drafts are consumed by rank 0's scheduler alone and reach the workers
inside the verification message, so they are the same on every rank by construction; a head
on every rank would redo the same work N times and need one message per draft call, and a
head sharded over the group would put collectives into every draft step of a one-layer
model. The draft loop then holds no collective, so it is captured in a CUDA/HIP graph per
batch bucket exactly as on one GPU (on the CPU its runner replays the same static buffers).
The cost is rank 0's memory: one more copy of each table, vocab x hidden x dtype bytes
(128256 x 8192 x 2 B = 2.1 GB for a Llama-3-70B embedding; the lm_head likewise unless tied).

``VocabTables`` stands in for the target where the head loader reads it (``config``,
``embed_tokens``, ``lm_head``: models/draft_loader.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rocdraft.distributed.shard_loader import ShardReader
from rocdraft.errors import CheckpointError
from rocdraft.models.config import ModelConfig

EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"


@dataclass(frozen=True)
class VocabTables:
    """What the head loader reads of a target: its config and whole vocabulary tables."""

    config: ModelConfig
    embed_tokens: nn.Embedding  # [vocab_size, hidden_size]
    lm_head: nn.Linear  # hidden_size -> vocab_size, no bias (tied: the embedding's weight)


def load_vocab_tables(path: str | Path, config: ModelConfig, dtype: torch.dtype,
                      device: torch.device | str) -> VocabTables:
    """Whole ``embed_tokens`` and ``lm_head`` of the target checkpoint in ``path``
    (safetensors, single file or index-sharded), checked against ``config``."""
    expected = [config.vocab_size, config.hidden_size]
    where = f"target checkpoint {path}"
    with ShardReader(path) as reader:
        weights = {}
        for key in (EMBED_KEY,) if config.tie_word_embeddings else (EMBED_KEY, LM_HEAD_KEY):
            if key not in reader.keys():
                raise CheckpointError(f"{where}: missing weight {key}")
            if reader.shape(key) != expected:
                raise CheckpointError(f"{where}: weight {key} has shape {reader.shape(key)}, "
                                      f"expected [vocab_size, hidden_size] = {expected}")
            tensor = reader.read(key)
            if not tensor.is_floating_point():
                raise CheckpointError(f"{where}: weight {key} has dtype {tensor.dtype}, "
                                      f"expected a floating-point tensor")
            weights[key] = tensor.to(device=device, dtype=dtype)
    embed = nn.Embedding(*expected, device="meta", dtype=dtype)
    embed.weight = nn.Parameter(weights[EMBED_KEY], requires_grad=False)
    lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta",
                        dtype=dtype)
    lm_head.weight = embed.weight if config.tie_word_embeddings \
        else nn.Parameter(weights[LM_HEAD_KEY], requires_grad=False)
    return VocabTables(config, embed, lm_head)
