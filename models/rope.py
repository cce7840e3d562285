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

Step tables (``RotaryEmbedding.tables``) are looked up, not recomputed: cos and signed sin
for positions ``0 .. table_len - 1`` are computed once per dtype by the same ops as
``forward`` (elementwise, so row ``p`` equals a fresh computation for position ``p`` bit for
bit) and rows are taken with ``index_select`` (2 ops a step instead of ~15). Positions on the
CPU grow the table on demand; positions on an accelerator are looked up only within
``max_positions`` rows reserved up front (``reserve_positions``; a bound check would sync with
the host and break graph capture: positions are clamped to the table on the device), else
computed fresh as before.
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
                 first_row_of_mrope: bool = False, max_positions: int | None = None) -> None:
        """``first_row_of_mrope``: without an ``mrope_section``, take row 0 of [3, num_tokens]
        positions instead of refusing them (draft heads of an M-RoPE target get the target's
        positions; for text tokens the three rows are equal). ``max_positions``: table rows
        to reserve, so positions on an accelerator below it are looked up too (every
        position must then be below it: an out-of-range index is a device error)."""
        super().__init__()
        self.max_positions = max_positions
        self._tables: dict[torch.dtype, RopeTables] = {}  # dtype -> [table_len, 1, head_dim]
        self._tables_of: torch.Tensor | None = None  # the inv_freq they were computed from
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
        self._tables = {}

    def _plain_or_mrope(self, positions: torch.Tensor) -> torch.Tensor:
        """Checked positions: [num_tokens], or [3, num_tokens] with an ``mrope_section``."""
        if positions.dim() == 2 and self.mrope_section is None and self.first_row_of_mrope:
            positions = positions[0]
        if positions.dim() == 2:
            if self.mrope_section is None or positions.shape[0] != 3:
                raise ValueError(f"positions of shape {list(positions.shape)} need M-RoPE "
                                 f"(rope_scaling with mrope_section) and 3 rows")
        elif positions.dim() != 1:
            raise ValueError(f"positions must be [num_tokens] or [3, num_tokens], got "
                             f"{list(positions.shape)}")
        return positions

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] (or [3, num_tokens] for M-RoPE) -> cos, sin, each
        [num_tokens, head_dim] float32."""
        inv_freq = self.inv_freq.float()
        positions = self._plain_or_mrope(positions)
        freqs = positions.float().unsqueeze(-1) * inv_freq  # [(3,) num_tokens, head_dim // 2]
        if positions.dim() == 2:
            chunks = freqs.split(list(self.mrope_section), dim=-1)
            freqs = torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)
        angles = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
        return angles.cos(), angles.sin()

    def _fresh_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """positions as in ``forward`` -> ``RopeTables`` computed from scratch."""
        cos, sin = self.forward(positions)
        half = self.head_dim // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return RopeTables(cos.to(dtype).unsqueeze(1), sin_signed.to(dtype).unsqueeze(1))

    def _table(self, dtype: torch.dtype, num_positions: int) -> RopeTables:
        """The tables of positions 0 .. at least num_positions - 1 in ``dtype``, built (or
        grown to the next power of two, at least 256 rows) when missing or too short."""
        if self._tables_of is not self.inv_freq:  # .to() / load replaced the buffer
            self._tables, self._tables_of = {}, self.inv_freq
        table = self._tables.get(dtype)
        if table is None or table.cos.shape[0] < num_positions:
            rows = max(256, self.max_positions or 0, 1 << (num_positions - 1).bit_length())
            table = self._fresh_tables(torch.arange(rows, device=self.inv_freq.device), dtype)
            self._tables[dtype] = table
        return table

    def _lookup(self, table: RopeTables, positions: torch.Tensor) -> RopeTables:
        """table rows [table_len, 1, head_dim], positions as in ``forward`` (checked) ->
        RopeTables [num_tokens, 1, head_dim]. M-RoPE takes each column from its section's
        row of positions (``_mrope_rows``)."""
        if positions.dim() == 1:
            return RopeTables(table.cos.index_select(0, positions),
                              table.sin_signed.index_select(0, positions))
        num_tokens = positions.shape[1]
        rows = self._mrope_rows(positions.device).expand(1, num_tokens, 1, self.head_dim)

        def pick(values: torch.Tensor) -> torch.Tensor:
            per_row = values.index_select(0, positions.reshape(-1))  # [3 * n, 1, head_dim]
            return per_row.view(3, num_tokens, 1, self.head_dim).gather(0, rows)[0]
        return RopeTables(pick(table.cos), pick(table.sin_signed))

    def _mrope_rows(self, device: torch.device) -> torch.Tensor:
        """[1, 1, 1, head_dim] int64: the position row (i % 3 for section i) of each column."""
        half = [i % 3 for i, size in enumerate(self.mrope_section) for _ in range(size)]
        return torch.tensor(half + half, device=device).view(1, 1, 1, self.head_dim)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """positions as in ``forward`` -> the ``RopeTables`` in ``dtype`` (the model's),
        computed once per step and shared by every layer; rows of the precomputed tables
        (bit for bit a fresh computation), see the module docstring."""
        positions = self._plain_or_mrope(positions)
        if positions.device != self.inv_freq.device or positions.numel() == 0:
            return self._fresh_tables(positions, dtype)
        if positions.device.type == "cpu":
            try:  # CPU index_select checks bounds: grow on a miss
                return self._lookup(self._table(dtype, 0), positions)
            except IndexError:
                if int(positions.min()) < 0:
                    return self._fresh_tables(positions, dtype)
                return self._lookup(self._table(dtype, int(positions.max()) + 1), positions)
        built = self._tables_of is self.inv_freq and dtype in self._tables
        if self.max_positions is None or (_capturing(positions.device) and not built):
            return self._fresh_tables(positions, dtype)  # no host-side bound check here
        # Clamped on the device (no host check): a position past the reserved rows (only
        # graph padding rows, which write nothing) reads the last row instead of faulting.
        return self._lookup(self._table(dtype, self.max_positions),
                            positions.clamp(0, self.max_positions - 1))


def reserve_positions(model: nn.Module, max_positions: int) -> None:
    """Reserve table rows for positions 0 .. max_positions - 1 in every RotaryEmbedding of
    ``model``, so that accelerator steps look their rows up (the engine passes
    max_model_len + 1: graph padding rows sit at max_model_len)."""
    if max_positions < 1:
        raise ValueError(f"max_positions must be >= 1, got {max_positions}")
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.max_positions = max_positions


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA/HIP graph is being captured (a table built now would hold no values)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
