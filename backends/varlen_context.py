"""Contiguous varlen K/V from the paged cache, for kernels that take ``cu_seqlens_k``.

FlashAttention-style varlen kernels (``flash_attn_varlen_func`` in aiter and flash-attn) read
keys as one packed tensor ``[total_kv, num_kv_heads, head_dim]`` with ``cu_seqlens_k``
delimiting each request. This module gathers every request's whole context (cached tokens and
the new ones, which the backend has just written) out of the paged cache into that form.

All index math runs on the device; the only host value is ``num_kv_rows``, the gather size,
which comes from host ints the scheduler already has (``seq_lens_cpu``, ``max_seq_len``).
During drafting those are upper bounds: rows past ``cu_seqlens_k[-1]`` are padding that the
kernels never read, so a bound is as good as the exact count.

Worked example, block_size 4, seq_lens [3, 6], block_table [[5, -], [2, 7]]:

    cu_seqlens_k = [0, 3, 9]
    kv_req       = [0, 0, 0, 1, 1, 1, 1, 1, 1]    # request row of each gathered key
    kv_pos       = [0, 1, 2, 0, 1, 2, 3, 4, 5]    # position of that key in its request
    slots        = [20, 21, 22, 8, 9, 10, 11, 28, 29]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rocdraft.backends.base import MetadataBuilder
from rocdraft.backends.kv_cache import NHD, LayerKVCache
from rocdraft.backends.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class VarlenContext:
    cu_seqlens_q: torch.Tensor  # [batch_size + 1] int32, device (= query_start_loc)
    cu_seqlens_k: torch.Tensor  # [batch_size + 1] int32, device, prefix sum of seq_lens
    kv_req: torch.Tensor  # [num_kv_rows] int64, request row of each gathered key
    kv_pos: torch.Tensor  # [num_kv_rows] int64, position of each gathered key
    token_is_padding: torch.Tensor  # [num_tokens] bool, query rows past query_start_loc[-1]
    max_seqlen_q: int  # host upper bound of the query lengths
    max_seqlen_k: int  # host upper bound of the sequence lengths


def exact_kv_rows(common: CommonAttentionMetadata) -> int:
    """Gather size for one step: the sum of the host copy of seq_lens (a CPU tensor, no sync;
    exact, or a bound where a step launched ahead does not know the previous step's
    acceptance: rocdraft/engine/overlap.py)."""
    return int(common.seq_lens_cpu[:common.num_reqs].sum()) if common.num_reqs else 0


def bounded_kv_rows(common: CommonAttentionMetadata) -> int:
    """Gather size that stays valid for any replay whose sequences fit in max_seq_len
    (used when building for graph capture)."""
    return common.num_reqs * common.max_seq_len


def build_varlen_context(common: CommonAttentionMetadata, num_kv_rows: int) -> VarlenContext:
    """Device-side varlen description of ``common``; ``num_kv_rows`` >= sum(seq_lens)."""
    device = common.seq_lens.device
    batch_size = common.num_reqs
    seq_lens = common.seq_lens.long()  # [batch_size]
    cu_k = torch.zeros(batch_size + 1, dtype=torch.int64, device=device)
    cu_k[1:] = torch.cumsum(seq_lens, 0)
    rows = torch.arange(num_kv_rows, device=device)
    kv_req = torch.searchsorted(cu_k[1:], rows, right=True)  # [num_kv_rows] in [0, batch_size]
    safe_req = kv_req.clamp(max=max(batch_size - 1, 0))
    kv_pos = (rows - cu_k[safe_req]).masked_fill(kv_req >= batch_size, 0)

    num_tokens = common.slot_mapping.shape[0]
    tokens = torch.arange(num_tokens, device=common.query_start_loc.device)
    token_is_padding = tokens >= common.query_start_loc[-1].long()
    return VarlenContext(
        cu_seqlens_q=common.query_start_loc.to(torch.int32),
        cu_seqlens_k=cu_k.to(torch.int32),
        kv_req=safe_req, kv_pos=kv_pos, token_is_padding=token_is_padding,
        max_seqlen_q=max(common.max_query_len, 1), max_seqlen_k=max(common.max_seq_len, 1))


class VarlenContextBuilder(MetadataBuilder):
    """The builder contract of the backends that gather a varlen context from the paged cache
    (aiter's and flash-attn's): exact KV rows for a step and for drafting (host ints and the
    CPU copy of seq_lens only, upper bounds while drafting: no sync), rows bounded by the
    longest sequence a captured graph may replay for graph capture. Subclasses say how the
    backend's metadata is made from the common metadata and the row count (``make``)."""

    def make(self, common: CommonAttentionMetadata, num_kv_rows: int):
        raise NotImplementedError

    def build(self, common: CommonAttentionMetadata):
        return self.make(common, exact_kv_rows(common))

    def build_for_drafting(self, common: CommonAttentionMetadata, draft_index: int):
        return self.make(common, exact_kv_rows(common))

    def build_for_graph_capture(self, common: CommonAttentionMetadata):
        return self.make(common, bounded_kv_rows(common))


def gather_kv(cache: LayerKVCache, block_table: torch.Tensor, ctx: VarlenContext,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed context K/V ``[num_kv_rows, num_kv_heads, head_dim]`` in ``dtype``.

    block_table [batch_size, max_blocks_per_seq] int32. NHD and SPLIT_K caches are read in
    place; fp8 caches are dequantised (``stored * scale``) before the cast to ``dtype``.
    """
    block_size = cache.block_size
    max_blocks = block_table.shape[1]
    block_col = (ctx.kv_pos // block_size).clamp(max=max_blocks - 1)
    blocks = block_table[ctx.kv_req, block_col].long().clamp(min=0)  # [num_kv_rows]
    offsets = ctx.kv_pos % block_size
    key = _read_rows(cache.key, cache.layout, blocks, offsets, is_value=False)
    value = _read_rows(cache.value, cache.layout, blocks, offsets, is_value=True)
    return _dequantize(key, cache.k_scale, dtype), _dequantize(value, cache.v_scale, dtype)


def _read_rows(store: torch.Tensor, layout: str, blocks: torch.Tensor, offsets: torch.Tensor,
               is_value: bool) -> torch.Tensor:
    """[num_kv_rows, num_kv_heads, head_dim] rows of one cache tensor, in its storage dtype."""
    if layout == NHD:  # [num_blocks, block_size, num_kv_heads, head_dim]
        return store[blocks, offsets]
    # SPLIT_K: key [num_blocks, Hk, head_dim // x, block_size, x],
    #          value [num_blocks, Hk, block_size // x, head_dim, x]
    num_kv_heads, x = store.shape[1], store.shape[-1]
    head_dim = store.shape[3] if is_value else store.shape[2] * x
    b, o = blocks.view(-1, 1, 1), offsets.view(-1, 1, 1)
    h = torch.arange(num_kv_heads, device=store.device).view(1, -1, 1)
    d = torch.arange(head_dim, device=store.device).view(1, 1, -1)
    if is_value:
        return store[b, h, o // x, d, o % x]
    return store[b, h, d // x, o, d % x]


def _dequantize(rows: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return rows.to(dtype)
    # scale [1] (per tensor) or [num_kv_heads] (per head)
    return (rows.float() * scale.float().reshape(1, -1, 1)).to(dtype)
