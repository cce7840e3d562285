"""Turning logits into probabilities and tokens, per request, without host syncs.

Sampling uses the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` draws from ``p``
(gpt-fast's trick), so no ``multinomial`` and no host round trip. A seeded request draws the
noise of output token t from a generator seeded by ``(seed, t)``: its tokens depend neither
on its batch neighbours nor on how many drafts were verified in each step.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rocdraft.platform import host_to_device


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters, one row per logits row."""

    temperature: torch.Tensor  # [num_rows] float32, 0 = greedy
    top_k: torch.Tensor  # [num_rows] int64, 0 = disabled
    top_p: torch.Tensor  # [num_rows] float32, 1 = disabled
    generators: tuple[torch.Generator | None, ...]  # [num_rows] sequential streams
    all_greedy: bool
    # [num_rows] (seed, index of the row's first output token) or None; takes precedence over
    # the row's generator: position j then draws from a generator seeded by (seed, index + j).
    position_seeds: tuple[tuple[int, int] | None, ...] | None = None
    any_seeded: bool = False  # some row's params carry a seed

    def with_position_seeds(self, position_seeds: list) -> "SamplingTensors":
        return replace(self, position_seeds=tuple(position_seeds))

    @staticmethod
    def build(params: list, generators: list, device,
              position_seeds: list | None = None) -> "SamplingTensors":
        def dev(values, dtype):  # host list -> device without blocking the host
            return host_to_device(torch.tensor(values, dtype=dtype), device)

        return SamplingTensors(
            temperature=dev([p.temperature for p in params], torch.float32),
            top_k=dev([max(p.top_k, 0) for p in params], torch.long),
            top_p=dev([p.top_p for p in params], torch.float32),
            generators=tuple(generators), all_greedy=all(p.greedy for p in params),
            position_seeds=tuple(position_seeds) if position_seeds is not None else None,
            any_seeded=any(p.seed is not None for p in params))


class SamplingTensorCache:
    """The SamplingTensors of the last batch seen, rebuilt only when its rows' params change
    (continuous batching keeps a batch for many steps). Rows use the default generator; the
    caller sets the per-step ``position_seeds`` of seeded rows."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: SamplingTensors | None = None

    def get(self, params: list, device) -> SamplingTensors:
        key = (str(device), tuple(params))
        if key != self._key:
            self._key = key
            self._value = SamplingTensors.build(params, [None] * len(params), device)
        return self._value


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] float32 -> probabilities [n, vocab] after temperature, top-k, top-p.
    Greedy rows (temperature 0) get a one-hot on their argmax."""
    greedy = temperature == 0
    # Shift by the row max first (softmax is shift-invariant): a tiny temperature then sends
    # the other logits to -inf instead of the max to +inf (inf - inf would give NaN).
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    scaled = shifted / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    drop = (top_k.unsqueeze(1) > 0) & (rank >= top_k.unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    # top_p 1 keeps everything: rounding can bring mass_before to 1.0 ahead of tiny tails.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_p = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    sorted_probs = sorted_probs.masked_fill(drop_p, 0.0)
    probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy.unsqueeze(1), one_hot, probs)


def sample_from_probs(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs [..., vocab], noise Exp(1) of the same shape -> token ids [...] (exponential race)."""
    return (probs / noise.clamp(min=1e-20)).argmax(dim=-1)


def position_generator(seed: int, position: int, device) -> torch.Generator:
    """The generator of output token ``position`` of a request seeded with ``seed``."""
    mixed = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % (2 ** 63)
    return torch.Generator(device=device).manual_seed(mixed)


def position_noise(num_drafts: list[int], width: int, vocab: int,
                   sampling: SamplingTensors, device) -> torch.Tensor:
    """Exp(1) noise [B, width, vocab] for the num_drafts[i] + 1 verified positions of row i:
    per position from ``position_generator(seed, index + j)`` for seeded rows, else in order
    from the row's generator (None: the default one)."""
    noise = torch.ones(len(num_drafts), width, vocab, device=device)
    seeds = sampling.position_seeds or (None,) * len(num_drafts)
    for i, (n, gen, seed) in enumerate(zip(num_drafts, sampling.generators, seeds)):
        if seed is None:
            noise[i, :n + 1].exponential_(generator=gen)
            continue
        for j in range(n + 1):
            noise[i, j].exponential_(generator=position_generator(seed[0], seed[1] + j, device))
    return noise
