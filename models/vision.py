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
is the exact (erf) one. Qwen2.5-VL's tower (RMSNorm, gated MLP, window attention) is refused
by the loader (models/qwen2_vl.py).

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

    def __post_init__(self) -> None:
        if self.hidden_act not in _ACTIVATIONS:
            raise CheckpointError(f"vision_config.hidden_act {self.hidden_act!r} is not "
                                  f"supported; supported: {sorted(_ACTIVATIONS)}")
        if self.embed_dim % self.num_heads or (self.embed_dim // self.num_heads) % 4:
            raise CheckpointError(f"vision_config: embed_dim {self.embed_dim} over num_heads "
                                  f"{self.num_heads} must give a head_dim divisible by 4")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> "VisionConfig":
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


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, **factory) -> None:
        super().__init__()
        dim = config.embed_dim
        self.norm1 = nn.LayerNorm(dim, eps=1e-6, **factory)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6, **factory)
        self.attn = VisionAttention(dim, config.num_heads, **factory)
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
        self.ln_q = nn.LayerNorm(config.embed_dim, eps=1e-6, **factory)
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
        for block in self.blocks:
            x = block(x, cos, sin, segments)
        return self.merger(x)
