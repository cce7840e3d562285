"""SiLU-and-multiply in Triton: ``silu(gate) * up`` of the fused gate/up projection in one launch.

Reference: ``rocdraft.models.layers.silu_mul_reference``::

    gate_up [num_tokens, 2 * intermediate_size] -> silu(gate_up[:, :I]) * gate_up[:, I:]

A program handles ``BLOCK_T`` tokens x ``BLOCK_N`` columns of the output. As in torch, the
SiLU is computed in float32 and rounded to the model dtype before the product, which is
rounded again (bf16 in software, ``fused_norm._round_to_dtype_grid``).

Exactness (tests/test_triton_fused_kernels.py): the products and roundings are torch's; the
exponential is the backend's (numpy's in the interpreter, the GPU's ``exp``), so results
agree within one rounding of the model dtype (rtol 2 * finfo(dtype).eps). Bytes per call::

    num_tokens * intermediate_size * 3 * elt_bytes      (gate and up in, the product out)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocdraft.backends.triton_kernels.fused_norm import (DTYPES, ROUND_CODES,
                                                          _round_to_dtype_grid)


@triton.jit
def silu_mul_kernel(gate_up_ptr, out_ptr, gate_up_stride, out_stride, num_tokens,
                    intermediate_size, ROUND: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """Grid (cdiv(num_tokens, BLOCK_T), cdiv(intermediate_size, BLOCK_N))."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < num_tokens)[:, None] & (cols < intermediate_size)[None, :]
    gate_at = gate_up_ptr + rows[:, None] * gate_up_stride + cols[None, :]
    gate = tl.load(gate_at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_at + intermediate_size, mask=mask, other=0.0).to(tl.float32)
    silu = _round_to_dtype_grid(gate / (1.0 + tl.exp(-gate)), ROUND)
    out = _round_to_dtype_grid(silu * up, ROUND)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


INTERPRETED = not isinstance(silu_mul_kernel, triton.runtime.JITFunction)
GPU_BLOCK_N = 1024  # output columns per program on a GPU


def tile_for(num_tokens: int, intermediate_size: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_N): one token x 1024 columns per program on a GPU; in the interpreter,
    up to 16 tokens x the whole row, so a call is a few programs."""
    if INTERPRETED:
        return (min(triton.next_power_of_2(max(num_tokens, 1)), 16),
                triton.next_power_of_2(intermediate_size))
    return 1, min(GPU_BLOCK_N, triton.next_power_of_2(intermediate_size))


def check_silu_mul_args(gate_up: torch.Tensor) -> None:
    """Raise ValueError naming the first problem with the argument of ``silu_mul_triton``."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [num_tokens, 2 * intermediate_size], got "
                         f"{list(gate_up.shape)}")
    if gate_up.dtype not in DTYPES:
        raise ValueError(f"gate_up dtype {gate_up.dtype} is not one of "
                         f"{[str(d) for d in DTYPES]}")
    if gate_up.numel() and gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be contiguous in its last dim, strides "
                         f"{gate_up.stride()}")


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Checked wrapper: gate_up [num_tokens, 2 * intermediate_size] (rows may be strided) ->
    [num_tokens, intermediate_size], a new contiguous tensor of its dtype. Never reads the
    device."""
    check_silu_mul_args(gate_up)
    num_tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, size), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    block_t, block_n = tile_for(num_tokens, size)
    silu_mul_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(size, block_n))](
        gate_up, out, gate_up.stride(0), out.stride(0), num_tokens, size,
        ROUND=ROUND_CODES[gate_up.dtype], BLOCK_T=block_t, BLOCK_N=block_n)
    return out
