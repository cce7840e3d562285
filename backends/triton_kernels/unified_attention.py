"""Unified paged attention in Triton: one kernel for any mix of prefill chunks, decodes and
multi-token (verify / draft) queries, reading K/V from the NHD paged cache.

Reference: ``rocdraft.backends.torch_sdpa.paged_attention_reference``.

Work split: the queries of each request are cut into blocks of ``BLOCK_Q`` tokens; a program
handles one block for one KV head, i.e. ``BLOCK_Q * GROUP`` rows of (query token, query head)
where ``GROUP = num_heads // num_kv_heads`` (GQA shares every K/V tile across the group).
Request i owns the program indices starting at ``query_start_loc[i] // BLOCK_Q + i``, so a
program finds its request by a binary search over ``query_start_loc`` on the device, and

    num_programs = num_tokens // BLOCK_Q + num_reqs    (x num_kv_heads)

is an upper bound computed from host ints only: the launch never reads a device tensor, so it
is graph-safe. Programs left over (short requests, graph padding) exit at once; output rows
of padding tokens stay zero.

Masking, for query token j of request i at position ``p = seq_lens[i] - query_len_i + j``:
key position k is visible when ``k < seq_lens[i]``, ``k <= p`` (causal), and, with a
``spec_mask`` over the last num_spec positions of the request (``first = seq_lens[i] -
num_spec``), when ``mask_i[p - first, k - first]`` for ``p, k >= first``: ``mask_i`` is the
shared [num_spec, num_spec] mask (batch stride 0) or ``spec_mask[i]`` of a per-request
[num_reqs, num_spec, num_spec] one. Row ``p - first`` is ``num_spec - query_len_i + j``: a query shorter
than num_spec uses the last rows (the rule of backends/metadata.py). Softmax is online
(running max and sum) with fp32 accumulation; fp8 caches are dequantised by folding the
per-tensor / per-head scale into the scores and output.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rocdraft.backends.kv_cache import FP8_DTYPES, NHD, LayerKVCache
from rocdraft.backends.metadata import CommonAttentionMetadata

QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = QUERY_DTYPES + FP8_DTYPES
TILE_N = 32  # keys per inner-loop step on a GPU (independent of block_size)
LOG2E = tl.constexpr(1.4426950408889634)  # a global read by a kernel must be constexpr


@triton.jit
def _find_request(query_start_loc_ptr, program_block, num_reqs, BLOCK_Q: tl.constexpr):
    """The last request i with query_start_loc[i] // BLOCK_Q + i <= program_block."""
    left = 0
    right = num_reqs
    while left < right:
        mid = (left + right) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= program_block:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def unified_attention_kernel(
        query_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
        query_start_loc_ptr, seq_lens_ptr, block_table_ptr, spec_mask_ptr,
        sm_scale, num_reqs, num_query_rows,
        query_stride_t, query_stride_h, out_stride_t, out_stride_h,
        kc_stride_block, kc_stride_off, kc_stride_head,
        vc_stride_block, vc_stride_off, vc_stride_head,
        block_table_stride, max_blocks_per_seq, k_scale_stride, v_scale_stride,
        spec_mask_stride_b, spec_mask_stride_q, spec_mask_stride_k, num_spec, block_size,
        head_dim,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr, TILE: tl.constexpr, CAUSAL: tl.constexpr,
        HAS_SPEC_MASK: tl.constexpr, HAS_K_SCALE: tl.constexpr, HAS_V_SCALE: tl.constexpr,
        UPCAST_DOT: tl.constexpr):
    """Grid (num_tokens // BLOCK_Q + num_reqs, num_kv_heads)."""
    program_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, program_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block = program_block - (q_start // BLOCK_Q + req)
    if q_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len  # position of the request's first query token

    rows = tl.arange(0, BLOCK_M)  # row = (query token within the block, head within group)
    token_idx = q_block * BLOCK_Q + rows // GROUP  # index within the request's query
    head = kv_head * GROUP + rows % GROUP
    token = (q_start + token_idx).to(tl.int64)
    row_valid = (rows < BLOCK_Q * GROUP) & (token_idx < query_len) & (token < num_query_rows)
    q_pos = context_len + token_idx  # [BLOCK_M]
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim

    q = tl.load(query_ptr + token[:, None] * query_stride_t + head[:, None] * query_stride_h
                + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    qk_scale = sm_scale * LOG2E  # scores in log2 units
    if HAS_K_SCALE:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head * k_scale_stride)

    # Keys past the block's last query position are never visible (causal).
    kv_end = seq_len
    if CAUSAL:
        kv_end = context_len + tl.minimum(query_len, (q_block + 1) * BLOCK_Q)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first_spec = seq_len - num_spec
    bt_row = block_table_ptr + req.to(tl.int64) * block_table_stride
    mask_row = spec_mask_ptr + req.to(tl.int64) * spec_mask_stride_b  # stride 0: shared

    for tile_start in range(0, kv_end, TILE):
        k_pos = tile_start + tl.arange(0, TILE)  # [TILE]
        k_valid = k_pos < kv_end
        block_col = tl.minimum(k_pos // block_size, max_blocks_per_seq - 1)
        # Unallocated entries (graph padding rows) hold -1: read block 0 instead of memory
        # before the cache; those rows' outputs are discarded and their slots are -1.
        block_ids = tl.maximum(tl.load(bt_row + block_col, mask=k_valid, other=0), 0).to(tl.int64)
        k_off = (k_pos % block_size).to(tl.int64)
        kv_mask = k_valid[:, None] & dim_valid[None, :]
        k = tl.load(key_cache_ptr + block_ids[:, None] * kc_stride_block
                    + k_off[:, None] * kc_stride_off + kv_head * kc_stride_head + dims[None, :],
                    mask=kv_mask, other=0.0)  # [TILE, BLOCK_D]
        v = tl.load(value_cache_ptr + block_ids[:, None] * vc_stride_block
                    + k_off[:, None] * vc_stride_off + kv_head * vc_stride_head + dims[None, :],
                    mask=kv_mask, other=0.0)  # [TILE, BLOCK_D]
        if UPCAST_DOT:
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = qk * qk_scale  # [BLOCK_M, TILE]

        visible = row_valid[:, None] & k_valid[None, :]
        if CAUSAL:
            visible = visible & (k_pos[None, :] <= q_pos[:, None])
        if HAS_SPEC_MASK:
            qi = q_pos - first_spec
            kj = k_pos - first_spec
            in_spec = (qi[:, None] >= 0) & (kj[None, :] >= 0)
            allowed = tl.load(mask_row
                              + tl.minimum(tl.maximum(qi, 0), num_spec - 1)[:, None]
                              * spec_mask_stride_q
                              + tl.minimum(tl.maximum(kj, 0), num_spec - 1)[None, :]
                              * spec_mask_stride_k, mask=in_spec & visible, other=0)
            visible = visible & ((~in_spec) | (allowed != 0))
        s = tl.where(visible, s, float("-inf"))

        # Online softmax: rescale what was accumulated when the running max grows. A row that
        # has seen no visible key keeps m = -inf; use 0 as its base so exp2 never sees inf-inf.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_base = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_base[:, None])
        alpha = tl.exp2(m_i - m_base)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows that saw no key: 0
    if HAS_V_SCALE:
        out = out * tl.load(v_scale_ptr + kv_head * v_scale_stride)
    tl.store(out_ptr + token[:, None] * out_stride_t + head[:, None] * out_stride_h
             + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & dim_valid[None, :])


class LaunchConfig(NamedTuple):
    block_q: int  # query tokens per program
    block_m: int  # rows per program: block_q * group, padded to a power of two >= 16
    block_d: int  # head_dim padded to a power of two >= 16
    tile_n: int  # keys per inner-loop step
    num_programs: int  # along the query axis


# Decoration fixed the mode at import. The interpreter's tl.dot is wrong on bf16 operands, so
# there every dot runs in fp32.
INTERPRETED = not isinstance(unified_attention_kernel, triton.runtime.JITFunction)


def launch_config(num_tokens: int, num_reqs: int, max_query_len: int, group: int,
                  head_dim: int, interpreted: bool = INTERPRETED) -> LaunchConfig:
    """Tile sizes and grid from host ints only. On a GPU, decode-only batches use 16 rows per
    program and batches with longer queries 64, so prefill chunks need fewer programs. The
    interpreter pays per program and per loop step, so there it always takes the big tiles."""
    target_rows = 16 if max_query_len * group <= 16 and not interpreted else 64
    block_q = max(1, target_rows // group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    tile_n = 64 if interpreted else TILE_N
    return LaunchConfig(block_q, block_m, block_d, tile_n, num_tokens // block_q + num_reqs)


def check_attention_args(query: torch.Tensor, cache: LayerKVCache,
                         common: CommonAttentionMetadata) -> None:
    """Raise ValueError naming the first problem (shapes, dtypes and devices only)."""
    if cache.layout != NHD:
        raise ValueError(f"unified attention reads the NHD layout, got {cache.layout!r}")
    if query.dim() != 3 or query.stride(2) != 1:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim] with a contiguous "
                         f"last dim, got shape {list(query.shape)} strides {query.stride()}")
    if query.dtype not in QUERY_DTYPES:
        raise ValueError(f"query dtype {query.dtype} is not one of "
                         f"{[str(d) for d in QUERY_DTYPES]}")
    if cache.key.dtype not in CACHE_DTYPES or cache.value.dtype != cache.key.dtype:
        raise ValueError(f"cache dtypes key={cache.key.dtype} value={cache.value.dtype} must "
                         f"match and be one of {[str(d) for d in CACHE_DTYPES]}")
    num_kv_heads, head_dim = cache.key.shape[2], cache.key.shape[3]
    if cache.key.stride(3) != 1 or cache.value.stride(3) != 1:
        raise ValueError("the KV cache must be contiguous in head_dim")
    if query.shape[2] != head_dim or query.shape[1] % num_kv_heads:
        raise ValueError(f"query shape {list(query.shape)} does not fit the cache: head_dim "
                         f"{head_dim}, num_heads a multiple of num_kv_heads {num_kv_heads}")
    for name, t, dtype in (("query_start_loc", common.query_start_loc, torch.int32),
                           ("seq_lens", common.seq_lens, torch.int32),
                           ("block_table", common.block_table, torch.int32)):
        if t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")
    if common.block_table.dim() != 2 or common.block_table.stride(1) != 1:
        raise ValueError(f"block_table must be 2-D with contiguous rows, got shape "
                         f"{list(common.block_table.shape)} strides {common.block_table.stride()}")
    mask = common.spec_mask
    # Its dtype and shapes were checked when the metadata was built (check_spec_mask).
    if mask is not None and mask.device != query.device:
        raise ValueError(f"spec_mask of shape {list(mask.shape)} is on {mask.device}, "
                         f"query on {query.device}")
    for name, scale in (("k_scale", cache.k_scale), ("v_scale", cache.v_scale)):
        if scale is not None and (scale.dtype != torch.float32 or scale.dim() != 1
                                  or scale.shape[0] not in (1, num_kv_heads)):
            raise ValueError(f"{name} must be float32 [1] or [num_kv_heads={num_kv_heads}], "
                             f"got {scale.dtype} of shape {list(scale.shape)}")


def unified_attention(query: torch.Tensor, cache: LayerKVCache, common: CommonAttentionMetadata,
                      scale: float, launch: LaunchConfig | None = None) -> torch.Tensor:
    """Checked wrapper: query [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads,
    head_dim] in the query dtype (rows of padding tokens are zero). Never reads the device.
    ``launch`` overrides ``launch_config`` (tests use it to run the GPU tiling everywhere)."""
    check_attention_args(query, cache, common)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = cache.key.shape[2]
    out = torch.zeros_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0 or common.num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    cfg = launch or launch_config(num_tokens, common.num_reqs, common.max_query_len, group,
                                  head_dim)
    k_scale, v_scale, spec_mask = cache.k_scale, cache.v_scale, common.spec_mask
    dummy = common.seq_lens  # pointer passed where a tensor is absent (never read)
    spec_u8 = dummy if spec_mask is None else spec_mask.view(torch.uint8)
    unified_attention_kernel[(cfg.num_programs, num_kv_heads)](
        query, cache.key, cache.value, dummy if k_scale is None else k_scale,
        dummy if v_scale is None else v_scale, out,
        common.query_start_loc, common.seq_lens, common.block_table, spec_u8,
        scale, common.num_reqs, num_tokens,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        cache.key.stride(0), cache.key.stride(1), cache.key.stride(2),
        cache.value.stride(0), cache.value.stride(1), cache.value.stride(2),
        common.block_table.stride(0), common.block_table.shape[1],
        0 if k_scale is None or k_scale.shape[0] == 1 else 1,
        0 if v_scale is None or v_scale.shape[0] == 1 else 1,
        0 if spec_mask is None or spec_mask.dim() == 2 else spec_u8.stride(0),
        0 if spec_mask is None else spec_u8.stride(-2),
        0 if spec_mask is None else spec_u8.stride(-1),
        0 if spec_mask is None else spec_mask.shape[-1],
        cache.block_size, head_dim,
        GROUP=group, BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m, BLOCK_D=cfg.block_d,
        TILE=cfg.tile_n, CAUSAL=common.causal, HAS_SPEC_MASK=spec_mask is not None,
        HAS_K_SCALE=k_scale is not None, HAS_V_SCALE=v_scale is not None,
        UPCAST_DOT=INTERPRETED or query.dtype == torch.float32)
    return out
