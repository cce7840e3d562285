"""TEST-ONLY emulation of the aiter calls ROCM_AITER_FA makes. Not aiter; no hardware.

Follows the REAL sources of amd-aiter 0.1.7.post2.dev18 (the wheel on the package index):
aiter/ops/mha.py (``flash_attn_varlen_func`` -> ``_flash_attn_varlen_forward``, which picks
``fmha_v3_varlen_fwd`` or the CK ``mha_varlen_fwd``), csrc/py_itfs_cu/asm_mha_varlen_fwd.cu
(the v3 argument builder), aiter/ops/attention.py (``paged_attention_v1``, ``pa_fwd_asm``),
csrc/py_itfs_cu/asm_pa.cu with hsa/gfx942/pa/pa_asm.csv (the asm kernel lookup),
csrc/cpp_itfs/pa/pa_kernels.cuh (the v1 kernel's compile-time shape rules), aiter/ops/cache.py
with csrc/kernels/cache_kernels.cu (the cache writes). Signatures equal the real ones
(tests/vendor_emulation/real_signatures.py). Arguments the adapters do not use (alibi, bias,
soft-cap, sliding window, dropout, padded cu_seqlens, fp8 output, lse) must keep their neutral
values, else ``VendorContractError``. The emulated device is a gfx942 (MI300).
"""
from __future__ import annotations

import math

import torch

from . import (FP8_DTYPES, VendorContractError, attend, check_cu_seqlens, check_gqa,
               check_half, check_int32, check_last_dim_contiguous, check_max_seqlen,
               dequantize, make_module, read_pages, require, uninitialized_like)

API = ("flash_attn_varlen_func", "paged_attention_v1", "pa_fwd_asm", "reshape_and_cache_flash",
       "reshape_and_cache")
EMULATED_GFX = "gfx942"
VARLEN_PAGE_MULTIPLE = 128  # asm_mha_varlen_fwd.cu / mha_varlen_fwd: "divisible by 128"
CK_MAX_HEAD_DIM = 256  # "CK only supports head dimension at most 256"

# hsa/gfx942/pa/pa_asm.csv, every row as (qType, kvType, Gqa, Mtp, Msk, Hp, blkSz).
PA_ASM_CSV_GFX942 = (
    ("bf16", "fp8", 16, 0, 0, 0, 16), ("bf16", "int8", 16, 0, 0, 0, 16),
    ("bf16", "bf16", 16, 0, 0, 0, 16), ("bf16", "bf16", 8, 0, 0, 0, 16),
    ("fp16", "fp8", 8, 1, 1, 0, 16), ("fp16", "fp16", 8, 1, 0, 0, 16),
    ("bf16", "int8", 8, 0, 0, 0, 16), ("bf16", "fp8", 8, 0, 0, 0, 16),
    ("fp16", "fp8", 8, 0, 0, 1, 16), ("bf16", "fp8", 8, 1, 1, 0, 16),
    ("bf16", "fp8", 8, 0, 0, 2, 16), ("bf16", "bf16", 8, 1, 0, 0, 16),
    ("fp16", "int8", 8, 0, 0, 0, 16), ("bf16", "fp8", 8, 0, 0, 1, 16),
    ("fp16", "fp16", 8, 1, 1, 0, 16), ("fp16", "int8", 8, 1, 1, 0, 16),
    ("bf16", "bf16", 8, 1, 1, 0, 16), ("bf16", "fp8", 16, 1, 1, 0, 16),
    ("bf16", "int8", 8, 1, 1, 0, 16), ("bf16", "int8", 16, 1, 1, 0, 16),
    ("fp16", "fp16", 8, 0, 0, 0, 16), ("fp16", "fp8", 16, 0, 0, 0, 16),
    ("fp16", "fp8", 8, 1, 0, 0, 16), ("fp16", "int8", 16, 0, 0, 0, 16),
    ("fp16", "int8", 16, 1, 0, 0, 16), ("bf16", "fp8", 8, 1, 0, 0, 16),
    ("fp16", "fp16", 16, 0, 0, 0, 16), ("fp16", "fp8", 8, 0, 0, 2, 16),
    ("bf16", "int8", 8, 1, 0, 0, 16), ("bf16", "int8", 16, 1, 0, 0, 16),
    ("fp16", "int8", 16, 1, 1, 0, 16), ("fp16", "fp8", 16, 1, 0, 0, 16),
    ("fp16", "fp8", 16, 1, 1, 0, 16), ("bf16", "fp8", 16, 1, 0, 0, 16),
    ("fp16", "fp8", 8, 0, 0, 0, 16), ("fp16", "int8", 8, 1, 0, 0, 16),
    ("bf16", "fp8", 10, 0, 0, 0, 1024), ("bf16", "fp8", 10, 12, 1, 0, 1024),
    ("bf16", "fp8", 10, 13, 1, 0, 1024), ("bf16", "fp8", 10, 14, 1, 0, 1024),
)
_TYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def quantize_reciprocal(x: torch.Tensor, dtype: torch.dtype,
                        scale: torch.Tensor | None) -> torch.Tensor:
    """aiter's cache-write rounding (cache_kernels.cu): ``inverted_kscale = 1 / (*k_scale)``
    in float32, then ``type_convert<cache_t>(float(x) * inverted_kscale)`` (ck_tile's fp8
    conversion rounds to nearest even and saturates: ``clip = true`` in float8.hpp)."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    finfo = torch.finfo(dtype)
    inverse = 1.0 if scale is None else torch.reciprocal(scale.float().reshape(1, -1, 1))
    return (x.float() * inverse).clamp(finfo.min, finfo.max).to(dtype)


def uses_fmha_v3(q, v, dropout_p, window_size, max_seqlen_k, bias, alibi_slopes,
                 cu_seqlens_q_padded, cu_seqlens_k_padded) -> bool:
    """``can_impl_fmha_v3_fwd`` of ``_flash_attn_varlen_forward`` (aiter/ops/mha.py:1903),
    on the emulated gfx942."""
    left, right = window_size
    left = -1 if left >= max_seqlen_k else left
    right = -1 if right >= max_seqlen_k else right
    hdim_q, hdim_v = q.shape[-1], v.shape[-1]
    return (alibi_slopes is None and bias is None and dropout_p == 0.0 and hdim_v == 128
            and (hdim_q == 128 or (EMULATED_GFX == "gfx950" and hdim_q == 192))
            and q.shape[1] % v.shape[-2] == 0 and not (left > 0 or right > 0)
            and q.dtype == torch.bfloat16
            and cu_seqlens_q_padded is None and cu_seqlens_k_padded is None)


def _v3_rows(t: torch.Tensor) -> torch.Tensor:
    """What the v3 kernel reads for k/v: ``get_asm_mha_varlen_fwd_args`` passes no block
    table, only ``stride_k = k.stride(0)`` and ``nhead_stride_k = k.stride(1)``, with row r of
    the packed sequence at ``r * stride(0)``. For a paged cache [num_blocks, page, Hk, D] row r
    is page r (head h reading that page's token h): rows [num_blocks, Hk, D]."""
    return t.as_strided((t.shape[0], t.shape[-2], t.shape[-1]),
                        (t.stride(0), t.stride(1), t.stride(-1)))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           min_seqlen_q=0, dropout_p=0.0, softmax_scale=None,
                           logits_soft_cap=0.0, causal=False, window_size=(-1, -1), bias=None,
                           alibi_slopes=None, deterministic=False, return_lse=False,
                           return_attn_probs=False, how_v3_bf16_cvt=1, block_table=None,
                           out=None, cu_seqlens_q_padded=None, cu_seqlens_k_padded=None):
    """q [total_q, Hq, D]; k/v [total_k, Hk, D], or [num_blocks, page, Hk, D] with block_table
    (page a multiple of 128); int32 cu_seqlens; causal bottom-right; GQA.

    Dispatch as in the real ``_flash_attn_varlen_forward``: bf16 with head_dim 128 (no alibi,
    bias, dropout or window) runs ``fmha_v3_varlen_fwd``, which validates ``block_table`` and
    then ignores it (see ``_v3_rows``); everything else runs the CK ``mha_varlen_fwd``, whose
    ``compile_ops`` wrapper first calls ``cmdGenFunc_mha_varlen_fwd``: with a block_table that
    function reads ``filter_fwd`` before assigning it (UnboundLocalError), so the paged CK path
    never runs in this aiter version."""
    require(min_seqlen_q == 0 and dropout_p == 0.0 and logits_soft_cap == 0.0
            and tuple(window_size)[:2] == (-1, -1) and bias is None and alibi_slopes is None
            and not return_lse and not return_attn_probs and cu_seqlens_q_padded is None
            and cu_seqlens_k_padded is None and how_v3_bf16_cvt in (0, 1, 2),
            "emulation covers min_seqlen_q 0, dropout 0, no soft-cap/window/bias/alibi/lse/"
            "attn probs/padded cu_seqlens")
    require(q.dim() == 3, f"q must be [total_q, Hq, D], got shape {tuple(q.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_half(name, t)
        check_last_dim_contiguous(name, t)
    require(k.dtype == q.dtype and v.dtype == q.dtype,
            f"q/k/v dtypes must match, got {q.dtype}/{k.dtype}/{v.dtype}")
    cu_q, cu_k = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q), check_cu_seqlens(
        "cu_seqlens_k", cu_seqlens_k)
    require(len(cu_q) == len(cu_k), f"cu_seqlens_q/_k batch sizes differ: {cu_q} vs {cu_k}")
    require(cu_q[-1] <= q.shape[0], f"cu_seqlens_q[-1]={cu_q[-1]} > total_q={q.shape[0]}")
    lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    check_max_seqlen("max_seqlen_q", max_seqlen_q, lens_q)
    check_max_seqlen("max_seqlen_k", max_seqlen_k, lens_k)
    num_kv_heads, head_dim = k.shape[-2], k.shape[-1]
    require(head_dim == q.shape[2] and v.shape == k.shape, "q/k/v head dims or k/v shapes differ")
    require(head_dim <= CK_MAX_HEAD_DIM,
            f"CK only supports head dimension at most {CK_MAX_HEAD_DIM}, got {head_dim}")
    check_gqa(q.shape[1], num_kv_heads)
    if block_table is None:
        require(k.dim() == 3, f"k must be [total_k, Hk, D] without block_table, got "
                              f"{tuple(k.shape)}")
        require(cu_k[-1] <= k.shape[0], f"cu_seqlens_k[-1]={cu_k[-1]} > total_k={k.shape[0]}")
    else:
        require(k.dim() == 4, f"k must be [num_blocks, page, Hk, D] with block_table, got "
                              f"{tuple(k.shape)}")
        require(k.shape[1] % VARLEN_PAGE_MULTIPLE == 0,
                f"paged varlen needs page_block_size a multiple of {VARLEN_PAGE_MULTIPLE}, "
                f"got {k.shape[1]}")
        check_int32("block_table", block_table, 2)
        require(block_table.shape[0] == len(lens_k), f"block_table has {block_table.shape[0]} "
                                                     f"rows for batch {len(lens_k)}")
    v3 = uses_fmha_v3(q, v, dropout_p, window_size, max_seqlen_k, bias, alibi_slopes,
                      cu_seqlens_q_padded, cu_seqlens_k_padded)
    require(v3 or block_table is None,
            "cmdGenFunc_mha_varlen_fwd: UnboundLocalError: cannot access local variable "
            "'filter_fwd' where it is not associated with a value (aiter/ops/mha.py, the "
            "block_table branch; reproduced by running that function from the wheel)")
    if v3 and block_table is not None:
        k, v = _v3_rows(k), _v3_rows(v)
        require(cu_k[-1] <= k.shape[0],
                f"fmha_v3_varlen_fwd ignores block_table and reads k/v as packed rows through "
                f"cu_seqlens_k: row {cu_k[-1] - 1} is past the {k.shape[0]} rows of the paged "
                f"cache (a memory fault on the device)")
    scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
    result = uninitialized_like(q)
    for b, lq in enumerate(lens_q):
        keys, values = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        result[cu_q[b]:cu_q[b] + lq] = attend(q[cu_q[b]:cu_q[b] + lq], keys, values, scale,
                                               causal).to(q.dtype)
    if out is not None:
        out.copy_(result)
        result = out
    return result


def check_v1_shape(head_dim: int, block_size: int, gqa_ratio: int, cache_elem_size: int):
    """The compile-time shape rules of ``_paged_attention_kernel`` (pa_kernels.cuh), which the
    kernel does not check: its integer divisions silently drop head dims or query heads.

    - ``static_assert(BLOCK_SIZE <= k_thread_per_block)`` (32) and "assumes minimum block size
      is 16": block_size 16 or 32;
    - ``VHELOOP = HEAD_SIZE / 16 / NWARPS`` (NWARPS 4): head_dim a multiple of 64;
    - ``QKHELOOP = HEAD_SIZE_PER_LOOP / QKHE_PER_FETCH`` with ``HEAD_SIZE_PER_LOOP =
      ceil(HEAD_SIZE / ceil(HEAD_SIZE / 128))`` and ``QKHE_PER_FETCH = 16 / sizeof(cache_t) * 4``;
    - ``GQA_RATIO_PER_LOOP = GQA_RATIO / ceil(GQA_RATIO / 16)``: those loops cover every head.
    """
    require(block_size in (16, 32), f"paged_attention_v1 kernel needs block size 16 or 32, "
                                    f"got {block_size}")
    per_loop = math.ceil(head_dim / math.ceil(head_dim / 128))
    require(head_dim % 64 == 0 and per_loop % (16 // cache_elem_size * 4) == 0,
            f"paged_attention_v1 kernel drops head dims for head_size {head_dim}")
    loops = math.ceil(gqa_ratio / 16)
    require(gqa_ratio % loops == 0,
            f"paged_attention_v1 kernel drops query heads for GQA ratio {gqa_ratio}")


def paged_attention_v1(out, workspace_buffer, query, key_cache, value_cache, scale, block_tables,
                       cu_query_lens, context_lens, max_context_len, alibi_slopes, kv_cache_dtype,
                       kv_cache_layout, logits_soft_cap, k_scale, v_scale, fp8_out_scale=None,
                       partition_size=256, mtp=1, sliding_window=0):
    """aiter's HIP paged DECODE kernel: exactly ``mtp`` (here 1) query tokens per sequence,
    NHD cache [num_blocks, block_size, Hk, D]; block_size must divide partition_size."""
    require(alibi_slopes is None and logits_soft_cap == 0 and fp8_out_scale is None
            and sliding_window == 0, "emulation covers no alibi/soft-cap/fp8-out/window")
    require(kv_cache_layout == "NHD", f"emulation covers kv_cache_layout 'NHD', got "
                                      f"{kv_cache_layout!r}")
    require(mtp == 1, f"emulation covers mtp=1, got {mtp}")
    check_half("query", query)
    check_half("out", out)
    require(query.dim() == 3 and out.shape == query.shape,
            f"query/out must be [num_seqs, H, D] alike, got {tuple(query.shape)} / "
            f"{tuple(out.shape)}")
    # The launcher passes q_stride = query.stride(0) only: heads and dims must be packed.
    require(query.stride(2) == 1 and query.stride(1) == query.shape[2],
            f"query heads/dims must be packed, strides {tuple(query.stride())}")
    require(key_cache.dim() == 4 and value_cache.shape == key_cache.shape,
            f"NHD caches must be [num_blocks, block_size, Hk, D], got {tuple(key_cache.shape)}")
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    require(head_dim == query.shape[2], "cache head_dim differs from the query's")
    check_gqa(query.shape[1], num_kv_heads)
    check_v1_shape(head_dim, block_size, query.shape[1] // num_kv_heads,
                   key_cache.element_size())
    require(partition_size % block_size == 0,
            f"block_size {block_size} must divide partition_size {partition_size}")
    if kv_cache_dtype == "auto":
        require(key_cache.dtype == query.dtype, f"kv_cache_dtype 'auto' needs the cache in "
                                                f"{query.dtype}, got {key_cache.dtype}")
    else:
        require(kv_cache_dtype in ("fp8", "fp8_e4m3") and key_cache.dtype in FP8_DTYPES,
                f"kv_cache_dtype {kv_cache_dtype!r} with cache dtype {key_cache.dtype}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        require(isinstance(s, torch.Tensor) and s.dtype == torch.float32 and s.numel() == 1,
                f"{name} must be a float32 tensor with one element (read by pointer)")
    check_int32("block_tables", block_tables, 2)
    num_seqs = block_tables.shape[0]
    check_int32("context_lens", context_lens, 1)
    require(context_lens.shape[0] == num_seqs, "context_lens / block_tables batch differ")
    cu = check_cu_seqlens("cu_query_lens", cu_query_lens)
    require(len(cu) == num_seqs + 1, f"cu_query_lens has {len(cu)} entries for {num_seqs} seqs")
    query_lens = [b - a for a, b in zip(cu, cu[1:])]
    require(all(n == mtp for n in query_lens),
            f"decode kernel: every sequence must have exactly {mtp} query token(s), "
            f"cu_query_lens gives {query_lens}")
    require(query.shape[0] == num_seqs * mtp,
            f"query has {query.shape[0]} rows for {num_seqs} sequences x mtp {mtp}")
    lens = context_lens.tolist()
    require(isinstance(max_context_len, int) and max(lens + [0]) <= max_context_len,
            f"max_context_len {max_context_len} < longest context {max(lens + [0])}")
    parts = math.ceil(max_context_len / partition_size)
    needed = (num_seqs * query.shape[1] * parts * head_dim * query.element_size()
              + 2 * num_seqs * query.shape[1] * parts * 4)
    require(workspace_buffer.dtype == torch.uint8 and workspace_buffer.numel() >= needed,
            f"workspace_buffer needs {needed} uint8 bytes, got {workspace_buffer.numel()} "
            f"{workspace_buffer.dtype}")
    for b, length in enumerate(lens):
        keys = dequantize(read_pages(key_cache, block_tables[b], length, block_size), k_scale)
        values = dequantize(read_pages(value_cache, block_tables[b], length, block_size),
                            v_scale)
        out[b:b + 1] = attend(query[b:b + 1], keys, values, scale, causal=True).to(out.dtype)
    return out


def pa_asm_kernel(q_dtype, kv_dtype, gqa_ratio: int, block_size: int, mtp: int = 0,
                  msk: int = 0, hp: int = 1) -> tuple:
    """``get_heuristic_kernel`` (asm_pa.cu): the first csv row matching the types, the GQA
    ratio or the ratio rounded up to a multiple of 8, mtp, mask, precision (hp 1 matches any)
    and block size; else TORCH_CHECK "cannot get heuristic kernel!"."""
    q_type, kv_type = _TYPE_NAMES.get(q_dtype), _TYPE_NAMES.get(kv_dtype)
    for gqa in (gqa_ratio, (gqa_ratio + 7) // 8 * 8):
        for row in PA_ASM_CSV_GFX942:
            if row[:5] == (q_type, kv_type, gqa, mtp, msk) and (row[5] == hp or hp == 1) \
                    and row[6] == block_size:
                return row
    raise VendorContractError(
        f"get_heuristic_kernel: cannot get heuristic kernel! q_type:{q_type} kv_type:{kv_type} "
        f"gqa:{gqa_ratio} mtp:{mtp} msk:{msk} hp:{hp} block_size:{block_size}")


def pa_fwd_asm(Q, K, V, block_tables, context_lens, block_tables_stride0, max_qlen=1,
               K_QScale=None, V_QScale=None, out_=None, qo_indptr=None, high_precision=1,
               kernelName=None):
    """aiter's asm paged DECODE kernel on the split-K layout: K [num_blocks, Hk, D//x, 16, x],
    V [num_blocks, Hk, 16//x, D, x]; head_dim 128; softmax scale 1/sqrt(D) (asm_pa.cu computes
    it from Q.size(2)). The kernel comes from the csv lookup (``pa_asm_kernel``). Emulated for
    one query per sequence and an unquantised fp16/bf16 cache only."""
    require(max_qlen == 1 and qo_indptr is None, "emulation covers single-token decode only")
    require(K_QScale is None and V_QScale is None, "emulation covers unquantised caches only")
    require(kernelName is None and high_precision == 1,
            "emulation covers the heuristic kernel choice with high_precision 1")
    require(Q.dtype in _TYPE_NAMES and K.dtype == Q.dtype and V.dtype == Q.dtype,
            f"emulation covers fp16/bf16 Q/K/V alike, got {Q.dtype}/{K.dtype}/{V.dtype}")
    require(Q.dim() == 3 and K.dim() == 5 and V.dim() == 5, "Q 3-D, K/V 5-D (split-K)")
    num_blocks, num_kv_heads, d_over_x, block_size, x = K.shape
    head_dim = d_over_x * x
    require(x == 16 // K.element_size(), f"x must be 16 bytes / element size, got {x}")
    pa_asm_kernel(Q.dtype, K.dtype, Q.shape[1] // num_kv_heads, block_size)
    require(head_dim == 128 and Q.shape[2] == 128, f"pa_fwd_asm supports head_dim 128 only, "
                                                   f"got {Q.shape[2]}")
    require(tuple(V.shape) == (num_blocks, num_kv_heads, block_size // x, head_dim, x),
            f"V must be [num_blocks, Hk, block_size//x, D, x], got {tuple(V.shape)}")
    check_gqa(Q.shape[1], num_kv_heads)
    check_int32("block_tables", block_tables, 2)
    check_int32("context_lens", context_lens, 1)
    require(block_tables_stride0 == block_tables.stride(0), "block_tables_stride0 mismatch")
    require(Q.shape[0] == block_tables.shape[0] == context_lens.shape[0],
            "one query row per sequence")
    key_nhd = K.permute(0, 3, 1, 2, 4).reshape(num_blocks, block_size, num_kv_heads, head_dim)
    value_nhd = V.permute(0, 2, 4, 1, 3).reshape(num_blocks, block_size, num_kv_heads, head_dim)
    out = out_ if out_ is not None else uninitialized_like(Q)
    for b, length in enumerate(context_lens.tolist()):
        keys = read_pages(key_nhd, block_tables[b], length, block_size)
        values = read_pages(value_nhd, block_tables[b], length, block_size)
        out[b:b + 1] = attend(Q[b:b + 1], keys, values, head_dim ** -0.5, True).to(out.dtype)
    return out


def _check_cache_write(key, value, slot_mapping, kv_cache_dtype, cache_dtype, k_scale, v_scale,
                       scales_required: bool):
    for name, t in (("key", key), ("value", value)):
        require(t.dim() == 3, f"{name} must be [num_tokens, Hk, D], got {tuple(t.shape)}")
        require(t.stride(2) == 1 and t.stride(1) == t.shape[2],
                f"{name} heads/dims must be packed, strides {tuple(t.stride())}")
    require(slot_mapping.dtype == torch.int64 and slot_mapping.dim() == 1,
            f"slot_mapping must be 1-D int64, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    require(key.shape[0] == slot_mapping.shape[0] == value.shape[0],
            f"key/value rows {key.shape[0]}/{value.shape[0]} != slots {slot_mapping.shape[0]}")
    if kv_cache_dtype == "auto":
        require(cache_dtype == key.dtype, f"'auto' needs the cache in {key.dtype}, "
                                          f"got {cache_dtype}")
    else:
        require(kv_cache_dtype in ("fp8", "fp8_e4m3") and cache_dtype in FP8_DTYPES,
                f"kv_cache_dtype {kv_cache_dtype!r} with cache dtype {cache_dtype}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            require(not scales_required and kv_cache_dtype == "auto", f"{name} is required")
        else:
            require(s.dtype == torch.float32 and s.numel() == 1,
                    f"{name} must be a float32 tensor with one element")


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                            k_scale, v_scale):
    """Write key/value [num_tokens, Hk, D] into NHD caches [num_blocks, block_size, Hk, D] at
    slot_mapping [num_tokens] int64; slots < 0 are skipped; fp8 stores x * (1 / scale)."""
    _check_cache_write(key, value, slot_mapping, kv_cache_dtype, key_cache.dtype, k_scale,
                       v_scale, scales_required=True)
    require(key_cache.dim() == 4 and tuple(key_cache.shape[2:]) == tuple(key.shape[1:]),
            f"NHD cache shape {tuple(key_cache.shape)} does not fit key {tuple(key.shape)}")
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    for new, store, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        rows = quantize_reciprocal(new[valid], store.dtype, scale)
        store[slots // block_size, slots % block_size] = rows


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                      k_scale=None, v_scale=None, asm_layout=False):
    """Write into the split-K layout: key [num_blocks, Hk, D//x, block_size, x]; value
    [num_blocks, Hk, block_size//x, D, x] with asm_layout (else [num_blocks, Hk, D, block_size])."""
    _check_cache_write(key, value, slot_mapping, kv_cache_dtype, key_cache.dtype, k_scale,
                       v_scale, scales_required=False)
    require(key_cache.dim() == 5, f"key_cache must be 5-D split-K, got {tuple(key_cache.shape)}")
    num_blocks, num_kv_heads, d_over_x, block_size, x = key_cache.shape
    head_dim = d_over_x * x
    require(x == 16 // key_cache.element_size(), f"x must be 16 bytes / element size, got {x}")
    require((num_kv_heads, head_dim) == tuple(key.shape[1:]), "cache heads/dims differ from key")
    expected_v = ((num_blocks, num_kv_heads, block_size // x, head_dim, x) if asm_layout
                  else (num_blocks, num_kv_heads, head_dim, block_size))
    require(tuple(value_cache.shape) == expected_v,
            f"value_cache must be {expected_v} (asm_layout={asm_layout}), "
            f"got {tuple(value_cache.shape)}")
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    b, o = (slots // block_size).view(-1, 1, 1), (slots % block_size).view(-1, 1, 1)
    h = torch.arange(num_kv_heads, device=key.device).view(1, -1, 1)
    d = torch.arange(head_dim, device=key.device).view(1, 1, -1)
    new_k = quantize_reciprocal(key[valid], key_cache.dtype, k_scale)
    key_cache[b, h, d // x, o, d % x] = new_k
    new_v = quantize_reciprocal(value[valid], value_cache.dtype, v_scale)
    if asm_layout:
        value_cache[b, h, o // x, d, o % x] = new_v
    else:
        value_cache[b, h, d, o] = new_v


def make_aiter_module():
    """A fake ``aiter`` module for ``monkeypatch.setitem(sys.modules, "aiter", ...)``."""
    return make_module("aiter", {name: globals()[name] for name in API})
