"""TORCH_SDPA: the reference attention backend, the oracle every other backend is tested against.

Any mix of prefill chunks, decodes and multi-token queries in one batch; causal relative to
each request's cached context; GQA; K/V read from the paged cache (NHD or SPLIT_K, fp8
dequantised); the optional tree ``spec_mask`` (shared [S, S] or per request [B, S, S]; the
row rule is in backends/metadata.py). Clarity beats speed:
queries are padded to ``[batch_size, max_query_len]`` and keys gathered to
``[batch_size, max_seq_len]``, all on the device without host reads, so it is graph-safe.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rocdraft.backends.base import (AttentionBackend, AttentionImpl, BackendCapabilities,
                                    GraphCapture, MetadataBuilder)
from rocdraft.backends.kv_cache import (FP8_DTYPES, KV_LAYOUTS, LayerKVCache, read_kv_nhd,
                                        write_kv_reference)
from rocdraft.backends.metadata import CommonAttentionMetadata, token_layout
from rocdraft.backends.registry import register_backend


@dataclass(frozen=True)
class TorchSDPAMetadata:
    common: CommonAttentionMetadata
    token_req: torch.Tensor  # [num_tokens] request row of each token (batch_size = padding)
    token_index: torch.Tensor  # [num_tokens] index of the token within its request's query
    token_position: torch.Tensor  # [num_tokens] absolute position of the token


class TorchSDPABuilder(MetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        req, index, position = token_layout(common.query_start_loc, common.seq_lens,
                                            common.slot_mapping.shape[0])
        return TorchSDPAMetadata(common, req, index, position)

    def build_for_drafting(self, common: CommonAttentionMetadata,
                           draft_index: int) -> TorchSDPAMetadata:
        """Draft steps have one query token per request: token i is request i at position
        seq_lens[i] - 1 (3 ops, no search). Other shapes take the general path."""
        num_tokens = common.slot_mapping.shape[0]
        if common.max_query_len == 1 and common.num_reqs == num_tokens:
            req = torch.arange(num_tokens, device=common.seq_lens.device)
            return TorchSDPAMetadata(common, req, torch.zeros_like(req), common.seq_lens - 1)
        return self.build(common)


def paged_attention_reference(query: torch.Tensor, cache: LayerKVCache,
                              meta: TorchSDPAMetadata, scale: float) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim] (float32)."""
    common = meta.common
    num_tokens, num_heads, head_dim = query.shape
    batch_size, max_q, max_s = common.num_reqs, max(common.max_query_len, 1), max(
        common.max_seq_len, 1)
    key_nhd, value_nhd = read_kv_nhd(cache)  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_size, num_kv_heads = key_nhd.shape[1], key_nhd.shape[2]

    # Gather every request's keys for positions 0..max_s-1: [batch_size, max_s, Hk, D].
    key_pos = torch.arange(max_s, device=query.device)
    max_blocks = common.block_table.shape[1]
    block_col = (key_pos // block_size).clamp(max=max_blocks - 1)
    blocks = common.block_table[:, block_col].long().clamp(min=0)  # [batch_size, max_s]
    keys = key_nhd[blocks, key_pos % block_size]
    values = value_nhd[blocks, key_pos % block_size]
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hk, max_s, D]

    # Scatter the queries into [batch_size + 1, max_q + 1, Hq, D]; the extra row/column is
    # scratch for graph-padding tokens.
    req = meta.token_req
    idx = meta.token_index.clamp(max=max_q)
    padded_q = query.new_zeros(batch_size + 1, max_q + 1, num_heads, head_dim, dtype=torch.float32)
    padded_q[req, idx] = query.float()
    q_pos = torch.full((batch_size + 1, max_q + 1), -1, dtype=meta.token_position.dtype,
                       device=query.device)
    q_pos[req, idx] = meta.token_position
    padded_q, q_pos = padded_q[:batch_size], q_pos[:batch_size]

    seq_lens = common.seq_lens.long().view(-1, 1, 1)
    visible = key_pos.view(1, 1, -1) < seq_lens  # [B, 1, max_s]
    if common.causal:
        visible = visible & (key_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1))  # [B, max_q+1, max_s]
    if common.spec_mask is not None:
        visible = visible & spec_mask_visibility(common, q_pos, key_pos, max_q + 1)
    # softmax(q k^T * scale, masked) v; a row that sees no key (padding) gives NaN -> 0.
    # GQA: query head h reads kv head h // (num_heads // num_kv_heads).
    out = F.scaled_dot_product_attention(padded_q.transpose(1, 2), keys, values,
                                         attn_mask=visible.unsqueeze(1), scale=scale,
                                         enable_gqa=num_heads != num_kv_heads)
    out = out.transpose(1, 2).nan_to_num(0.0)  # [B, max_q + 1, Hq, D]
    out = torch.cat([out, out.new_zeros(1, *out.shape[1:])], dim=0)
    return out[req, idx]


def spec_mask_visibility(common: CommonAttentionMetadata, q_pos: torch.Tensor,
                         key_pos: torch.Tensor, width: int) -> torch.Tensor:
    """The tree-mask term of the visibility (the rule in backends/metadata.py).

    q_pos [B, width] (absolute position of each padded query row, -1 for rows past the
    query), key_pos [max_s] -> [B, width, max_s] bool. With ``first = seq_lens[b] - S``, the
    query at position p has mask row ``p - first`` (``S - q + j`` for query token j) and sees
    key k >= first only where ``mask_b[p - first, k - first]``, ``mask_b`` being the shared
    [S, S] mask or ``spec_mask[b]`` of a per-request [B, S, S] one; everything before the
    last S positions (as query or key) is left to the causal / length rules."""
    mask = common.spec_mask
    num_spec = mask.shape[-1]
    batch_size = q_pos.shape[0]
    if mask.dim() == 2:
        mask = mask.expand(batch_size, num_spec, num_spec)  # a view: no copy
    first_spec = common.seq_lens.long().view(-1, 1, 1) - num_spec  # [B, 1, 1]
    qi = q_pos.unsqueeze(-1) - first_spec  # [B, width, 1]
    kj = key_pos.view(1, 1, -1) - first_spec  # [B, 1, max_s]
    in_spec = (qi >= 0) & (kj >= 0)
    req = torch.arange(batch_size, device=q_pos.device).view(-1, 1, 1)
    allowed = mask[req, qi.clamp(0, num_spec - 1), kj.clamp(0, num_spec - 1)]
    return ~in_spec | allowed


class TorchSDPAImpl(AttentionImpl):
    def forward(self, query, key, value, kv_cache: LayerKVCache, metadata: TorchSDPAMetadata):
        write_kv_reference(key, value, kv_cache, metadata.common.slot_mapping)
        out = paged_attention_reference(query, kv_cache, metadata, self.scale)
        return out.to(query.dtype)


@register_backend
class TorchSDPABackend(AttentionBackend):
    name = "TORCH_SDPA"
    metadata_cls = TorchSDPAMetadata
    builder_cls = TorchSDPABuilder
    impl_cls = TorchSDPAImpl
    capabilities = BackendCapabilities(
        multi_token_drafting=True, tree_drafting=True, graph_capture=GraphCapture.FULL,
        kv_layouts=KV_LAYOUTS, block_size_multiple=1,
        dtypes=(torch.float32, torch.float16, torch.bfloat16), head_sizes=None,  # any
        platforms=("cpu", "cuda", "rocm"),
        # torch casts to and from both fp8 formats on every device (no fp8 kernels involved).
        kv_cache_dtypes=FP8_DTYPES, gathers_kv=True)
