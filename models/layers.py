"""Building blocks shared by the target model and the EAGLE heads.

Every module takes ``device`` / ``dtype`` so a model is built directly where it runs
(``device="meta"`` builds it without allocating, for checkpoint loading).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rocdraft.backends.base import AttentionBackend
from rocdraft.backends.kv_cache import LayerKVCache
from rocdraft.models.rope import apply_rotary


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, the statistics in float32."""

    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden_size] -> same shape and dtype."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden_size] -> [num_tokens, hidden_size]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """q/k/v projections, RoPE, the backend's paged attention, o_proj.

    ``input_size`` is the width q/k/v read (EAGLE-3's midlayer reads 2 * hidden_size);
    ``hidden_size`` is what o_proj writes back.
    """

    def __init__(self, input_size: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, attn_backend: type[AttentionBackend], qkv_bias: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(input_size, num_heads * head_dim, bias=qkv_bias, **factory)
        self.k_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=qkv_bias, **factory)
        self.v_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=qkv_bias, **factory)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False, **factory)
        # Not an nn.Module: the backend's per-layer attention holds no parameters.
        self.attn = attn_backend.impl_cls(num_heads, num_kv_heads, head_dim, head_dim ** -0.5)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_cache: LayerKVCache, attn_metadata) -> torch.Tensor:
        """x [num_tokens, input_size], cos/sin [num_tokens, head_dim]
        -> [num_tokens, hidden_size]. Writes this layer's K/V into ``kv_cache``."""
        num_tokens = x.shape[0]
        cos, sin = cos_sin
        q = apply_rotary(self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim),
                         cos, sin)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn.forward(q, k, v, kv_cache, attn_metadata)  # [num_tokens, Hq, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
