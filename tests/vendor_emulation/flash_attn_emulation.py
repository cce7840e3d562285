"""TEST-ONLY emulation of the flash_attn calls FLASH_ATTN makes. Not flash-attn; no hardware.

Signatures and preconditions follow flash-attn 2.8.3.post2 (the sdist on the package index):
flash_attn/flash_attn_interface.py (signatures: tests/vendor_emulation/real_signatures.py) and
csrc/flash_attn/flash_api.cpp ("head dimension at most 256"; the Python wrapper pads head dims
to a multiple of 8; "Paged KV cache block size must be divisible by 256" on CUDA, 128 in the
ROCm CK build, csrc/flash_attn_ck/mha_fwd_kvcache.cpp):
``flash_attn_varlen_func`` (q [total_q, H, D], k/v [total_k, Hk, D], int32 cu_seqlens, causal
bottom-right) and ``flash_attn_with_kvcache`` (q [batch, seqlen_q, H, D]; paged k_cache
[num_blocks, page_block_size, Hk, D] with "page_block_size must be a multiple of 256";
int32 cache_seqlens and block_table; "k_cache must have contiguous last dimension").
Appending new k/v inside the call, rotary, alibi, windows and soft-capping are not emulated
and must stay unused. flash-attn writes no fp8 cache (the adapter uses the reference write).
"""
from __future__ import annotations

from . import (attend, check_cu_seqlens, check_gqa, check_half, check_int32,
               check_last_dim_contiguous, check_max_seqlen, make_module, read_pages, require,
               uninitialized_like)

API = ("flash_attn_varlen_func", "flash_attn_with_kvcache")
PAGE_MULTIPLE = 256
MAX_HEAD_DIM = 256  # flash_api.cpp: "... only supports head dimension at most 256"


def _check_head_dim(head_dim: int) -> None:
    require(head_dim <= MAX_HEAD_DIM, f"FlashAttention forward only supports head dimension at "
                                      f"most {MAX_HEAD_DIM}, got {head_dim}")


def _check_unused(**options) -> None:
    neutral = {"window_size": (-1, -1), "softcap": 0.0, "alibi_slopes": None, "dropout_p": 0.0,
               "k": None, "v": None, "rotary_cos": None, "rotary_sin": None,
               "cache_batch_idx": None, "cache_leftpad": None, "return_attn_probs": False,
               "return_softmax_lse": False}
    for name, value in options.items():
        expected = neutral[name]
        same = tuple(value) == expected if isinstance(expected, tuple) else value == expected
        require(same if expected is not None else value is None,
                f"emulation covers {name}={expected!r} only, got {value!r}")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """q [total_q, Hq, D]; k/v [total_k, Hk, D] (or paged with block_table, page % 256 == 0);
    cu_seqlens int32 [batch + 1]; causal bottom-right -> [total_q, Hq, D]."""
    _check_unused(dropout_p=dropout_p, window_size=window_size, softcap=softcap,
                  alibi_slopes=alibi_slopes, return_attn_probs=return_attn_probs)
    require(q.dim() == 3, f"q must be [total_q, H, D], got {tuple(q.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_half(name, t)
        check_last_dim_contiguous(name, t)
    require(k.dtype == q.dtype == v.dtype, f"q/k/v dtypes differ: {q.dtype}/{k.dtype}/{v.dtype}")
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k)
    require(len(cu_q) == len(cu_k), f"cu_seqlens_q/_k batch sizes differ: {cu_q} vs {cu_k}")
    require(cu_q[-1] <= q.shape[0], f"cu_seqlens_q[-1]={cu_q[-1]} > total_q={q.shape[0]}")
    lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    check_max_seqlen("max_seqlen_q", max_seqlen_q, lens_q)
    check_max_seqlen("max_seqlen_k", max_seqlen_k, lens_k)
    require(k.shape[-1] == q.shape[-1] and v.shape == k.shape, "head dims or k/v shapes differ")
    _check_head_dim(q.shape[-1])
    check_gqa(q.shape[1], k.shape[-2])
    if block_table is None:
        require(k.dim() == 3 and cu_k[-1] <= k.shape[0],
                f"k must be [total_k >= {cu_k[-1]}, Hk, D], got {tuple(k.shape)}")
    else:
        require(k.dim() == 4 and k.shape[1] % PAGE_MULTIPLE == 0,
                f"paged k must be [num_blocks, page, Hk, D] with page a multiple of "
                f"{PAGE_MULTIPLE}, got {tuple(k.shape)}")
        check_int32("block_table", block_table, 2)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = uninitialized_like(q)
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if block_table is None:
            keys, values = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        else:
            keys = read_pages(k, block_table[b], lk, k.shape[1])
            values = read_pages(v, block_table[b], lk, k.shape[1])
        out[cu_q[b]:cu_q[b] + lq] = attend(q[cu_q[b]:cu_q[b] + lq], keys, values, scale,
                                            causal).to(q.dtype)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """q [batch, seqlen_q, Hq, D]; k_cache/v_cache [num_blocks, page, Hk, D] with block_table
    [batch, max_blocks] int32 (page % 256 == 0), else [batch, seqlen_cache, Hk, D];
    cache_seqlens int32 [batch] -> [batch, seqlen_q, Hq, D]. Causal bottom-right."""
    _check_unused(k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                  cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                  return_softmax_lse=return_softmax_lse)
    require(k_cache.stride(-1) == 1, "k_cache must have contiguous last dimension")
    require(v_cache.stride(-1) == 1, "v_cache must have contiguous last dimension")
    require(q.dim() == 4, f"q must be [batch, seqlen_q, H, D], got {tuple(q.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_half(name, t)
    require(k_cache.dtype == q.dtype == v_cache.dtype, "q and cache dtypes differ")
    require(k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
            f"caches must be 4-D alike, got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    batch, _, num_heads, head_dim = q.shape
    require(k_cache.shape[-1] == head_dim, "cache head_dim differs from q's")
    _check_head_dim(head_dim)
    check_gqa(num_heads, k_cache.shape[2])
    check_int32("cache_seqlens", cache_seqlens, 1)
    require(cache_seqlens.shape[0] == batch, f"cache_seqlens has {cache_seqlens.shape[0]} "
                                             f"entries for batch {batch}")
    lens = cache_seqlens.tolist()
    if block_table is not None:
        page = k_cache.shape[1]
        require(page % PAGE_MULTIPLE == 0,
                f"page_block_size must be a multiple of {PAGE_MULTIPLE}, got {page}")
        check_int32("block_table", block_table, 2)
        require(block_table.shape[0] == batch, f"block_table has {block_table.shape[0]} rows "
                                               f"for batch {batch}")
        require(max(lens + [0]) <= block_table.shape[1] * page, "cache_seqlens exceed the table")
    else:
        require(k_cache.shape[0] >= batch and max(lens + [0]) <= k_cache.shape[1],
                "contiguous cache too small for the batch")
    scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
    out = uninitialized_like(q)
    for b, length in enumerate(lens):
        if block_table is None:
            keys, values = k_cache[b, :length], v_cache[b, :length]
        else:
            keys = read_pages(k_cache, block_table[b], length, k_cache.shape[1])
            values = read_pages(v_cache, block_table[b], length, k_cache.shape[1])
        out[b] = attend(q[b], keys, values, scale, causal).to(q.dtype)
    return out


def make_flash_attn_module():
    """A fake ``flash_attn`` module for ``monkeypatch.setitem(sys.modules, "flash_attn", ...)``."""
    return make_module("flash_attn", {name: globals()[name] for name in API})
