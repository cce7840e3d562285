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

Each block also has a functional form over plain tensors (``rms_norm``, ``attention_forward``,
``gated_mlp_forward``, ``decoder_forward``, ``block_forward``) that the modules' own
``forward`` calls: a model flattens its blocks' weights once (``*_weights()`` here, cached by
``models/weight_cache.py`` and re-validated once per forward), so a step dispatches its ops
without nn.Module calls, attribute look-ups or per-layer fused-weight checks (10% of a bs-1
decode step of the built-in target on the CPU). A projection that is not a plain
``nn.Linear`` (tensor parallelism's row-parallel o/down, which all-reduce) stays a module
call (``linear_of``).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from rocdraft.backends.base import AttentionBackend, AttentionImpl
from rocdraft.backends.kv_cache import LayerKVCache, write_kv_reference
from rocdraft.models.linear_form import note_aliases, run_linear
from rocdraft.models.rope import RopeTables, apply_rotary_tables


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)``, the statistics in float32.
    x [num_tokens, hidden_size] -> same shape and dtype."""
    # On the CPU aten's rms_norm (torch 2.13: _fused_rms_norm) composes these same float32
    # ops (pow, mean, add, rsqrt, mul) in C++ from one Python call: bitwise equal
    # (tests/test_layers.py), 0.7-1.2 us less a call, 17-18% fewer ops dispatched from
    # Python in a decode or k = 4 step of the built-in pair (scripts/profile_step.py). On a
    # GPU it may run a fused kernel with other roundings: the ops written out there.
    on_cpu = x.device.type == "cpu"
    if x.dtype == torch.float32:  # the same float32 products, without .float() / .to()
        if on_cpu and weight.shape == x.shape[-1:]:
            return F.rms_norm(x, x.shape[-1:], weight, eps)
        if on_cpu:  # (an EAGLE-3 head's [n, 2, H] input: two norms' [2, H] weights)
            return F.rms_norm(x, x.shape[-1:], eps=eps).mul_(weight)
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))).mul_(weight)
    if on_cpu:
        x32 = F.rms_norm(x.float(), x.shape[-1:], eps=eps)
    else:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [num_tokens, hidden_size] -> (rms_norm(residual + x), residual + x): the
    residual add and the norm that follows it, as the eager forward runs them (reference of
    backends/triton_kernels/fused_norm.py)."""
    hidden = residual + x
    return rms_norm(hidden, weight, eps), hidden


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, the statistics in float32 (``rms_norm``)."""

    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden_size] -> same shape and dtype."""
        return rms_norm(x, self.weight, self.eps)


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
    note_aliases(weight, [p.weight for p in parts])  # a write through a part re-packs it
    return weight, bias


def fused_linear(x: torch.Tensor, parts: tuple[nn.Linear, ...]) -> torch.Tensor:
    """x [num_tokens, in_features] -> [num_tokens, sum(out_features)]: every part's output,
    side by side, from one matmul."""
    return F.linear(x, *fused_linear_weights(parts))


# A projection as the functional forms take it: (weight, bias) of a plain nn.Linear, or the
# forward of any other module (a row-parallel linear that all-reduces its output).
Linear = Union[tuple[torch.Tensor, Union[torch.Tensor, None]], Callable[[torch.Tensor],
                                                                        torch.Tensor]]


def project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A plain nn.Linear through ``run_linear`` (the lm_heads, EAGLE's fc), any other module
    (a tensor-parallel lm_head) through its forward. x [n, in] -> [n, out]."""
    if type(module) is nn.Linear:
        return run_linear(x, module.weight, module.bias)
    return module(x)


def in_dtype_of(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """``x`` in the dtype of ``module``'s weight, where they differ: a head computing in
    another dtype than the target whose embedding or lm_head it shares
    (``SpeculativeConfig.draft_dtype``). No op where they agree (or the module has none)."""
    weight = getattr(module, "weight", None)
    return x if weight is None or weight.dtype == x.dtype else x.to(weight.dtype)


def linear_of(module: nn.Module) -> Linear:
    return (module.weight, module.bias) if type(module) is nn.Linear else module.forward


def apply_linear(x: torch.Tensor, linear: Linear) -> torch.Tensor:
    """x [num_tokens, in_features] -> [num_tokens, out_features] (a plain weight through
    ``run_linear``: on the CPU, the matmul form its shape runs fastest as)."""
    return run_linear(x, linear[0], linear[1]) if type(linear) is tuple else linear(x)


class MlpWeights(NamedTuple):
    gate_up: tuple[torch.Tensor, torch.Tensor | None]  # fused [2 * intermediate, hidden]
    down: Linear
    intermediate_size: int


def silu_mul_reference(gate_up: torch.Tensor, size: int) -> torch.Tensor:
    """gate_up [num_tokens, 2 * size] -> silu(gate) * up [num_tokens, size] (reference of
    backends/triton_kernels/silu_mul.py)."""
    # two slices: Tensor.split runs Python in torch/_tensor.py
    return F.silu(gate_up[..., :size]).mul_(gate_up[..., size:])


def gated_mlp_forward(w: MlpWeights, x: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, hidden_size] -> [num_tokens, hidden_size]: down(silu(gate) * up)."""
    gate_up = run_linear(x, *w.gate_up)  # [num_tokens, 2 * intermediate]
    size = w.intermediate_size  # as silu_mul_reference, inline (one call fewer per layer)
    return apply_linear(F.silu(gate_up[..., :size]).mul_(gate_up[..., size:]), w.down)


class AttentionWeights(NamedTuple):
    qkv: tuple[torch.Tensor, torch.Tensor | None]  # fused [(Hq + 2 Hk) * head_dim, input_size]
    o: Linear
    num_heads: int
    num_kv_heads: int
    head_dim: int
    impl: AttentionImpl  # the backend's per-layer attention


def qkv_rope(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None,
             qkv: tuple[torch.Tensor, torch.Tensor | None], cos: torch.Tensor,
             sin_signed: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dense half before attention: x [n, input_size] (RMS-normed first when ``norm``
    (weight, eps) is given) -> q [n, Hq, D], k [n, Hk, D] (rotated together), v [n, Hk, D]
    (strided views). Tensors and ints only, so one compiled graph serves every layer."""
    if norm is not None:
        x = rms_norm(x, *norm)
    num_tokens = x.shape[0]
    qkv_out = run_linear(x, *qkv, contiguous_rows=True).view(
        num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    qk = apply_rotary_tables(qkv_out[:, :num_heads + num_kv_heads], RopeTables(cos, sin_signed))
    return qk[:, :num_heads], qk[:, num_heads:], qkv_out[:, num_heads + num_kv_heads:]


def rope_kv_write_reference(qkv: torch.Tensor, rope: RopeTables, num_heads: int,
                            cache: LayerKVCache, slot_mapping: torch.Tensor) -> torch.Tensor:
    """qkv [num_tokens, num_heads + 2 * num_kv_heads, head_dim] -> q [num_tokens, num_heads,
    head_dim] rotated; rotated k and v written to ``cache`` at slot_mapping [num_slots]
    (slots < 0 skipped): what ``qkv_rope`` and a backend's KV write do, in one function
    (reference of backends/triton_kernels/rope_kv_write.py)."""
    num_kv_heads = (qkv.shape[1] - num_heads) // 2
    qk = apply_rotary_tables(qkv[:, :num_heads + num_kv_heads], rope)
    write_kv_reference(qk[:, num_heads:], qkv[:, num_heads + num_kv_heads:], cache,
                       slot_mapping)
    return qk[:, :num_heads]


def attention_forward(w: AttentionWeights, x: torch.Tensor, rope: RopeTables,
                      kv_cache: LayerKVCache, attn_metadata) -> torch.Tensor:
    """x [num_tokens, input_size] -> [num_tokens, hidden_size]: q/k/v in one matmul, q and k
    rotated together, the backend's paged attention (writes this layer's K/V), o_proj."""
    q, k, v = qkv_rope(x, None, w.qkv, rope.cos, rope.sin_signed, w.num_heads, w.num_kv_heads,
                       w.head_dim)
    out = w.impl.forward(q, k, v, kv_cache, attn_metadata)  # [num_tokens, Hq, head_dim]
    return apply_linear(out.reshape(x.shape[0], w.num_heads * w.head_dim), w.o)


def block_tail(residual: torch.Tensor, attn_out: torch.Tensor, o: Linear,
               post_norm: tuple[torch.Tensor, float], mlp: MlpWeights) -> torch.Tensor:
    """The dense half after attention: residual [n, H], attn_out [n, Hq * D] ->
    ``h = residual + o(attn_out); h + mlp(post_norm(h))`` [n, H]."""
    hidden = residual + apply_linear(attn_out, o)
    return hidden + gated_mlp_forward(mlp, rms_norm(hidden, *post_norm))


class BlockRegions(NamedTuple):
    """The two dense halves of a block around the attention kernel: the functions above, or
    the same functions compiled (models/compiled_regions.py)."""

    qkv_rope: Callable
    tail: Callable


EAGER_REGIONS = BlockRegions(qkv_rope, block_tail)


class BlockWeights(NamedTuple):
    """One pre-norm attention + gated-MLP block (a decoder layer, an EAGLE layer)."""

    input_norm: tuple[torch.Tensor, float] | None  # (weight, eps); None: no input norm
    attn: AttentionWeights
    post_norm: tuple[torch.Tensor, float]
    mlp: MlpWeights


def block_forward(w: BlockWeights, attn_input: torch.Tensor, residual: torch.Tensor,
                  rope: RopeTables, kv_cache: LayerKVCache, attn_metadata,
                  regions: BlockRegions = EAGER_REGIONS,
                  input_norm: tuple[torch.Tensor, float] | None = None,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """attn_input [n, input_size] (normed by ``input_norm`` first when given), residual
    [n, H] -> [n, H]: ``h = residual + attn(attn_input); h + mlp(post_norm(h))``.

    ``rows`` [m] (a last layer whose outputs are read at a few tokens only, as a draft
    head's first forward: its K/V are written for all n tokens, the attention output, o_proj
    and MLP run for those rows alone) -> [m, H], row for row what [n, H] holds there."""
    a = w.attn
    q, k, v = regions.qkv_rope(attn_input, input_norm, a.qkv, rope.cos, rope.sin_signed,
                               a.num_heads, a.num_kv_heads, a.head_dim)
    out = a.impl.forward(q, k, v, kv_cache, attn_metadata)  # [n, Hq, head_dim]
    out = out.reshape(out.shape[0], a.num_heads * a.head_dim)
    if rows is not None:
        out, residual = out[rows], residual[rows]
    return regions.tail(residual, out, a.o, w.post_norm, w.mlp)


def decoder_forward(w: BlockWeights, hidden: torch.Tensor, rope: RopeTables,
                    kv_cache: LayerKVCache, attn_metadata,
                    regions: BlockRegions = EAGER_REGIONS,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [n, H] -> [n, H] (``rows``: [m, H], ``block_forward``), the pre-norm residual
    decoder layer (the input norm skipped when ``w.input_norm`` is None, as EAGLE-1's first
    layer)."""
    return block_forward(w, hidden, hidden, rope, kv_cache, attn_metadata, regions,
                         w.input_norm, rows)


def block_weights(input_norm: "RMSNorm | None", attn: "Attention",
                  post_norm: "RMSNorm", mlp: "GatedMLP") -> BlockWeights:
    return BlockWeights(None if input_norm is None else (input_norm.weight, input_norm.eps),
                        attn.weights(), (post_norm.weight, post_norm.eps), mlp.weights())


class DecoderBlock(nn.Module):
    """A pre-norm decoder block (target layers, EAGLE-1 head layers): subclasses build
    ``input_layernorm`` (None where the block has none: EAGLE-1's layer 0),
    ``self_attn``, ``post_attention_layernorm`` and ``mlp``; the forward is shared."""

    def block_weights(self) -> BlockWeights:
        return block_weights(self.input_layernorm, self.self_attn, self.post_attention_layernorm,
                             self.mlp)

    def forward(self, hidden: torch.Tensor, rope: RopeTables, kv_cache: LayerKVCache,
                attn_metadata) -> torch.Tensor:
        """hidden [num_tokens, hidden_size] -> [num_tokens, hidden_size] (pre-norm residual)."""
        return decoder_forward(self.block_weights(), hidden, rope, kv_cache, attn_metadata)


def layer_weights(model: nn.Module) -> list[BlockWeights]:
    """The ``BlockWeights`` of each of ``model.layers`` (a WeightCache's builder)."""
    return [layer.block_weights() for layer in model.layers]


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

    def weights(self) -> MlpWeights:
        return MlpWeights(fused_linear_weights((self.gate_proj, self.up_proj)),
                          linear_of(self.down_proj), self.gate_proj.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden_size] -> [num_tokens, hidden_size]."""
        return gated_mlp_forward(self.weights(), x)


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

    def weights(self) -> AttentionWeights:
        return AttentionWeights(fused_linear_weights((self.q_proj, self.k_proj, self.v_proj)),
                                linear_of(self.o_proj), self.num_heads, self.num_kv_heads,
                                self.head_dim, self.attn)

    def forward(self, x: torch.Tensor, rope: RopeTables, kv_cache: LayerKVCache,
                attn_metadata) -> torch.Tensor:
        """x [num_tokens, input_size], rope: the step's tables (``RotaryEmbedding.tables``)
        -> [num_tokens, hidden_size]. Writes this layer's K/V into ``kv_cache``."""
        return attention_forward(self.weights(), x, rope, kv_cache, attn_metadata)


def add_block_parts(module: nn.Module, config,  # a models.config.ModelConfig
                    attn_backend: type[AttentionBackend], **factory) -> None:
    """The Llama / Qwen2 decoder block's parts as attributes of ``module`` (so their keys sit
    directly under its prefix: a target layer's, or an MTP layer's beside its own parts)."""
    hidden = config.hidden_size
    module.input_layernorm = RMSNorm(hidden, config.rms_norm_eps, **factory)
    module.self_attn = Attention(hidden, hidden, config.num_attention_heads,
                                 config.num_key_value_heads, config.head_dim, attn_backend,
                                 qkv_bias=config.attention_bias, **factory)
    module.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps, **factory)
    module.mlp = GatedMLP(hidden, config.intermediate_size, config.mlp_bias, **factory)
