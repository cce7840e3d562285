"""The target's decoder stack on GPUs, with the fused Triton kernels (issue 26, item 4).

Eager torch runs a bf16 decoder layer as 31 kernels (each RMSNorm 8: float, pow, mean, add,
rsqrt, mul, cast, weight mul; RoPE 4; the KV write; attention 2; SiLU and mul 2; two residual
adds; four matmuls); here a layer is 10::

    x, residual = add_rms_norm(delta, residual, input_norm)   # previous MLP's residual add
    qkv = x @ W_qkv                                           # [n, Hq + 2 Hk, D]
    out = attention(rope_kv_write(qkv))                       # RoPE on q/k fused with the
                                                              # KV write (TRITON_ATTN)
    h, residual = add_rms_norm(out @ W_o, residual, post_norm)
    delta = silu_mul(h @ W_gate_up) @ W_down

and the last ``delta`` is added inside the final norm. By count that is 21 launches fewer per
layer (672 per step of Llama-3.1-8B's 32 layers, of the ~1,070 the H200 profile counted);
what it saves in time is for a GPU run to show.

Dispatch is by device type: only forwards whose hidden states are on a ``FUSED_DEVICE_TYPES``
device (CUDA and ROCm: "cuda"), with eager regions (not ``compile=``) and
``ROCDRAFT_FUSED_KERNELS`` on, come here; every CPU forward runs models/layers.py's functions
unchanged, so CPU outputs and timings are what they were. A backend without
``forward_rotating`` gets q and k rotated by ``apply_rotary_tables`` and its own KV write.

What is proven where: tests/test_triton_fused_kernels.py checks each kernel against its
reference in the interpreter; tests/test_fused_layers.py runs this stack in the interpreter on
the CPU against the eager stack (logits within a float32 tolerance, greedy tokens equal);
tests/test_gpu_fused_forward.py (GPU-marked) does the same on a GPU. Only a GPU run shows the
speed and launch counts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rocdraft.backends.kv_cache import LayerKVCache
from rocdraft.models.layers import AttentionWeights, BlockWeights, Linear
from rocdraft.models.rope import RopeTables, apply_rotary_tables

FUSED_DEVICE_TYPES = ("cuda",)


def _linear(x: torch.Tensor, linear: Linear) -> torch.Tensor:
    """x [n, in] -> [n, out] as ``F.linear`` (contiguous rows for the Triton kernels; the CPU
    matmul forms of models/linear_form.py are for the eager CPU stack)."""
    return F.linear(x, linear[0], linear[1]) if type(linear) is tuple else linear(x)


def runs_fused(hidden: torch.Tensor) -> bool:
    """Whether a forward over ``hidden`` takes the fused kernels (by its device type)."""
    return hidden.device.type in FUSED_DEVICE_TYPES


def fused_attention(a: AttentionWeights, x: torch.Tensor, rope: RopeTables,
                    kv_cache: LayerKVCache, attn_metadata) -> torch.Tensor:
    """x [num_tokens, input_size] -> attention output [num_tokens, Hq * head_dim] (before
    o_proj); this layer's K/V written to ``kv_cache``."""
    num_tokens = x.shape[0]
    qkv = F.linear(x, *a.qkv).view(num_tokens, a.num_heads + 2 * a.num_kv_heads, a.head_dim)
    out = a.impl.forward_rotating(qkv, rope.cos, rope.sin_signed, kv_cache, attn_metadata)
    if out is None:  # the backend writes its own K/V: rotate here, as qkv_rope does
        qk = apply_rotary_tables(qkv[:, :a.num_heads + a.num_kv_heads], rope)
        out = a.impl.forward(qk[:, :a.num_heads], qk[:, a.num_heads:],
                             qkv[:, a.num_heads + a.num_kv_heads:], kv_cache, attn_metadata)
    return out.reshape(num_tokens, a.num_heads * a.head_dim)


def fused_stack_forward(layers: list[BlockWeights], hidden: torch.Tensor, rope: RopeTables,
                        kv_caches: list[LayerKVCache], attn_metadata,
                        aux_layer_ids: tuple[int, ...], final_norm: tuple[torch.Tensor, float]
                        ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """hidden [num_tokens, H] (the embeddings) -> (final-normed hidden [num_tokens, H], the
    residual-stream input of each of ``aux_layer_ids``), as the eager loop of
    LlamaForCausalLM.forward computes them (pre-norm layers; an input norm may be None)."""
    from rocdraft.backends.triton_kernels.fused_norm import add_rms_norm_triton
    from rocdraft.backends.triton_kernels.silu_mul import silu_mul_triton

    residual = hidden
    # The first layer has no residual add before its norm: add zeros (exact; one launch
    # instead of the eager norm's eight).
    delta = torch.zeros_like(hidden)
    captured: dict[int, torch.Tensor] = {}
    for i, w in enumerate(layers):
        if w.input_norm is None:
            residual = residual + delta
            x = residual
        else:
            x, residual = add_rms_norm_triton(delta, residual, *w.input_norm)
        if i in aux_layer_ids:
            captured[i] = residual
        attn_out = fused_attention(w.attn, x, rope, kv_caches[i], attn_metadata)
        h, residual = add_rms_norm_triton(_linear(attn_out, w.attn.o), residual,
                                          *w.post_norm)
        gate_up = F.linear(h, *w.mlp.gate_up)  # [num_tokens, 2 * intermediate]
        delta = _linear(silu_mul_triton(gate_up), w.mlp.down)
    normed, _ = add_rms_norm_triton(delta, residual, *final_norm)
    return normed, tuple(captured[i] for i in aux_layer_ids)
