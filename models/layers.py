"""Building blocks shared by the target model and the EAGLE heads.

Every module takes ``device`` / ``dtype`` so a model is built directly where it runs
(``device="meta"`` builds it without allocating, for checkpoint loading).

Fewer, larger ops per layer (issue 12): q/k/v and gate/up keep their Hugging Face modules
(``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``: checkpoint keys, the loader's
checks and ``state_dict`` are unchanged), but their weights are views of ONE fused tensor, so
each forward runs one matmul for q/k/v and one for gate/up without a second copy of the
weights (``fused_linear``). RoPE is applied to q and k together, with the cos/sin
tables the model prepares once per step (``RopeTables``); float32 RMSNorm does no dtype
round trip.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rocdraft.backends.base import AttentionBackend
from rocdraft.backends.kv_cache import LayerKVCache
from rocdraft.models.rope import RopeTables, apply_rotary_tables


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, the statistics in float32."""

    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden_size] -> same shape and dtype."""
        if x.dtype == torch.float32:  # the same float32 products, without .float() / .to()
            return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(self.eps))).mul_(
                self.weight)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def fused_linear_weights(parts: tuple[nn.Linear, ...]
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [sum(out_features), in_features], bias or None) of ``parts`` stacked by rows.

    The first call (or any call after the parts' storage was replaced: ``to_empty``,
    ``.to(...)``, a ``load_state_dict(assign=True)``) concatenates the parts' weights once and
    re-points every part's ``weight`` / ``bias`` at its rows of the fused tensor, so writes
    through the parts (``copy_weights``) land in the fused tensor and no second copy exists.
    Later calls only compare data pointers (no aten op).
    """
    cached = parts[0].__dict__.get("_fused")
    pointers = tuple((p.weight.data_ptr(), None if p.bias is None else p.bias.data_ptr())
                     for p in parts)
    if cached is not None and cached[0] == pointers and cached[1].device.type != "meta":
        return cached[1], cached[2]
    with torch.no_grad():
        weight = torch.cat([p.weight.detach() for p in parts])
        bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
        row = 0
        for p in parts:
            rows = p.weight.shape[0]
            p.weight.data = weight[row:row + rows]
            if bias is not None:
                p.bias.data = bias[row:row + rows]
            row += rows
    pointers = tuple((p.weight.data_ptr(), None if p.bias is None else p.bias.data_ptr())
                     for p in parts)
    parts[0].__dict__["_fused"] = (pointers, weight, bias)
    return weight, bias


def fused_linear(x: torch.Tensor, parts: tuple[nn.Linear, ...]) -> torch.Tensor:
    """x [num_tokens, in_features] -> [num_tokens, sum(out_features)]: every part's output,
    side by side, from one matmul."""
    return F.linear(x, *fused_linear_weights(parts))


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``; gate and up run as one matmul (see the module
    docstring)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden_size] -> [num_tokens, hidden_size]."""
        gate_up = fused_linear(x, (self.gate_proj, self.up_proj))
        gate, up = gate_up.split(self.gate_proj.out_features, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


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

    def forward(self, x: torch.Tensor, rope: RopeTables, kv_cache: LayerKVCache,
                attn_metadata) -> torch.Tensor:
        """x [num_tokens, input_size], rope: the step's tables (``RotaryEmbedding.tables``)
        -> [num_tokens, hidden_size]. Writes this layer's K/V into ``kv_cache``."""
        num_tokens = x.shape[0]
        num_heads, num_kv_heads = self.num_heads, self.num_kv_heads
        qkv = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj))
        qkv = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, self.head_dim)
        # q and k rotated together: [num_tokens, Hq + Hk, head_dim]
        qk = apply_rotary_tables(qkv[:, :num_heads + num_kv_heads], rope)
        q, k, v = qk[:, :num_heads], qk[:, num_heads:], qkv[:, num_heads + num_kv_heads:]
        out = self.attn.forward(q, k, v, kv_cache, attn_metadata)  # [num_tokens, Hq, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
