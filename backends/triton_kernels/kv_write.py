"""Paged KV write in Triton: scatter each new token's K/V into its cache slot.

Reference: ``rocdraft.backends.kv_cache.write_kv_reference`` (this kernel is bit-exact with it).
A program writes the key and value of ``BLOCK_T`` tokens (all heads); ``slot < 0``
(``PADDING_SLOT_ID``) is skipped; the token count is ``slot_mapping.shape[0]`` (key/value may
be longer, and may be strided views of a fused qkv tensor).

Cache addressing, for token (block b, offset o), head h, dim d, in both layouts::

    b * s_block + h * s_head + (o // OFF_SPLIT) * s_off_hi + (o % OFF_SPLIT) * s_off_lo
                             + (d // DIM_SPLIT) * s_dim_hi + (d % DIM_SPLIT) * s_dim_lo

- NHD ``[num_blocks, block_size, num_kv_heads, head_dim]``: OFF_SPLIT = DIM_SPLIT = 1;
- SPLIT_K key ``[num_blocks, num_kv_heads, head_dim // x, block_size, x]``: DIM_SPLIT = x;
- SPLIT_K value ``[num_blocks, num_kv_heads, block_size // x, head_dim, x]``: OFF_SPLIT = x.

fp8 caches store ``clamp(x / scale, -fp8_max, fp8_max).to(fp8)`` with an IEEE division and
round-to-nearest-even, exactly like torch. The bf16 and fp8 rounding is done in software
(``_round_to_*_grid``) so the final cast is exact on every backend, the interpreter included
(its own downcast does not round to nearest even). NaN inputs are not canonicalised as torch
does. Bytes moved per token:
``2 * num_kv_heads * head_dim * (input bytes + cache bytes) + slot bytes``.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rocdraft.backends.kv_cache import FP8_DTYPES, KV_LAYOUTS, NHD, LayerKVCache

INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = INPUT_DTYPES + FP8_DTYPES


@triton.jit
def _round_to_bf16_grid(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32: torch's rounding."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_fp8_grid(x, MIN_NORMAL_EXP: tl.constexpr, HAS_NEG_ZERO: tl.constexpr):
    """fp32 in [-fp8_max, fp8_max] -> the nearest e4m3 value (ties to even), still as fp32.

    The e4m3 grid spacing at |x| is ulp = 2^(max(exponent(x), MIN_NORMAL_EXP) - 3); scaling by
    a power of two is exact and ``(y + 2^23) - 2^23`` rounds y < 2^22 to the nearest even
    integer. Rounding in software makes the final cast exact on every backend (and in the
    interpreter, whose own fp8/bf16 downcast does not round to nearest even).
    """
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    magnitude = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF).to(tl.int32) - 127, MIN_NORMAL_EXP)
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - exponent + 3) << 23).to(tl.float32, bitcast=True)
    steps = (magnitude * inv_ulp + 8388608.0) - 8388608.0
    rounded = (steps * ulp).to(tl.uint32, bitcast=True)
    if HAS_NEG_ZERO:
        rounded = rounded | sign
    else:  # fnuz formats have no -0 (0x80 is NaN): a zero keeps a + sign
        rounded = tl.where(rounded == 0, rounded, rounded | sign)
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def quantize_fp8_rows(x, scale_ptr, scale_stride, head, row_valid, HAS_SCALE: tl.constexpr,
                      FP8_MAX: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
                      HAS_NEG_ZERO: tl.constexpr):
    """x [ROWS, BLOCK_D] fp32 -> fp8 grid values as write_kv_reference stores them: divided
    by the row's head scale (``HAS_SCALE``), saturated to +-FP8_MAX, rounded to nearest
    even (``_round_to_fp8_grid``)."""
    if HAS_SCALE:
        scale = tl.load(scale_ptr + head * scale_stride, mask=row_valid, other=1.0)
        x = tl.div_rn(x, scale.to(tl.float32)[:, None])
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    return _round_to_fp8_grid(x, FP8_MIN_EXP, HAS_NEG_ZERO)


@triton.jit
def _store_rows(src_ptr, src_stride_t, src_stride_h, cache_ptr, scale_ptr, scale_stride,
                token, head, block, offset, row_valid, head_dim,
                s_block, s_head, s_off_hi, s_off_lo, s_dim_hi, s_dim_lo,
                OFF_SPLIT: tl.constexpr, DIM_SPLIT: tl.constexpr, CACHE_KIND: tl.constexpr,
                HAS_SCALE: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Write rows (token, head) of key (or value) into the cache; token, head, block, offset
    and row_valid are [ROWS] vectors."""
    dims = tl.arange(0, BLOCK_D)
    mask = row_valid[:, None] & (dims[None, :] < head_dim)
    src = src_ptr + token[:, None] * src_stride_t + head[:, None] * src_stride_h + dims[None, :]
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [ROWS, BLOCK_D]
    if CACHE_KIND == 1:  # bf16
        x = _round_to_bf16_grid(x)
    if CACHE_KIND >= 2:  # fp8: 2 = e4m3fn, 3 = e4m3fnuz
        x = quantize_fp8_rows(x, scale_ptr, scale_stride, head, row_valid, HAS_SCALE, FP8_MAX,
                              FP8_MIN_EXP, CACHE_KIND == 2)
    dst = (cache_ptr + block[:, None] * s_block + head[:, None] * s_head
           + (offset[:, None] // OFF_SPLIT) * s_off_hi + (offset[:, None] % OFF_SPLIT) * s_off_lo
           + (dims[None, :] // DIM_SPLIT) * s_dim_hi + (dims[None, :] % DIM_SPLIT) * s_dim_lo)
    tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def kv_write_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr,
                    k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
                    key_stride_t, key_stride_h, value_stride_t, value_stride_h,
                    kc_s_block, kc_s_head, kc_s_off_hi, kc_s_off_lo, kc_s_dim_hi, kc_s_dim_lo,
                    vc_s_block, vc_s_head, vc_s_off_hi, vc_s_off_lo, vc_s_dim_hi, vc_s_dim_lo,
                    k_scale_stride, v_scale_stride, num_tokens, block_size, num_kv_heads,
                    head_dim, KEY_OFF_SPLIT: tl.constexpr, KEY_DIM_SPLIT: tl.constexpr,
                    VALUE_OFF_SPLIT: tl.constexpr, VALUE_DIM_SPLIT: tl.constexpr,
                    CACHE_KIND: tl.constexpr, HAS_K_SCALE: tl.constexpr, HAS_V_SCALE: tl.constexpr,
                    FP8_MAX: tl.constexpr, FP8_MIN_EXP: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (cdiv(num_tokens, BLOCK_T),): a program writes the key and value of BLOCK_T tokens,
    one row per (token, head); rows whose slot is < 0 are skipped."""
    rows = tl.arange(0, BLOCK_T * BLOCK_H)
    token = tl.program_id(0).to(tl.int64) * BLOCK_T + rows // BLOCK_H  # [ROWS]
    head = rows % BLOCK_H
    in_batch = token < num_tokens
    slot = tl.load(slot_mapping_ptr + token, mask=in_batch, other=-1).to(tl.int64)
    row_valid = (slot >= 0) & (head < num_kv_heads)
    safe_slot = tl.maximum(slot, 0)
    block = safe_slot // block_size
    offset = safe_slot % block_size
    _store_rows(key_ptr, key_stride_t, key_stride_h, key_cache_ptr, k_scale_ptr, k_scale_stride,
                token, head, block, offset, row_valid, head_dim,
                kc_s_block, kc_s_head, kc_s_off_hi, kc_s_off_lo, kc_s_dim_hi, kc_s_dim_lo,
                KEY_OFF_SPLIT, KEY_DIM_SPLIT, CACHE_KIND, HAS_K_SCALE, FP8_MAX, FP8_MIN_EXP,
                BLOCK_D)
    _store_rows(value_ptr, value_stride_t, value_stride_h, value_cache_ptr, v_scale_ptr,
                v_scale_stride, token, head, block, offset, row_valid, head_dim,
                vc_s_block, vc_s_head, vc_s_off_hi, vc_s_off_lo, vc_s_dim_hi, vc_s_dim_lo,
                VALUE_OFF_SPLIT, VALUE_DIM_SPLIT, CACHE_KIND, HAS_V_SCALE, FP8_MAX, FP8_MIN_EXP,
                BLOCK_D)


# Decoration fixed the mode at import (TRITON_INTERPRET was read then).
INTERPRETED = not isinstance(kv_write_kernel, triton.runtime.JITFunction)


def tokens_per_program(num_tokens: int, block_h: int, block_d: int) -> int:
    """BLOCK_T: on a GPU about 4096 elements per program (a fixed value per head shape, so no
    recompiles as batches change); in the interpreter, where every program costs Python
    overhead, up to 64 tokens per program."""
    if INTERPRETED:
        return min(triton.next_power_of_2(max(num_tokens, 1)), 64)
    return max(1, min(16, 4096 // (block_h * block_d)))


class CacheKind(NamedTuple):
    """How values are rounded into a cache dtype (``CACHE_KIND`` of the kernel)."""

    code: int  # 0: fp32/fp16 (plain cast), 1: bf16, 2: fp8 e4m3fn, 3: fp8 e4m3fnuz
    fp8_max: float = 0.0
    fp8_min_exp: int = 0  # exponent of the smallest normal fp8 value


def cache_kind(dtype: torch.dtype) -> CacheKind:
    if dtype == torch.bfloat16:
        return CacheKind(1)
    if dtype in FP8_DTYPES:
        finfo = torch.finfo(dtype)
        code = 2 if dtype == torch.float8_e4m3fn else 3
        return CacheKind(code, float(finfo.max), int(math.log2(finfo.smallest_normal)))
    return CacheKind(0)


class CacheAddressing(NamedTuple):
    """Strides and split factors of one cache tensor (see the module docstring)."""

    strides: tuple[int, int, int, int, int, int]  # block, head, off_hi, off_lo, dim_hi, dim_lo
    off_split: int
    dim_split: int


def cache_addressing(store: torch.Tensor, layout: str, is_value: bool) -> CacheAddressing:
    """How ``store`` (a key or value cache tensor in ``layout``) is addressed by the kernel."""
    s = store.stride()
    if layout == NHD:  # [num_blocks, block_size, num_kv_heads, head_dim]
        return CacheAddressing((s[0], s[2], s[1], 0, s[3], 0), 1, 1)
    x = store.shape[-1]
    if is_value:  # [num_blocks, num_kv_heads, block_size // x, head_dim, x]
        return CacheAddressing((s[0], s[1], s[2], s[4], s[3], 0), x, 1)
    return CacheAddressing((s[0], s[1], s[3], 0, s[2], s[4]), 1, x)  # key


def _check_scale(name: str, scale: torch.Tensor | None, num_kv_heads: int,
                 device: torch.device) -> None:
    if scale is None:
        return
    if scale.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {scale.dtype}")
    if scale.dim() != 1 or scale.shape[0] not in (1, num_kv_heads):
        raise ValueError(f"{name} must have shape [1] or [num_kv_heads={num_kv_heads}], "
                         f"got {list(scale.shape)}")
    if scale.device != device:
        raise ValueError(f"{name} is on {scale.device}, the cache on {device}")


def check_kv_write_args(key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache,
                        slot_mapping: torch.Tensor) -> None:
    """Raise ValueError naming the first problem with the arguments of ``write_kv_triton``."""
    if cache.layout not in KV_LAYOUTS:
        raise ValueError(f"unknown KV layout {cache.layout!r}; valid: {KV_LAYOUTS}")
    if cache.key.dtype != cache.value.dtype or cache.key.dtype not in CACHE_DTYPES:
        raise ValueError(f"cache dtypes key={cache.key.dtype} value={cache.value.dtype} must "
                         f"match and be one of {[str(d) for d in CACHE_DTYPES]}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be a 1-D int32/int64 tensor, got "
                         f"{slot_mapping.dtype} of shape {list(slot_mapping.shape)}")
    num_tokens = slot_mapping.shape[0]
    if cache.layout == NHD:
        num_kv_heads, head_dim = cache.key.shape[2], cache.key.shape[3]
    else:
        num_kv_heads, head_dim = cache.key.shape[1], cache.value.shape[3]
    device = cache.key.device
    for name, new in (("key", key), ("value", value)):
        if new.dim() != 3 or tuple(new.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must be [num_tokens, num_kv_heads={num_kv_heads}, "
                             f"head_dim={head_dim}], got {list(new.shape)}")
        if new.shape[0] < num_tokens:
            raise ValueError(f"{name} has {new.shape[0]} rows, fewer than the "
                             f"{num_tokens} slots of slot_mapping")
        if new.dtype not in INPUT_DTYPES:
            raise ValueError(f"{name} dtype {new.dtype} is not one of "
                             f"{[str(d) for d in INPUT_DTYPES]}")
        if new.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, strides {new.stride()}")
        if new.device != device:
            raise ValueError(f"{name} is on {new.device}, the cache on {device}")
    if slot_mapping.device != device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, the cache on {device}")
    _check_scale("k_scale", cache.k_scale, num_kv_heads, device)
    _check_scale("v_scale", cache.v_scale, num_kv_heads, device)


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache,
                    slot_mapping: torch.Tensor) -> None:
    """Checked wrapper: key/value [>= num_tokens, num_kv_heads, head_dim] (last dim
    contiguous), slot_mapping [num_tokens] -> writes ``cache`` in place. Never reads the device."""
    check_kv_write_args(key, value, cache, slot_mapping)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_addr = cache_addressing(cache.key, cache.layout, is_value=False)
    v_addr = cache_addressing(cache.value, cache.layout, is_value=True)
    kind = cache_kind(cache.key.dtype)
    k_scale, v_scale = cache.k_scale, cache.v_scale
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    block_t = tokens_per_program(num_tokens, block_h, block_d)
    kv_write_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, cache.key, cache.value,
        slot_mapping if k_scale is None else k_scale,  # unused pointer when no scale
        slot_mapping if v_scale is None else v_scale,
        slot_mapping, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *k_addr.strides, *v_addr.strides,
        0 if k_scale is None or k_scale.shape[0] == 1 else 1,
        0 if v_scale is None or v_scale.shape[0] == 1 else 1,
        num_tokens, cache.block_size, num_kv_heads, head_dim,
        KEY_OFF_SPLIT=k_addr.off_split, KEY_DIM_SPLIT=k_addr.dim_split,
        VALUE_OFF_SPLIT=v_addr.off_split, VALUE_DIM_SPLIT=v_addr.dim_split,
        CACHE_KIND=kind.code, HAS_K_SCALE=k_scale is not None,
        HAS_V_SCALE=v_scale is not None, FP8_MAX=kind.fp8_max, FP8_MIN_EXP=kind.fp8_min_exp,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d)
