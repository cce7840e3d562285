"""RMSNorm fused with the residual add, in Triton: one launch instead of eager torch's six.

Reference: ``rocdraft.models.layers.add_rms_norm_reference``::

    residual_out = residual + x                                  # [num_tokens, hidden_size]
    out = weight * residual_out / sqrt(mean(residual_out^2) + eps)   # statistics in float32

A program normalises ``BLOCK_T`` rows, each whole (``BLOCK_H >= hidden_size``): it reads x,
residual and weight once and writes ``out`` and ``residual_out``. Every intermediate torch
rounds to the model dtype (the sum, the normalised row, the product with the weight) is
rounded here too, in software for bf16 (``_round_to_bf16_grid``, round-to-nearest-even like
torch; the interpreter's own bf16 downcast truncates).

Exactness (tests/test_triton_fused_kernels.py): ``residual_out`` is bit-exact; ``out`` differs
from torch only through the order of the sum of squares and the square root (torch's rsqrt
against an IEEE sqrt and division here), within one rounding of the model dtype
(rtol 2 * finfo(dtype).eps). Bytes per call::

    num_tokens * hidden_size * 4 * elt_bytes + hidden_size * elt_bytes   (x, residual in;
                                                                          out, residual_out)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocdraft.backends.triton_kernels.kv_write import _round_to_bf16_grid

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROUND_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _round_to_dtype_grid(x, ROUND: tl.constexpr):
    """fp32 -> the nearest value of the model dtype (0: fp32 as is, 1: bf16, 2: fp16), as fp32."""
    if ROUND == 1:
        x = _round_to_bf16_grid(x)
    if ROUND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                        x_stride, residual_stride, out_stride, residual_out_stride,
                        num_tokens, hidden_size, eps,
                        ROUND: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """Grid (cdiv(num_tokens, BLOCK_T),): rows [BLOCK_T] x columns [BLOCK_H]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    col_valid = cols < hidden_size
    mask = (rows < num_tokens)[:, None] & col_valid[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    residual = tl.load(residual_ptr + rows[:, None] * residual_stride + cols[None, :],
                       mask=mask, other=0.0)
    hidden = _round_to_dtype_grid(x.to(tl.float32) + residual.to(tl.float32), ROUND)
    tl.store(residual_out_ptr + rows[:, None] * residual_out_stride + cols[None, :],
             hidden.to(residual_out_ptr.dtype.element_ty), mask=mask)
    mean_square = tl.sum(hidden * hidden, axis=1) / hidden_size  # [BLOCK_T]
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))
    weight = tl.load(weight_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)
    normed = _round_to_dtype_grid(hidden * inv_rms[:, None], ROUND)
    out = _round_to_dtype_grid(normed * weight[None, :], ROUND)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


# Decoration fixed the mode at import (TRITON_INTERPRET was read then).
INTERPRETED = not isinstance(add_rms_norm_kernel, triton.runtime.JITFunction)


def rows_per_program(num_tokens: int, block_h: int) -> int:
    """BLOCK_T: one row per program on a GPU (a row of 4096 is 8 warps of work); in the
    interpreter, where each program costs Python overhead, up to 16 rows."""
    if INTERPRETED:
        return min(triton.next_power_of_2(max(num_tokens, 1)), 16)
    return 1


def num_warps_for(block_elements: int) -> int:
    """4 warps up to 2048 elements per program, 8 beyond (GPU launch option)."""
    return 4 if block_elements <= 2048 else 8


def check_add_rms_norm_args(x: torch.Tensor, residual: torch.Tensor,
                            weight: torch.Tensor) -> None:
    """Raise ValueError naming the first problem with the arguments of ``add_rms_norm_triton``."""
    if x.dim() != 2 or residual.shape != x.shape:
        raise ValueError(f"x and residual must both be [num_tokens, hidden_size], got "
                         f"{list(x.shape)} and {list(residual.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight must be [hidden_size={x.shape[1]}], got {list(weight.shape)}")
    if x.dtype not in DTYPES or residual.dtype != x.dtype or weight.dtype != x.dtype:
        raise ValueError(f"x, residual and weight must share one dtype of "
                         f"{[str(d) for d in DTYPES]}, got {x.dtype}, {residual.dtype}, "
                         f"{weight.dtype}")
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, strides {t.stride()}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked wrapper: x, residual [num_tokens, hidden_size] (rows may be strided), weight
    [hidden_size] -> (out, residual_out), new contiguous tensors like x. Never reads the
    device."""
    check_add_rms_norm_args(x, residual, weight)
    num_tokens, hidden_size = x.shape
    out = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out)
    if num_tokens == 0:
        return out, residual_out
    block_h = triton.next_power_of_2(hidden_size)
    block_t = rows_per_program(num_tokens, block_h)
    add_rms_norm_kernel[(triton.cdiv(num_tokens, block_t),)](
        x, residual, weight, out, residual_out, x.stride(0), residual.stride(0),
        out.stride(0), residual_out.stride(0), num_tokens, hidden_size, eps,
        ROUND=ROUND_CODES[x.dtype], BLOCK_T=block_t, BLOCK_H=block_h,
        num_warps=num_warps_for(block_t * block_h))
    return out, residual_out
