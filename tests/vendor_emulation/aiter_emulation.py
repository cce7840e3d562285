"""TEST-ONLY emulation of the aiter calls ROCM_AITER_FA makes. Not aiter; no hardware.

Signatures follow aiter (ROCm/aiter: aiter/ops/mha.py, aiter/ops/attention.py,
aiter/ops/cache.py, csrc/cpp_itfs/pa/pa_v1.py) and REFERENCE.md "Attention on AMD". The
preconditions enforced are the documented ones plus the ones the kernels' launch code relies on
(it passes only a row stride for q, reads scales through data pointers, sizes partitions by
max_context_len). The argument subsets we do not use (alibi, soft-cap, sliding window, dropout,
fp8 output) must be left at their neutral values.
"""
from __future__ import annotations

import math

import torch

from . import (FP8_DTYPES, attend, check_cu_seqlens, check_gqa, check_half, check_int32,
               check_last_dim_contiguous, check_max_seqlen, dequantize, make_module, quantize,
               read_pages, require, uninitialized_like)

API = ("flash_attn_varlen_func", "paged_attention_v1", "pa_fwd_asm", "reshape_and_cache_flash",
       "reshape_and_cache")
VARLEN_PAGE_MULTIPLE = 128


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           bias=None, alibi_slopes=None, deterministic=False, return_lse=False,
                           return_attn_probs=False, block_table=None, out=None):
    """q [total_q, Hq, D]; k/v [total_k, Hk, D], or [num_blocks, page, Hk, D] with block_table
    (page a multiple of 128); int32 cu_seqlens; causal bottom-right; GQA."""
    require(dropout_p == 0.0 and tuple(window_size)[:2] == (-1, -1) and bias is None
            and alibi_slopes is None and not return_attn_probs,
            "emulation covers dropout 0, no window, no bias/alibi, no attn probs")
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
    scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
    result = uninitialized_like(q)
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if block_table is None:
            keys, values = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        else:
            keys = read_pages(k, block_table[b], lk, k.shape[1])
            values = read_pages(v, block_table[b], lk, k.shape[1])
        result[cu_q[b]:cu_q[b] + lq] = attend(q[cu_q[b]:cu_q[b] + lq], keys, values, scale,
                                               causal).to(q.dtype)
    if out is not None:
        out.copy_(result)
        result = out
    return (result, None) if return_lse else result


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


def pa_fwd_asm(Q, K, V, block_tables, context_lens, block_tables_stride0, max_qlen=1,
               K_QScale=None, V_QScale=None, out_=None, qo_indptr=None, high_precision=1,
               kernelName=None):
    """aiter's asm paged DECODE kernel on the split-K layout: K [num_blocks, Hk, D//x, 16, x],
    V [num_blocks, Hk, 16//x, D, x]; block size 16, head_dim 128; softmax scale 1/sqrt(D).
    Emulated for one query per sequence and a bf16 (non-quantised) cache only."""
    require(max_qlen == 1 and qo_indptr is None, "emulation covers single-token decode only")
    require(K_QScale is None and V_QScale is None, "emulation covers unquantised caches only")
    require(Q.dtype == torch.bfloat16 and K.dtype == Q.dtype and V.dtype == Q.dtype,
            f"emulation covers bf16 Q/K/V, got {Q.dtype}/{K.dtype}/{V.dtype}")
    require(Q.dim() == 3 and K.dim() == 5 and V.dim() == 5, "Q 3-D, K/V 5-D (split-K)")
    num_blocks, num_kv_heads, d_over_x, block_size, x = K.shape
    head_dim = d_over_x * x
    require(x == 16 // K.element_size(), f"x must be 16 bytes / element size, got {x}")
    require(block_size == 16, f"pa_fwd_asm needs block size 16, got {block_size}")
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
    slot_mapping [num_tokens] int64; slots < 0 are skipped; fp8 stores x / scale."""
    _check_cache_write(key, value, slot_mapping, kv_cache_dtype, key_cache.dtype, k_scale,
                       v_scale, scales_required=True)
    require(key_cache.dim() == 4 and tuple(key_cache.shape[2:]) == tuple(key.shape[1:]),
            f"NHD cache shape {tuple(key_cache.shape)} does not fit key {tuple(key.shape)}")
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    for new, store, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        store[slots // block_size, slots % block_size] = quantize(new[valid], store.dtype, scale)


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
    key_cache[b, h, d // x, o, d % x] = quantize(key[valid], key_cache.dtype, k_scale)
    new_v = quantize(value[valid], value_cache.dtype, v_scale)
    if asm_layout:
        value_cache[b, h, o // x, d, o % x] = new_v
    else:
        value_cache[b, h, d, o] = new_v


def make_aiter_module():
    """A fake ``aiter`` module for ``monkeypatch.setitem(sys.modules, "aiter", ...)``."""
    return make_module("aiter", {name: globals()[name] for name in API})
