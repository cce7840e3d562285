"""RoPE on q and k fused with the paged KV write, in Triton: one launch per layer instead of
eager torch's rotation (roll, two products, a sum: four kernels) plus the KV write.

Reference: ``rocdraft.models.layers.rope_kv_write_reference``: ``apply_rotary_tables`` on q
and k of the fused qkv projection, then ``backends.kv_cache.write_kv_reference`` of the
rotated k and of v.

Input is the fused projection viewed as qkv ``[num_tokens, num_heads + 2 * num_kv_heads,
head_dim]`` (q heads, then k heads, then v heads; any token and head strides, head_dim
contiguous) and the step's ``RopeTables`` rows ``cos`` / ``sin_signed`` ``[num_tokens, 1,
head_dim]`` in the model dtype. Output: the rotated q ``[num_tokens, num_heads, head_dim]``
(new, contiguous); rotated k and v go straight into the NHD cache ``[num_blocks,
block_size, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[num_slots <= num_tokens]``.
Slots < 0 (``PADDING_SLOT_ID``) and tokens past ``num_slots`` (graph padding) write nothing;
their q is still rotated.

The rotation is torch's ``swapped * sin_signed + x * cos`` with each product and the sum
rounded to the model dtype as torch rounds them (bf16 in software), so q and the cache bytes
are bit-exact with the reference in the interpreter for every dtype. Same-dtype caches store
the rotated values as they are; fp8 caches store ``clamp(x / scale, -fp8_max, fp8_max)``
rounded to nearest even (backends/triton_kernels/kv_write.py's helpers, the same bytes as
torch). The launch turns floating-point fusion off (``enable_fp_fusion=False``), so a GPU
compiler does not contract a float32 product and sum into one FMA either; 16-bit dtypes round
every step explicitly. That the GPU's bytes match too is what a GPU run of the tests shows.
Bytes per call::

    num_tokens * ((num_heads + 2 * num_kv_heads) * head_dim * elt        (qkv in)
                  + 2 * head_dim * elt                                    (cos, sin rows)
                  + num_heads * head_dim * elt                            (q out)
                  + 2 * num_kv_heads * head_dim * cache_elt + slot bytes)  (k, v to the cache)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocdraft.backends.kv_cache import FP8_DTYPES, NHD, LayerKVCache
from rocdraft.backends.triton_kernels.fused_norm import DTYPES, ROUND_CODES, _round_to_dtype_grid
from rocdraft.backends.triton_kernels.kv_write import cache_kind, quantize_fp8_rows


@triton.jit
def _rotated_rows(qkv_ptr, qkv_stride_t, qkv_stride_h, cos_ptr, cos_stride_t, sin_ptr,
                  sin_stride_t, token, head, row_valid, head_dim, ROUND: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """Rows (token, head) of qkv rotated, as fp32 values of the model dtype: [ROWS, BLOCK_D].
    ``swapped`` is torch.roll(x, head_dim // 2): column d reads d + half, or d - half."""
    dims = tl.arange(0, BLOCK_D)
    half = head_dim // 2
    partner = tl.where(dims < half, dims + half, dims - half)
    mask = row_valid[:, None] & (dims < head_dim)[None, :]
    row = qkv_ptr + token[:, None] * qkv_stride_t + head[:, None] * qkv_stride_h
    x = tl.load(row + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    swapped = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token[:, None] * cos_stride_t + dims[None, :], mask=mask,
                  other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token[:, None] * sin_stride_t + dims[None, :], mask=mask,
                  other=0.0).to(tl.float32)
    return _round_to_dtype_grid(_round_to_dtype_grid(swapped * sin, ROUND)
                                + _round_to_dtype_grid(x * cos, ROUND), ROUND)


@triton.jit
def _store_cache_rows(x, cache_ptr, scale_ptr, scale_stride, block, offset, head, row_valid,
                      head_dim, s_block, s_off, s_head, CACHE_KIND: tl.constexpr,
                      HAS_SCALE: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """x [ROWS, BLOCK_D] fp32 (values of the model dtype) -> NHD cache rows; fp8 caches
    quantised as write_kv_reference does (divide by the scale, saturate, nearest even)."""
    dims = tl.arange(0, BLOCK_D)
    mask = row_valid[:, None] & (dims < head_dim)[None, :]
    if CACHE_KIND >= 2:  # fp8: 2 = e4m3fn, 3 = e4m3fnuz
        x = quantize_fp8_rows(x, scale_ptr, scale_stride, head, row_valid, HAS_SCALE, FP8_MAX,
                              FP8_MIN_EXP, CACHE_KIND == 2)
    dst = (cache_ptr + block[:, None] * s_block + offset[:, None] * s_off
           + head[:, None] * s_head + dims[None, :])
    tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kv_write_kernel(qkv_ptr, cos_ptr, sin_ptr, q_out_ptr, key_cache_ptr, value_cache_ptr,
                         k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
                         qkv_stride_t, qkv_stride_h, cos_stride_t, sin_stride_t,
                         q_out_stride_t, q_out_stride_h,
                         kc_s_block, kc_s_off, kc_s_head, vc_s_block, vc_s_off, vc_s_head,
                         k_scale_stride, v_scale_stride, num_tokens, num_slots, block_size,
                         num_heads, num_kv_heads, head_dim,
                         ROUND: tl.constexpr, CACHE_KIND: tl.constexpr,
                         HAS_K_SCALE: tl.constexpr, HAS_V_SCALE: tl.constexpr,
                         FP8_MAX: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr,
                         BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (cdiv(num_tokens, BLOCK_T),): a program rotates the q heads of BLOCK_T tokens,
    then rotates their k heads and writes k and v to the cache (rows (token, head))."""
    first = tl.program_id(0).to(tl.int64) * BLOCK_T
    dims = tl.arange(0, BLOCK_D)

    q_rows = tl.arange(0, BLOCK_T * BLOCK_HQ)
    token = first + q_rows // BLOCK_HQ
    head = q_rows % BLOCK_HQ
    q_valid = (token < num_tokens) & (head < num_heads)
    q = _rotated_rows(qkv_ptr, qkv_stride_t, qkv_stride_h, cos_ptr, cos_stride_t, sin_ptr,
                      sin_stride_t, token, head, q_valid, head_dim, ROUND, BLOCK_D)
    tl.store(q_out_ptr + token[:, None] * q_out_stride_t + head[:, None] * q_out_stride_h
             + dims[None, :], q.to(q_out_ptr.dtype.element_ty),
             mask=q_valid[:, None] & (dims < head_dim)[None, :])

    kv_rows = tl.arange(0, BLOCK_T * BLOCK_HK)
    token = first + kv_rows // BLOCK_HK
    kv_head = kv_rows % BLOCK_HK
    in_slots = token < num_slots
    slot = tl.load(slot_mapping_ptr + token, mask=in_slots, other=-1).to(tl.int64)
    kv_valid = (slot >= 0) & (kv_head < num_kv_heads)
    safe_slot = tl.maximum(slot, 0)
    block = safe_slot // block_size
    offset = safe_slot % block_size
    k = _rotated_rows(qkv_ptr, qkv_stride_t, qkv_stride_h, cos_ptr, cos_stride_t, sin_ptr,
                      sin_stride_t, token, num_heads + kv_head, kv_valid, head_dim, ROUND,
                      BLOCK_D)
    _store_cache_rows(k, key_cache_ptr, k_scale_ptr, k_scale_stride, block, offset, kv_head,
                      kv_valid, head_dim, kc_s_block, kc_s_off, kc_s_head, CACHE_KIND,
                      HAS_K_SCALE, FP8_MAX, FP8_MIN_EXP, BLOCK_D)
    v_mask = kv_valid[:, None] & (dims < head_dim)[None, :]
    v = tl.load(qkv_ptr + token[:, None] * qkv_stride_t
                + (num_heads + num_kv_heads + kv_head)[:, None] * qkv_stride_h + dims[None, :],
                mask=v_mask, other=0.0).to(tl.float32)
    _store_cache_rows(v, value_cache_ptr, v_scale_ptr, v_scale_stride, block, offset, kv_head,
                      kv_valid, head_dim, vc_s_block, vc_s_off, vc_s_head, CACHE_KIND,
                      HAS_V_SCALE, FP8_MAX, FP8_MIN_EXP, BLOCK_D)


INTERPRETED = not isinstance(rope_kv_write_kernel, triton.runtime.JITFunction)


def tokens_per_program(num_tokens: int) -> int:
    """BLOCK_T: one token per program on a GPU (all its heads: 32 x 128 q elements for an
    8B model); in the interpreter up to 16 tokens per program."""
    if INTERPRETED:
        return min(triton.next_power_of_2(max(num_tokens, 1)), 16)
    return 1


def check_rope_kv_write_args(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                             num_heads: int, cache: LayerKVCache,
                             slot_mapping: torch.Tensor) -> None:
    """Raise ValueError naming the first problem with the arguments of ``rope_kv_write_triton``."""
    if cache.layout != NHD:
        raise ValueError(f"rope_kv_write writes the NHD layout, got {cache.layout!r}")
    if cache.key.dim() != 4 or cache.value.shape != cache.key.shape:
        raise ValueError(f"NHD caches must both be [num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got {list(cache.key.shape)} and {list(cache.value.shape)}")
    num_kv_heads, head_dim = cache.key.shape[2], cache.key.shape[3]
    if qkv.dim() != 3 or tuple(qkv.shape[1:]) != (num_heads + 2 * num_kv_heads, head_dim):
        raise ValueError(f"qkv must be [num_tokens, num_heads + 2 * num_kv_heads = "
                         f"{num_heads + 2 * num_kv_heads}, head_dim = {head_dim}], got "
                         f"{list(qkv.shape)}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    if qkv.dtype not in DTYPES:
        raise ValueError(f"qkv dtype {qkv.dtype} is not one of {[str(d) for d in DTYPES]}")
    if cache.key.dtype != cache.value.dtype or cache.key.dtype not in (qkv.dtype, *FP8_DTYPES):
        raise ValueError(f"cache dtypes ({cache.key.dtype}, {cache.value.dtype}) must both be "
                         f"the qkv dtype {qkv.dtype} or an fp8 type")
    num_tokens, device = qkv.shape[0], qkv.device
    for name, table in (("cos", cos), ("sin_signed", sin_signed)):
        if tuple(table.shape) != (num_tokens, 1, head_dim) or table.dtype != qkv.dtype:
            raise ValueError(f"{name} must be {qkv.dtype} [num_tokens={num_tokens}, 1, "
                             f"head_dim={head_dim}], got {table.dtype} {list(table.shape)}")
        if table.numel() and table.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, strides "
                             f"{table.stride()}")
    if qkv.numel() and qkv.stride(2) != 1:
        raise ValueError(f"qkv must be contiguous in its last dim, strides {qkv.stride()}")
    if not (cache.key.is_contiguous() and cache.value.is_contiguous()):
        raise ValueError("key and value caches must be contiguous")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be a 1-D int32/int64 tensor, got "
                         f"{slot_mapping.dtype} of shape {list(slot_mapping.shape)}")
    if slot_mapping.shape[0] > num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {num_tokens} "
                         f"tokens of qkv")
    for name, t in (("cos", cos), ("sin_signed", sin_signed), ("key cache", cache.key),
                    ("value cache", cache.value), ("slot_mapping", slot_mapping)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, qkv on {device}")
    for name, scale in (("k_scale", cache.k_scale), ("v_scale", cache.v_scale)):
        if scale is None:
            continue
        if scale.dtype != torch.float32 or scale.dim() != 1 \
                or scale.shape[0] not in (1, num_kv_heads) or scale.device != device:
            raise ValueError(f"{name} must be float32 [1] or [num_kv_heads={num_kv_heads}] on "
                             f"{device}, got {scale.dtype} {list(scale.shape)} on "
                             f"{scale.device}")


def rope_kv_write_triton(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                         num_heads: int, cache: LayerKVCache,
                         slot_mapping: torch.Tensor) -> torch.Tensor:
    """Checked wrapper: qkv [num_tokens, num_heads + 2 * num_kv_heads, head_dim], cos /
    sin_signed [num_tokens, 1, head_dim] (``RopeTables``), slot_mapping [num_slots <=
    num_tokens] -> q [num_tokens, num_heads, head_dim] rotated (new, contiguous); rotated k
    and v written into ``cache`` in place. Never reads the device."""
    check_rope_kv_write_args(qkv, cos, sin_signed, num_heads, cache, slot_mapping)
    num_tokens, _, head_dim = qkv.shape
    num_kv_heads = cache.key.shape[2]
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    is_fp8 = cache.key.dtype in FP8_DTYPES
    kind = cache_kind(cache.key.dtype) if is_fp8 else cache_kind(torch.float32)  # plain store
    k_scale = cache.k_scale if is_fp8 else None  # scales only apply to fp8 caches
    v_scale = cache.v_scale if is_fp8 else None
    block_t = tokens_per_program(num_tokens)
    kc, vc = cache.key.stride(), cache.value.stride()
    rope_kv_write_kernel[(triton.cdiv(num_tokens, block_t),)](
        qkv, cos, sin_signed, q, cache.key, cache.value,
        slot_mapping if k_scale is None else k_scale,  # unused pointer when no scale
        slot_mapping if v_scale is None else v_scale, slot_mapping,
        qkv.stride(0), qkv.stride(1), cos.stride(0), sin_signed.stride(0),
        q.stride(0), q.stride(1), kc[0], kc[1], kc[2], vc[0], vc[1], vc[2],
        0 if k_scale is None or k_scale.shape[0] == 1 else 1,
        0 if v_scale is None or v_scale.shape[0] == 1 else 1,
        num_tokens, slot_mapping.shape[0], cache.block_size, num_heads, num_kv_heads, head_dim,
        ROUND=ROUND_CODES[qkv.dtype], CACHE_KIND=kind.code, HAS_K_SCALE=k_scale is not None,
        HAS_V_SCALE=v_scale is not None, FP8_MAX=kind.fp8_max, FP8_MIN_EXP=kind.fp8_min_exp,
        BLOCK_T=block_t, BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        enable_fp_fusion=False)  # torch's separate product and sum, never one FMA
    return q
