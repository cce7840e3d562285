"""The Qwen2-VL vision tower (ViT + patch merger), keys ``visual.*`` of the checkpoint.

    pixel_values [num_patches, 3 * 2 * 14 * 14] (models/image_processing.py)
      -> patch_embed: Conv3d(3 -> embed_dim, kernel = stride = (2, 14, 14), no bias), i.e. one
         matmul with the kernel flattened                       [num_patches, embed_dim]
      -> depth x block: x += proj(attn(norm1 x)); x += fc2(act(fc1(norm2 x)))
         attention bidirectional within each image (per frame), 2-D RoPE on q and k
      -> merger: ln_q, 4 consecutive rows (a 2 x 2 block) as one, mlp.0, GELU, mlp.2
                                                                [num_patches / 4, LLM width]

Config traps (Qwen2-VL ``vision_config``): ``embed_dim`` is the ViT width and ``hidden_size``
the LLM's; ``hidden_act`` defaults to ``quick_gelu`` (x * sigmoid(1.702 x)); the merger's GELU
is the exact (erf) one.

Qwen2.5-VL (``window_size`` set): ``hidden_size`` is the ViT width and ``out_hidden_size`` the
LLM's; RMSNorm (weight only) for norm1 / norm2 / ln_q; ``mlp.{gate,up,down}_proj`` with bias,
``down(act(gate) * up)``; window attention: rows (and their RoPE) are permuted by
``window_index`` in groups of 4 (one merged token), so that each window of
``window_size / 28`` x ``window_size / 28`` merged tokens per frame (edge windows partial) is
contiguous; blocks in ``fullatt_block_indexes`` attend per frame, the others per window; the
merger's output is permuted back.

ViT 2-D RoPE: each patch's (row, column) in its image, listed in merge-block order
(grid (1, 4, 6): (0,0), (0,1), (1,0), (1,1), (0,2), (0,3), (1,2), (1,3), (0,4), ...); the
first half of the rotated dims turns with the row, the second with the column
(``inv_freq = 1 / 10000^(arange(0, d, 2) / d)``, d = head_dim / 2), in float32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rocdraft.errors import CheckpointError
from rocdraft.models.layers import RMSNorm
from rocdraft.models.rope import rotate_half

VISION_ROPE_THETA = 10000.0
_ACTIVATIONS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
                "gelu": lambda x: F.gelu(x), "silu": F.silu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    embed_dim: int  # the ViT width
    out_hidden_size: int  # the LLM width (Qwen2-VL's vision_config.hidden_size)
    num_heads: int
    mlp_ratio: float = 4.0
    hidden_act: str = "quick_gelu"
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    # Qwen2.5-VL only (window_size None: Qwen2-VL's tower)
    intermediate_size: int | None = None
    window_size: int | None = None
    fullatt_block_indexes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.hidden_act not in _ACTIVATIONS:
            raise CheckpointError(f"vision_config.hidden_act {self.hidden_act!r} is not "
                                  f"supported; supported: {sorted(_ACTIVATIONS)}")
        if self.embed_dim % self.num_heads or (self.embed_dim // self.num_heads) % 4:
            raise CheckpointError(f"vision_config: embed_dim {self.embed_dim} over num_heads "
                                  f"{self.num_heads} must give a head_dim divisible by 4")
        merged_patch = self.spatial_merge_size * self.patch_size
        if self.windowed and self.window_size < merged_patch:
            raise CheckpointError(f"vision_config: window_size {self.window_size} must be at "
                                  f"least spatial_merge_size * patch_size = {merged_patch}")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def windowed(self) -> bool:
        return self.window_size is not None

    @staticmethod
    def from_dict(raw: dict[str, Any], qwen2_5: bool = False) -> "VisionConfig":
        if qwen2_5:
            missing = [k for k in ("depth", "hidden_size", "out_hidden_size", "num_heads",
                                   "intermediate_size") if k not in raw]
            if missing:
                raise CheckpointError(f"Qwen2.5-VL vision_config lacks {missing}")
            return VisionConfig(
                depth=raw["depth"], embed_dim=raw["hidden_size"],
                out_hidden_size=raw["out_hidden_size"], num_heads=raw["num_heads"],
                hidden_act=raw.get("hidden_act") or "silu", in_channels=3,
                patch_size=raw.get("patch_size", 14),
                spatial_merge_size=raw.get("spatial_merge_size", 2),
                temporal_patch_size=raw.get("temporal_patch_size", 2),
                intermediate_size=raw["intermediate_size"],
                window_size=raw.get("window_size", 112),
                fullatt_block_indexes=tuple(raw.get("fullatt_block_indexes", (7, 15, 23, 31))))
        missing = [k for k in ("depth", "embed_dim", "hidden_size", "num_heads") if k not in raw]
        if missing:
            raise CheckpointError(f"Qwen2-VL vision_config lacks {missing}")
        return VisionConfig(
            depth=raw["depth"], embed_dim=raw["embed_dim"], out_hidden_size=raw["hidden_size"],
            num_heads=raw["num_heads"], mlp_ratio=float(raw.get("mlp_ratio", 4.0)),
            hidden_act=raw.get("hidden_act") or "quick_gelu",
            in_channels=3,  # a Hub config's in_chans is ignored, as transformers does
            patch_size=raw.get("patch_size", 14),
            spatial_merge_size=raw.get("spatial_merge_size", 2),
            temporal_patch_size=raw.get("temporal_patch_size", 2))


def window_index(grid_thw: tuple[int, int, int], merge_size: int, window: int
                 ) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows of one image: (t, h, w) in patches, ``window`` merged tokens per
    side -> (merged-token order [t * h/m * w/m] that makes each window contiguous, window
    lengths in merged tokens, empty ones dropped).

    Example, merged grid 2 x 3, window 2: tokens [[0, 1, 2], [3, 4, 5]] -> windows
    [0, 1, 3, 4], [2, 5] -> order [0, 1, 3, 4, 2, 5], lengths [4, 2].
    """
    t, h, w = grid_thw[0], grid_thw[1] // merge_size, grid_thw[2] // merge_size
    order, lengths = [], []
    for frame in range(t):
        base = frame * h * w
        for top in range(0, h, window):
            for left in range(0, w, window):
                rows = range(top, min(top + window, h))
                cols = range(left, min(left + window, w))
                order += [base + r * w + c for r in rows for c in cols]
                lengths.append(len(rows) * len(cols))
    return torch.tensor(order, dtype=torch.long), lengths


def vision_rope_positions(grid_thw: tuple[int, int, int], merge_size: int) -> torch.Tensor:
    """(t, h, w) -> [t * h * w, 2] int64 (row, column) of each patch in merge-block order."""
    t, h, w = grid_thw

    def block_order(values: torch.Tensor) -> torch.Tensor:  # [h, w] -> [h * w]
        return values.reshape(h // merge_size, merge_size, w // merge_size, merge_size) \
            .permute(0, 2, 1, 3).flatten()
    rows = block_order(torch.arange(h).view(h, 1).expand(h, w))
    cols = block_order(torch.arange(w).view(1, w).expand(h, w))
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, **factory) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True, **factory)
        self.proj = nn.Linear(dim, dim, bias=True, **factory)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[int]) -> torch.Tensor:
        """x [n, dim], cos/sin [n, head_dim] float32, segments: patches per frame -> [n, dim]."""
        n, dim = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, dim // self.num_heads).unbind(1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        outs = []
        for qs, ks, vs in zip(q.split(segments), k.split(segments), v.split(segments)):
            # [heads, len, head_dim], bidirectional within one frame
            outs.append(F.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1)).transpose(0, 1))
        return self.proj(torch.cat(outs).reshape(n, dim))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, **factory) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, **factory)
        self.fc2 = nn.Linear(hidden, dim, **factory)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedVisionMLP(nn.Module):
    """Qwen2.5-VL: ``down(act(gate x) * up x)``, every projection with a bias."""

    def __init__(self, dim: int, hidden: int, act: str, **factory) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, **factory)
        self.up_proj = nn.Linear(dim, hidden, **factory)
        self.down_proj = nn.Linear(hidden, dim, **factory)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _norm(config: VisionConfig, dim: int, **factory) -> nn.Module:
    """LayerNorm (Qwen2-VL) or RMSNorm (Qwen2.5-VL), eps 1e-6."""
    if config.windowed:
        return RMSNorm(dim, 1e-6, **factory)
    return nn.LayerNorm(dim, eps=1e-6, **factory)


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, **factory) -> None:
        super().__init__()
        dim = config.embed_dim
        self.norm1 = _norm(config, dim, **factory)
        self.norm2 = _norm(config, dim, **factory)
        self.attn = VisionAttention(dim, config.num_heads, **factory)
        if config.windowed:
            self.mlp = GatedVisionMLP(dim, config.intermediate_size, config.hidden_act,
                                      **factory)
        else:
            self.mlp = VisionMLP(dim, int(dim * config.mlp_ratio), config.hidden_act, **factory)

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig, **factory) -> None:
        super().__init__()
        self.proj = nn.Module()  # key visual.patch_embed.proj.weight, the Conv3d kernel
        self.proj.weight = nn.Parameter(torch.empty(
            config.embed_dim, config.in_channels, config.temporal_patch_size,
            config.patch_size, config.patch_size, **factory))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, patch_dim] -> [n, embed_dim] (the Conv3d of stride = kernel as one matmul)."""
        weight = self.proj.weight
        return pixel_values.to(weight.dtype) @ weight.reshape(weight.shape[0], -1).T


class PatchMerger(nn.Module):
    def __init__(self, config: VisionConfig, **factory) -> None:
        super().__init__()
        merged = config.embed_dim * config.spatial_merge_size ** 2
        self.ln_q = _norm(config, config.embed_dim, **factory)
        self.mlp = nn.Sequential(nn.Linear(merged, merged, **factory), nn.GELU(),
                                 nn.Linear(merged, config.out_hidden_size, **factory))
        self.merged = merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class VisionTower(nn.Module):
    """Qwen2-VL's ViT + merger; ``forward(pixel_values, grids)`` -> image embeddings."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.config = config
        self.patch_embed = PatchEmbed(config, **factory)
        self.blocks = nn.ModuleList(VisionBlock(config, **factory) for _ in range(config.depth))
        self.merger = PatchMerger(config, **factory)

    def rope(self, grids_thw: list[tuple[int, int, int]], device
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_patches, head_dim] float32 of every image's patches."""
        rotated = self.config.head_dim // 2
        inv_freq = 1.0 / VISION_ROPE_THETA ** (
            torch.arange(0, rotated, 2, dtype=torch.float32, device=device) / rotated)
        positions = torch.cat([vision_rope_positions(g, self.config.spatial_merge_size)
                               for g in grids_thw]).to(device)  # [n, 2]
        angles = (positions.unsqueeze(-1).float() * inv_freq).flatten(1)  # [n, rotated]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, grids_thw: list[tuple[int, int, int]]
                ) -> torch.Tensor:
        """pixel_values [num_patches, patch_dim] (images concatenated), grids_thw: each
        image's (t, h, w) -> [num_patches / merge_size^2, LLM width], images in order."""
        expected = sum(t * h * w for t, h, w in grids_thw)
        if pixel_values.shape != (expected, self.config.patch_dim):
            raise ValueError(f"pixel_values of shape {list(pixel_values.shape)} do not match "
                             f"grids {grids_thw} ([{expected}, {self.config.patch_dim}])")
        x = self.patch_embed(pixel_values)  # [n, embed_dim]
        cos, sin = self.rope(grids_thw, x.device)
        segments = [h * w for t, h, w in grids_thw for _ in range(t)]  # one per frame
        if not self.config.windowed:
            for block in self.blocks:
                x = block(x, cos, sin, segments)
            return self.merger(x)
        # Qwen2.5-VL: rows regrouped window by window (4 rows = one merged token move together)
        unit = self.config.spatial_merge_size ** 2
        order, windows, offset = [], [], 0
        side = self.config.window_size // self.config.spatial_merge_size \
            // self.config.patch_size
        for grid in grids_thw:
            index, lengths = window_index(grid, self.config.spatial_merge_size, side)
            order.append(index + offset)
            windows += [n * unit for n in lengths]
            offset += index.numel()
        merged_order = torch.cat(order).to(x.device)  # [n / unit]

        def regroup(rows: torch.Tensor) -> torch.Tensor:
            return rows.view(-1, unit, rows.shape[-1])[merged_order].reshape(rows.shape)
        x, cos, sin = regroup(x), regroup(cos), regroup(sin)
        for i, block in enumerate(self.blocks):
            full = i in self.config.fullatt_block_indexes
            x = block(x, cos, sin, segments if full else windows)
        return self.merger(x)[torch.argsort(merged_order)]
