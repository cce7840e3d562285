"""Parallel layers of a tensor-parallel target, and the byte counter of their collectives.

Column-parallel projections need no module of their own: q/k/v and gate/up are the shared
``models.layers`` modules built with each rank's head / row counts (their weights fused by
``fused_linear`` as on one device; the shard loader gives them their rows, Qwen2's q/k/v
biases included), and they move no bytes. What communicates lives here:

- ``RowParallelLinear`` (o_proj, down_proj): the rank's columns of the weight, then ONE
  ``all_reduce`` of the [num_tokens, hidden_size] partial sums; the bias (if any) is added
  once, after the reduce.
- ``VocabParallelEmbedding``: each rank looks up the ids in its rows
  ``[rank * vocab_per_rank, (rank + 1) * vocab_per_rank)``, zeroes the others, and one
  ``all_reduce`` sums the [num_tokens, hidden_size] rows.
- ``ParallelLMHead``: local logits [num_tokens, vocab_per_rank], then ONE ``all_gather`` to
  [num_tokens, vocab_size] on every rank (padding rows cut off). A sharded argmax would move
  less for greedy decoding, but the rejection sampler and random sampling need the full
  logits on the rank that samples; gathering keeps every sampler unchanged.

Bytes, as ``CommCounter`` counts them (the payload one rank contributes/receives, not the
wire traffic of the ring algorithm, which is about ``2 (tp - 1) / tp`` times the payload for an
all-reduce): per token an all-reduce moves ``hidden_size * dtype_bytes``, so a decoder of L
layers moves ``(2 L + 1) * hidden_size * dtype_bytes`` (the theoretical ``2 L hidden dtype`` plus
the embedding's one), and the lm_head gather ``vocab_per_rank * tp * dtype_bytes`` per logit row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rocdraft.distributed.group import ParallelGroup


@dataclass
class CommCounter:
    """Calls and payload bytes of the collectives one rank ran (reset with ``reset()``)."""

    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0
    all_gather_calls: int = 0
    all_gather_bytes: int = 0

    def reset(self) -> None:
        self.all_reduce_calls = self.all_reduce_bytes = 0
        self.all_gather_calls = self.all_gather_bytes = 0


def all_reduce_(x: torch.Tensor, group: ParallelGroup, counter: CommCounter | None) -> torch.Tensor:
    """Sum ``x`` over the group, in place; a no-op for world size 1 (nothing counted)."""
    if group.is_parallel:
        dist.all_reduce(x, group=group.group)
        if counter is not None:
            counter.all_reduce_calls += 1
            counter.all_reduce_bytes += x.numel() * x.element_size()
    return x


def all_gather_last_dim(x: torch.Tensor, group: ParallelGroup,
                        counter: CommCounter | None) -> torch.Tensor:
    """x [n, m] on every rank -> [n, world_size * m], rank r's block at columns r*m..(r+1)*m."""
    if not group.is_parallel:
        return x
    parts = [torch.empty_like(x) for _ in range(group.world_size)]
    dist.all_gather(parts, x.contiguous(), group=group.group)
    out = torch.cat(parts, dim=-1)
    if counter is not None:
        counter.all_gather_calls += 1
        counter.all_gather_bytes += out.numel() * out.element_size()
    return out


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) + b``: ``weight`` [out_features, in_features /
    tp] is the rank's columns, ``bias`` the full bias (added after the reduce)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: ParallelGroup,
                 counter: CommCounter | None, device=None, dtype=None) -> None:
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.in_features, self.out_features = in_features, out_features
        self.group, self.counter = group, counter
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features] (local) -> [num_tokens, out_features] (full)."""
        out = all_reduce_(F.linear(x, self.weight), self.group, self.counter)
        return out if self.bias is None else out.add_(self.bias)


class VocabParallelEmbedding(nn.Module):
    """``weight`` [vocab_per_rank, hidden_size]: ids ``[rank * vocab_per_rank, ...)``."""

    def __init__(self, vocab_per_rank: int, hidden_size: int, group: ParallelGroup,
                 counter: CommCounter | None, device=None, dtype=None) -> None:
        super().__init__()
        self.vocab_per_rank, self.group, self.counter = vocab_per_rank, group, counter
        self.vocab_start = group.rank * vocab_per_rank
        self.embedding_dim = hidden_size  # as nn.Embedding's (EAGLE heads read it)
        self.weight = nn.Parameter(torch.empty(vocab_per_rank, hidden_size, device=device,
                                               dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [num_tokens] (full vocabulary ids) -> [num_tokens, hidden_size]."""
        if not self.group.is_parallel:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce_(rows, self.group, self.counter)


class ParallelLMHead(nn.Module):
    """``weight`` [vocab_per_rank, hidden_size] (may be tied to ``VocabParallelEmbedding``'s);
    the logits of every rank's rows gathered, cut to ``vocab_size``."""

    def __init__(self, vocab_size: int, vocab_per_rank: int, hidden_size: int,
                 group: ParallelGroup, counter: CommCounter | None, device=None,
                 dtype=None) -> None:
        super().__init__()
        self.vocab_size, self.group, self.counter = vocab_size, group, counter
        self.weight = nn.Parameter(torch.empty(vocab_per_rank, hidden_size, device=device,
                                               dtype=dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] (the weight's dtype), every rank."""
        logits = all_gather_last_dim(F.linear(hidden, self.weight), self.group, self.counter)
        return logits if logits.shape[-1] == self.vocab_size else \
            logits[:, :self.vocab_size].contiguous()
