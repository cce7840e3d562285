"""Argument checks of the kernel ops: dtypes, shapes, strides and devices.

Every check raises ValueError naming the bad value and what is valid. They read only
metadata (shape, dtype, stride, device), so the fake implementations run them too.
"""
from __future__ import annotations

import torch

from rocdraft.backends.kv_cache import (FP8_DTYPES, KV_LAYOUTS, NHD, check_cache_pair,
                                        kv_cache_shapes)
from rocdraft.backends.kv_compact import check_compact_kv as _check_compact_kv_args

KV_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KV_CACHE_DTYPES = KV_INPUT_DTYPES + FP8_DTYPES


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Innermost stride 1, or empty: an empty tensor's strides carry no meaning (torch.where
    gives a [0, 1] tensor strides (1, 0)) and no kernel reads it."""
    return t.numel() == 0 or t.stride(-1) == 1


def _check_vector(name: str, t: torch.Tensor, dtype: torch.dtype, size: int | None = None,
                  device: torch.device | None = None) -> None:
    """``t`` must be a contiguous 1-D ``dtype`` tensor (of ``size`` entries, on ``device``)."""
    if t.dim() != 1 or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D {dtype} tensor, got shape "
                         f"{tuple(t.shape)} {t.dtype} strides {t.stride()}")
    if size is not None and t.shape[0] != size:
        raise ValueError(f"{name} has {t.shape[0]} entries, expected {size}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def check_write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                   layout: str) -> None:
    """key/value [>= num_tokens, num_kv_heads, head_dim] (head_dim contiguous, any row and
    head strides), caches contiguous in ``layout``, slot_mapping [num_tokens] int64,
    scales None or float32 [1] / [num_kv_heads]."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"unknown KV layout {layout!r}; valid: {KV_LAYOUTS}")
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_dim], "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if not (_rows_contiguous(key) and _rows_contiguous(value)):
        raise ValueError(f"key/value head_dim must be contiguous, got strides {key.stride()} "
                         f"and {value.stride()}")
    device = key.device
    _check_vector("slot_mapping", slot_mapping, torch.int64, device=device)
    if key.shape[0] < slot_mapping.shape[0]:
        raise ValueError(f"key has {key.shape[0]} rows but slot_mapping has "
                         f"{slot_mapping.shape[0]} slots")
    cache_dtype = key_cache.dtype
    if cache_dtype not in KV_CACHE_DTYPES or value_cache.dtype != cache_dtype:
        raise ValueError(f"cache dtypes ({key_cache.dtype}, {value_cache.dtype}) must match "
                         f"and be one of {KV_CACHE_DTYPES}")
    if value.dtype != key.dtype:
        raise ValueError(f"key dtype {key.dtype} != value dtype {value.dtype}")
    if cache_dtype in FP8_DTYPES:
        if key.dtype not in KV_INPUT_DTYPES:
            raise ValueError(f"an {cache_dtype} cache takes keys in {KV_INPUT_DTYPES}, "
                             f"got {key.dtype}")
    elif key.dtype != cache_dtype:
        raise ValueError(f"key dtype {key.dtype} must equal the cache dtype {cache_dtype} "
                         f"(only fp8 caches convert)")
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    if key_cache.dim() != (4 if layout == NHD else 5):
        raise ValueError(f"key_cache has shape {tuple(key_cache.shape)}, not a {layout} cache")
    block_size = key_cache.shape[1] if layout == NHD else key_cache.shape[3]
    expected = kv_cache_shapes(layout, key_cache.shape[0], block_size, num_kv_heads, head_dim,
                               cache_dtype)
    check_cache_pair(key_cache, value_cache, expected, layout, device,
                     f", {num_kv_heads} kv heads, head_dim {head_dim}")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        _check_vector(name, scale, torch.float32, device=device)
        if scale.shape[0] not in (1, num_kv_heads):
            raise ValueError(f"{name} has {scale.shape[0]} entries; valid: 1 (per tensor) or "
                             f"num_kv_heads = {num_kv_heads} (per head)")


def check_compact_kv(key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_table: torch.Tensor, context_lens: torch.Tensor,
                     accepted_nodes: torch.Tensor, num_accepted: torch.Tensor, layout: str,
                     block_size: int) -> None:
    """Caches contiguous in ``layout`` (any cache dtype, copied as raw bytes), block_table
    int32 [>= B, >= 1] (rows may be strided), context_lens int32 [B], accepted_nodes int64
    [B, D] (rows may be strided), num_accepted int64 [B]; see backends.kv_compact."""
    _check_compact_kv_args(key_cache, value_cache, layout, block_table, context_lens,
                           accepted_nodes, num_accepted, block_size)

def check_advance_draft_step(positions: torch.Tensor, seq_lens: torch.Tensor,
                             block_table: torch.Tensor, clamped_positions: torch.Tensor,
                             slot_mapping: torch.Tensor, block_size: int,
                             max_model_len: int) -> None:
    """positions [batch_size] int64, seq_lens [batch_size] int32, block_table
    [>= batch_size, max_blocks_per_seq >= 1] int32 (rows may be strided),
    clamped_positions / slot_mapping [batch_size] int64 outputs."""
    batch_size, device = positions.shape[0] if positions.dim() == 1 else -1, positions.device
    _check_vector("positions", positions, torch.int64)
    _check_vector("seq_lens", seq_lens, torch.int32, batch_size, device)
    _check_vector("clamped_positions", clamped_positions, torch.int64, batch_size, device)
    _check_vector("slot_mapping", slot_mapping, torch.int64, batch_size, device)
    if (block_table.dim() != 2 or block_table.dtype != torch.int32
            or block_table.shape[0] < batch_size or block_table.shape[1] < 1
            or not _rows_contiguous(block_table) or block_table.device != device):
        raise ValueError(f"block_table must be int32 [>= {batch_size}, >= 1] with contiguous "
                         f"rows on {device}, got {tuple(block_table.shape)} {block_table.dtype} "
                         f"strides {block_table.stride()} on {block_table.device}")
    if block_size <= 0 or max_model_len <= 0:
        raise ValueError(f"block_size ({block_size}) and max_model_len ({max_model_len}) "
                         f"must be positive")


def check_prepare_padded_drafting(sampled: torch.Tensor, discard_request: torch.Tensor,
                                  backup_next_token_ids: torch.Tensor, vocab_size: int,
                                  query_start_loc: torch.Tensor,
                                  num_draft_tokens: torch.Tensor) -> None:
    """sampled [batch_size, k + 1] int64 (rows may be strided), discard_request [batch_size]
    bool, backup_next_token_ids [batch_size] int64, query_start_loc [batch_size + 1] int32,
    num_draft_tokens [batch_size] int32."""
    if sampled.dim() != 2 or sampled.dtype != torch.int64 or not _rows_contiguous(sampled):
        raise ValueError(f"sampled must be int64 [batch_size, k + 1] with contiguous rows, got "
                         f"{tuple(sampled.shape)} {sampled.dtype} strides {sampled.stride()}")
    batch_size, device = sampled.shape[0], sampled.device
    _check_vector("discard_request", discard_request, torch.bool, batch_size, device)
    _check_vector("backup_next_token_ids", backup_next_token_ids, torch.int64, batch_size, device)
    _check_vector("query_start_loc", query_start_loc, torch.int32, batch_size + 1, device)
    _check_vector("num_draft_tokens", num_draft_tokens, torch.int32, batch_size, device)
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
