"""KV compaction after tree verification in Triton: move each request's accepted path to
consecutive positions, raw bytes, both layouts.

Reference and contract: ``rocdraft.backends.kv_compact`` (this kernel is bit-exact with
``compact_kv_reference``). Grid (B,): a program handles one request, all heads and head-dim
elements as one [BLOCK_H, BLOCK_D] tile, and walks its moves d = 1 .. D in order; each move is
validated in the kernel exactly as ``compact_kv_moves`` does and invalid ones are masked off.
Every element is loaded and stored by the same lane in every iteration, and (see the reference
module) no valid move reads a slot an earlier one wrote, so the in-order walk equals "read all
sources first" with no barrier. The caches are passed as same-sized integer views
(``bits_view``): fp8 and NaN payloads are copied bit for bit.

Cache addressing is that of the KV write (``kv_write.cache_addressing``)::

    b * s_block + h * s_head + (o // OFF_SPLIT) * s_off_hi + (o % OFF_SPLIT) * s_off_lo
                             + (d // DIM_SPLIT) * s_dim_hi + (d % DIM_SPLIT) * s_dim_lo

Bytes moved per accepted token and layer: 2 * 2 * num_kv_heads * head_dim * element size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocdraft.backends.kv_cache import LayerKVCache
from rocdraft.backends.kv_compact import bits_view, check_compact_kv
from rocdraft.backends.triton_kernels.kv_write import cache_addressing


@triton.jit
def _move_rows(cache_ptr, src_block, src_off, dst_block, dst_off, move, heads, dims,
               num_kv_heads, head_dim, s_block, s_head, s_off_hi, s_off_lo, s_dim_hi, s_dim_lo,
               OFF_SPLIT: tl.constexpr, DIM_SPLIT: tl.constexpr):
    """Copy the [BLOCK_H, BLOCK_D] elements of slot (src_block, src_off) to (dst_block,
    dst_off) when ``move`` is true."""
    # a scalar bool cannot join a vector mask in the interpreter: fold it into the head limit
    mask = (heads[:, None] < tl.where(move, num_kv_heads, 0)) & (dims[None, :] < head_dim)
    inner = (heads[:, None] * s_head + (dims[None, :] // DIM_SPLIT) * s_dim_hi
             + (dims[None, :] % DIM_SPLIT) * s_dim_lo)
    src = (src_block * s_block + (src_off // OFF_SPLIT) * s_off_hi
           + (src_off % OFF_SPLIT) * s_off_lo)
    dst = (dst_block * s_block + (dst_off // OFF_SPLIT) * s_off_hi
           + (dst_off % OFF_SPLIT) * s_off_lo)
    rows = tl.load(cache_ptr + src + inner, mask=mask)
    tl.store(cache_ptr + dst + inner, rows, mask=mask)


@triton.jit
def kv_compact_kernel(key_bits_ptr, value_bits_ptr, block_table_ptr, context_lens_ptr,
                      accepted_nodes_ptr, num_accepted_ptr, block_table_stride,
                      accepted_stride, depth, max_blocks, num_blocks, block_size, num_kv_heads,
                      head_dim,
                      kc_s_block, kc_s_head, kc_s_off_hi, kc_s_off_lo, kc_s_dim_hi, kc_s_dim_lo,
                      vc_s_block, vc_s_head, vc_s_off_hi, vc_s_off_lo, vc_s_dim_hi, vc_s_dim_lo,
                      KEY_OFF_SPLIT: tl.constexpr, KEY_DIM_SPLIT: tl.constexpr,
                      VALUE_OFF_SPLIT: tl.constexpr, VALUE_DIM_SPLIT: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (batch_size,): program b performs request b's valid moves in increasing depth."""
    req = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    context = tl.load(context_lens_ptr + req).to(tl.int64)
    count = tl.load(num_accepted_ptr + req)
    table = block_table_ptr + req * block_table_stride
    for step in range(0, depth):  # step = d - 1
        node = tl.load(accepted_nodes_ptr + req * accepted_stride + step)
        src = context + 1 + node
        dst = context + 1 + step
        valid = (step < count) & (node >= step) & (context >= 0)
        valid = valid & (src // block_size < max_blocks) & (src != dst)
        src = tl.where(valid, src, 0)
        dst = tl.where(valid, dst, 0)
        src_block = tl.load(table + src // block_size).to(tl.int64)
        dst_block = tl.load(table + dst // block_size).to(tl.int64)
        valid = valid & (src_block >= 0) & (src_block < num_blocks)
        valid = valid & (dst_block >= 0) & (dst_block < num_blocks)
        src_block = tl.where(valid, src_block, 0)
        dst_block = tl.where(valid, dst_block, 0)
        src_off = src % block_size
        dst_off = dst % block_size
        _move_rows(key_bits_ptr, src_block, src_off, dst_block, dst_off, valid, heads, dims,
                   num_kv_heads, head_dim, kc_s_block, kc_s_head, kc_s_off_hi, kc_s_off_lo,
                   kc_s_dim_hi, kc_s_dim_lo, KEY_OFF_SPLIT, KEY_DIM_SPLIT)
        _move_rows(value_bits_ptr, src_block, src_off, dst_block, dst_off, valid, heads, dims,
                   num_kv_heads, head_dim, vc_s_block, vc_s_head, vc_s_off_hi, vc_s_off_lo,
                   vc_s_dim_hi, vc_s_dim_lo, VALUE_OFF_SPLIT, VALUE_DIM_SPLIT)


def compact_kv_triton(cache: LayerKVCache, block_table: torch.Tensor,
                      context_lens: torch.Tensor, accepted_nodes: torch.Tensor,
                      num_accepted: torch.Tensor, block_size: int) -> None:
    """Checked wrapper, same contract as ``compact_kv_reference``: block_table [>= B,
    max_blocks] int32, context_lens [B] int32, accepted_nodes [B, D] int64, num_accepted [B]
    int64 -> ``cache`` compacted in place. Never reads the device."""
    check_compact_kv(cache.key, cache.value, cache.layout, block_table, context_lens,
                     accepted_nodes, num_accepted, block_size)
    batch_size, depth = accepted_nodes.shape
    if batch_size == 0 or depth == 0:
        return
    key_bits, value_bits = bits_view(cache.key), bits_view(cache.value)
    k_addr = cache_addressing(key_bits, cache.layout, is_value=False)
    v_addr = cache_addressing(value_bits, cache.layout, is_value=True)
    if cache.layout == "NHD":
        num_kv_heads, head_dim = cache.key.shape[2], cache.key.shape[3]
    else:
        num_kv_heads, head_dim = cache.key.shape[1], cache.value.shape[3]
    kv_compact_kernel[(batch_size,)](
        key_bits, value_bits, block_table, context_lens, accepted_nodes, num_accepted,
        block_table.stride(0), accepted_nodes.stride(0), depth, block_table.shape[1],
        cache.num_blocks, block_size, num_kv_heads, head_dim, *k_addr.strides, *v_addr.strides,
        KEY_OFF_SPLIT=k_addr.off_split, KEY_DIM_SPLIT=k_addr.dim_split,
        VALUE_OFF_SPLIT=v_addr.off_split, VALUE_DIM_SPLIT=v_addr.dim_split,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))
