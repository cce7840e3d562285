"""Paged KV cache: layouts, allocation, slot mapping and the torch reference KV write.

Layouts (one key tensor and one value tensor per attention layer):

- ``NHD``: key and value ``[num_blocks, block_size, num_kv_heads, head_dim]``.
- ``SPLIT_K`` (aiter's ``pa_fwd_asm`` layout), with ``x = 16 bytes // element_size``:
  key ``[num_blocks, num_kv_heads, head_dim // x, block_size, x]``,
  value ``[num_blocks, num_kv_heads, block_size // x, head_dim, x]``.
  Token (block b, offset o), head h, dim d lives at key[b, h, d // x, o, d % x] and
  value[b, h, o // x, d, o % x].

A slot is ``block_id * block_size + offset``; ``PADDING_SLOT_ID`` (-1) marks a token whose
K/V must not be written (graph padding, drafts past ``max_model_len``).

fp8 caches store ``(x / scale).to(fp8)`` and read back ``stored.float() * scale``; a scale is
a float32 tensor of shape ``[1]`` (per tensor) or ``[num_kv_heads]`` (per head).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PADDING_SLOT_ID = -1
NHD = "NHD"
SPLIT_K = "SPLIT_K"
KV_LAYOUTS = (NHD, SPLIT_K)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def split_k_x(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector in aiter's split-K layout (8 for fp16/bf16, 16 for fp8)."""
    return 16 // torch.empty((), dtype=dtype).element_size()


@dataclass
class LayerKVCache:
    """The paged K/V of one attention layer (tensors are mutated in place by KV writes)."""

    key: torch.Tensor
    value: torch.Tensor
    layout: str = NHD
    k_scale: torch.Tensor | None = None  # [1] or [num_kv_heads] float32, fp8 caches only
    v_scale: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.key.shape[1] if self.layout == NHD else self.key.shape[3]

    @property
    def num_blocks(self) -> int:
        return self.key.shape[0]

    @property
    def is_fp8(self) -> bool:
        return self.key.dtype in FP8_DTYPES


def kv_cache_shapes(layout: str, num_blocks: int, block_size: int, num_kv_heads: int,
                    head_dim: int, dtype: torch.dtype) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(key shape, value shape) of one layer's cache in ``layout``."""
    if layout == NHD:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return shape, shape
    if layout == SPLIT_K:
        x = split_k_x(dtype)
        if head_dim % x or block_size % x:
            raise ValueError(f"SPLIT_K layout needs head_dim ({head_dim}) and block_size "
                             f"({block_size}) to be multiples of x={x} for {dtype}")
        return ((num_blocks, num_kv_heads, head_dim // x, block_size, x),
                (num_blocks, num_kv_heads, block_size // x, head_dim, x))
    raise ValueError(f"unknown KV layout {layout!r}; valid: {KV_LAYOUTS}")


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor,
                     expected: tuple[tuple[int, ...], tuple[int, ...]], layout: str,
                     device: torch.device, detail: str = "") -> None:
    """Kernel-argument check: key/value caches have the ``expected`` shapes (from
    ``kv_cache_shapes``), are contiguous and on ``device``; a ValueError naming the cache,
    its shape and the layout (plus ``detail``) otherwise."""
    for name, cache, shape in (("key_cache", key_cache, expected[0]),
                               ("value_cache", value_cache, expected[1])):
        if tuple(cache.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(cache.shape)}, expected {shape} for "
                             f"layout {layout}{detail}")
        if not cache.is_contiguous() or cache.device != device:
            raise ValueError(f"{name} must be contiguous and on {device}")


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device | str,
                      layout: str = NHD, kv_scale: float = 1.0) -> list[LayerKVCache]:
    """Zeroed caches for ``num_layers`` layers in ``layout``; fp8 caches get per-tensor scales."""
    key_shape, value_shape = kv_cache_shapes(layout, num_blocks, block_size, num_kv_heads,
                                             head_dim, dtype)
    caches = []
    for _ in range(num_layers):
        scale = None
        if dtype in FP8_DTYPES:
            scale = torch.full((1,), kv_scale, dtype=torch.float32, device=device)
        caches.append(LayerKVCache(
            key=torch.zeros(key_shape, dtype=dtype, device=device),
            value=torch.zeros(value_shape, dtype=dtype, device=device),
            layout=layout, k_scale=scale, v_scale=None if scale is None else scale.clone()))
    return caches


def compute_slot_mapping(block_table: torch.Tensor, req_indices: torch.Tensor,
                         positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot of each token: ``block_table[req, pos // block_size] * block_size + pos % block_size``.

    block_table [batch_size, max_blocks_per_seq] int32, req_indices [num_tokens] (row of each
    token's request), positions [num_tokens] -> slots [num_tokens] int64. A token whose
    position is negative gets ``PADDING_SLOT_ID``.

    Example, block_size 4, block_table [[7, 2], [5, 0]]:
    req_indices [0, 0, 0, 1], positions [2, 3, 4, 1] -> slots [30, 31, 8, 21].
    """
    padding = positions < 0
    safe_pos = positions.clamp(min=0).long()
    block_ids = block_table[req_indices.long(), safe_pos // block_size].long()
    slots = block_ids * block_size + safe_pos % block_size
    return slots.masked_fill(padding, PADDING_SLOT_ID)


def _scale_for(scale: torch.Tensor | None, num_kv_heads: int, like: torch.Tensor) -> torch.Tensor:
    if scale is None:
        return torch.ones(1, 1, 1, dtype=torch.float32, device=like.device)
    return scale.float().reshape(-1, 1).expand(num_kv_heads, 1).reshape(1, num_kv_heads, 1)


def quantize_for_cache(x: torch.Tensor, cache_dtype: torch.dtype,
                       scale: torch.Tensor | None) -> torch.Tensor:
    """[num_tokens, num_kv_heads, head_dim] -> cache dtype (fp8: divided by scale, saturated)."""
    if cache_dtype in FP8_DTYPES:
        finfo = torch.finfo(cache_dtype)
        scaled = x.float() / _scale_for(scale, x.shape[1], x)
        return scaled.clamp(finfo.min, finfo.max).to(cache_dtype)
    return x.to(cache_dtype)


def write_kv_reference(key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache,
                       slot_mapping: torch.Tensor) -> None:
    """Torch reference KV write: scatter each token's K/V to its slot; slots < 0 are skipped.

    key/value [>= num_tokens, num_kv_heads, head_dim] (may be longer than slot_mapping when
    padded for graphs, may be strided views of a fused qkv), slot_mapping [num_tokens]. The
    token count comes from slot_mapping.

    Sync-free (no ``nonzero`` / boolean indexing): padding rows are redirected to the slot of
    the first valid row and carry that row's data, so every write to a slot is the same value.
    With no valid row at all, they rewrite slot 0 with its current contents.
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:  # a static shape, not a device read: nothing to write
        return
    slots = slot_mapping.long()
    valid = slots >= 0
    # First valid row (0 when none is valid); 1-element index tensors, never a Python int.
    anchor = valid.int().argmax().view(1)
    anchor_valid = valid.index_select(0, anchor)
    anchor_slot = torch.where(anchor_valid, slots.index_select(0, anchor), 0)
    target = torch.where(valid, slots, anchor_slot)
    blocks, offsets = target // cache.block_size, target % cache.block_size
    for new, store, scale in ((key, cache.key, cache.k_scale), (value, cache.value, cache.v_scale)):
        rows = quantize_for_cache(new[:num_tokens], store.dtype, scale)
        if cache.layout == NHD and store.is_contiguous() and store.dtype not in FP8_DTYPES:
            # A slot is one row of the [num_slots, Hk, D] view: copy whole rows.
            flat = store.view(-1, rows.shape[1], rows.shape[2])
            current_anchor = flat.index_select(0, anchor_slot)  # [1, Hk, D]
            anchor_row = torch.where(anchor_valid.view(1, 1, 1), rows.index_select(0, anchor),
                                     current_anchor)
            flat.index_copy_(0, target, torch.where(valid.view(-1, 1, 1), rows, anchor_row))
            continue
        index = _element_index(cache.layout, store, blocks, offsets, rows.shape[1], rows.shape[2],
                               is_value=store is cache.value)
        current = store[index]  # [num_tokens, num_kv_heads, head_dim]
        anchor_row = torch.where(anchor_valid.view(1, 1, 1), rows.index_select(0, anchor),
                                 current.index_select(0, anchor))  # [1, Hk, D]
        store[index] = torch.where(valid.view(-1, 1, 1), rows, anchor_row)


def _element_index(layout: str, store: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                   num_kv_heads: int, head_dim: int, is_value: bool) -> tuple[torch.Tensor, ...]:
    """Advanced-index tuple addressing [num_tokens, num_kv_heads, head_dim] elements of a cache."""
    b, o = blocks.view(-1, 1, 1), offsets.view(-1, 1, 1)
    h = torch.arange(num_kv_heads, device=blocks.device).view(1, -1, 1)
    d = torch.arange(head_dim, device=blocks.device).view(1, 1, -1)
    if layout == NHD:
        return b, o, h, d
    x = store.shape[-1]
    if is_value:  # [num_blocks, num_kv_heads, block_size // x, head_dim, x]
        return b, h, o // x, d, o % x
    return b, h, d // x, o, d % x  # key: [num_blocks, num_kv_heads, head_dim // x, block_size, x]


def read_kv_nhd(cache: LayerKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache as float32 NHD views ``[num_blocks, block_size, num_kv_heads, head_dim]``,
    dequantised when fp8. Used by reference attention and by tests."""
    if cache.layout == NHD:
        key, value = cache.key, cache.value
    else:
        nb, nh, dx, bs, x = cache.key.shape
        key = cache.key.permute(0, 3, 1, 2, 4).reshape(nb, bs, nh, dx * x)
        value = cache.value.permute(0, 2, 4, 1, 3).reshape(nb, bs, nh, cache.value.shape[3])
    key, value = key.float(), value.float()
    if cache.k_scale is not None:
        key = key * cache.k_scale.float().reshape(1, 1, -1, 1)
    if cache.v_scale is not None:
        value = value * cache.v_scale.float().reshape(1, 1, -1, 1)
    return key, value
