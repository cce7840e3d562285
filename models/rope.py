"""Rotary position embeddings (the "rotate half" layout used by Llama / Qwen2 / Mistral).

Inverse frequencies by ``rope_scaling["rope_type"]``:

- ``default`` / ``mrope``: ``1 / theta ** (arange(0, head_dim, 2) / head_dim)``;
- ``linear``: default divided by ``factor``;
- ``dynamic`` (NTK): equals default for sequences within ``max_position_embeddings``, which
  is the only range a paged cache can serve consistently (frequencies must not change once
  keys are cached), so it is treated as default;
- ``llama3``: Llama-3.1 smoothing between ``low_freq_factor`` and ``high_freq_factor``
  wavelengths of ``original_max_position_embeddings``.

M-RoPE (Qwen2-VL): positions are ``[3, num_tokens]`` (temporal, height, width) and the
``head_dim // 2`` frequencies are split by ``mrope_section``; chunk ``i`` takes its angle
from position row ``i % 3``. One-dimensional positions are broadcast to all three rows,
which reduces M-RoPE to plain RoPE (text-only tokens).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn


def compute_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (rope_theta ** exponents)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the
    # band in between interpolated by `smooth`.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim], cos/sin [num_tokens, head_dim] -> like x."""
    cos, sin = cos.to(x.dtype).unsqueeze(1), sin.to(x.dtype).unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class RopeTables(NamedTuple):
    """What every attention layer of one forward applies, prepared once per step."""

    cos: torch.Tensor  # [num_tokens, 1, head_dim], the model dtype
    sin_signed: torch.Tensor  # [num_tokens, 1, head_dim]: (-sin, +sin) halves, the model dtype


def apply_rotary_tables(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim] (q and k may be rotated together, any row stride)
    -> a new contiguous tensor like x.

    ``rotate_half(x) * sin`` is ``swap_halves(x) * sin_signed`` (a sign flip is exact), so
    this equals ``apply_rotary`` bit for bit with one roll instead of two slices, a negation
    and a concatenation.
    """
    swapped = torch.roll(x, x.shape[-1] // 2, dims=-1)  # (x1, x2) -> (x2, x1), a new tensor
    return swapped.mul_(tables.sin_signed).add_(x * tables.cos)


class RotaryEmbedding(nn.Module):
    """Turns positions into the (cos, sin) every attention layer of a model applies."""

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None,
                 device: torch.device | str | None = None,
                 first_row_of_mrope: bool = False) -> None:
        """``first_row_of_mrope``: without an ``mrope_section``, take row 0 of [3, num_tokens]
        positions instead of refusing them (draft heads of an M-RoPE target get the target's
        positions; for text tokens the three rows are equal)."""
        super().__init__()
        self.head_dim, self.rope_theta, self.rope_scaling = head_dim, rope_theta, rope_scaling
        self.first_row_of_mrope = first_row_of_mrope
        section = (rope_scaling or {}).get("mrope_section")
        self.mrope_section: tuple[int, ...] | None = tuple(section) if section else None
        if self.mrope_section is not None and sum(self.mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {list(self.mrope_section)} must sum to "
                             f"head_dim // 2 = {head_dim // 2}")
        self.register_buffer("inv_freq", compute_inv_freq(head_dim, rope_theta, rope_scaling,
                                                          device), persistent=False)

    def reset_inv_freq(self) -> None:
        """Recompute the buffer (after ``to_empty`` materialised a meta-device model)."""
        self.inv_freq.copy_(compute_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling,
                                             self.inv_freq.device))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] (or [3, num_tokens] for M-RoPE) -> cos, sin, each
        [num_tokens, head_dim] float32."""
        inv_freq = self.inv_freq.float()
        if positions.dim() == 2 and self.mrope_section is None and self.first_row_of_mrope:
            positions = positions[0]
        if positions.dim() == 2:
            if self.mrope_section is None or positions.shape[0] != 3:
                raise ValueError(f"positions of shape {list(positions.shape)} need M-RoPE "
                                 f"(rope_scaling with mrope_section) and 3 rows")
            freqs = positions.float().unsqueeze(-1) * inv_freq  # [3, num_tokens, head_dim // 2]
            chunks = freqs.split(list(self.mrope_section), dim=-1)
            freqs = torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)
        elif positions.dim() == 1:
            freqs = positions.float().unsqueeze(-1) * inv_freq  # [num_tokens, head_dim // 2]
        else:
            raise ValueError(f"positions must be [num_tokens] or [3, num_tokens], got "
                             f"{list(positions.shape)}")
        angles = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
        return angles.cos(), angles.sin()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """positions as in ``forward`` -> the ``RopeTables`` in ``dtype`` (the model's),
        computed once per step and shared by every layer."""
        cos, sin = self.forward(positions)
        half = self.head_dim // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return RopeTables(cos.to(dtype).unsqueeze(1), sin_signed.to(dtype).unsqueeze(1))
