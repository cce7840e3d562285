"""KV compaction after tree verification: the accepted path's K/V move to consecutive positions.

Contract (shared by the torch reference here, the Triton kernel and the HIP kernel, which are
bit-exact against each other). A request b had L = ``context_lens[b]`` tokens cached before the
step; the verification forward wrote the root at sequence index L and tree node i at L + 1 + i.
For d = 1 .. num_accepted[b], the accepted node ``accepted_nodes[b, d - 1]`` moves:

    sequence index L + 1 + accepted_nodes[b, d - 1]  ->  sequence index L + d

in the request's own blocks (slot = block_table[b, idx // block_size] * block_size +
idx % block_size), every KV head and head-dim element, key and value, both layouts, as raw
bytes (fp8 caches are not rescaled). A move is performed only when it is *valid*:

- d <= min(num_accepted[b], D) (D = accepted_nodes.shape[1]; -1 entries past the path and
  num_accepted <= 0 give no move), L >= 0;
- accepted_nodes[b, d - 1] >= d - 1: the source is at or after the destination. A BFS-ordered
  tree always satisfies it (a depth-d node has index >= d - 1, and a path's indices increase);
- both block-table columns are < max_blocks and both block ids are in [0, num_blocks): a
  block-table entry < 0 (or past the cache) touches nothing;
- source != destination (a no-op otherwise).

Semantics: every source is read before any destination is written. Why an in-order copy per
element (what the kernels do, with no barrier) gives exactly that: a valid move d writes
L + d and reads L + 1 + a >= L + d, while the earlier moves wrote only L + 1 .. L + d - 1 < L + d;
so no valid move reads a slot an earlier move wrote, and a slot read by move d and written by a
later move d' is read first, by the same thread that later writes it. Nothing outside the valid
moves' destination slots changes; entries past L + num_accepted are garbage afterwards
(overwritten by later steps). Block tables must not repeat a block id within a request.

Sync-free: no ``.item()`` / ``.tolist()`` / boolean indexing on device data.
"""
from __future__ import annotations

import torch

from rocdraft.backends.kv_cache import (FP8_DTYPES, KV_LAYOUTS, NHD, LayerKVCache, _element_index,
                                        check_cache_pair, kv_cache_shapes)

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32) + FP8_DTYPES
_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as same-sized integers (uint8 / int16 / int32): copies are raw bytes."""
    return t.view(_BITS_DTYPES[t.element_size()])


def _check_index_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, dims: int,
                        device: torch.device) -> None:
    if t.dim() != dims or t.dtype != dtype:
        raise ValueError(f"{name} must be a {dims}-D {dtype} tensor, got shape {tuple(t.shape)} "
                         f"{t.dtype}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the cache on {device}")


def check_compact_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, layout: str,
                     block_table: torch.Tensor, context_lens: torch.Tensor,
                     accepted_nodes: torch.Tensor, num_accepted: torch.Tensor,
                     block_size: int) -> None:
    """Raise ValueError naming the first bad argument of ``compact_kv`` (metadata only, so the
    fake impl of the op runs it too). Caches contiguous in ``layout``; block_table int32
    [>= B, max_blocks >= 1]; context_lens int32 [B]; accepted_nodes int64 [B, D];
    num_accepted int64 [B]."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"unknown KV layout {layout!r}; valid: {KV_LAYOUTS}")
    if key_cache.dtype not in CACHE_DTYPES or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"cache dtypes ({key_cache.dtype}, {value_cache.dtype}) must match and "
                         f"be one of {[str(d) for d in CACHE_DTYPES]}")
    if key_cache.dim() != (4 if layout == NHD else 5):
        raise ValueError(f"key_cache has shape {tuple(key_cache.shape)}, not a {layout} cache")
    if layout == NHD:
        num_blocks, cache_block_size, num_kv_heads, head_dim = key_cache.shape
    else:
        num_blocks, num_kv_heads, _, cache_block_size, _ = key_cache.shape
        head_dim = value_cache.shape[3] if value_cache.dim() == 5 else -1
    if block_size != cache_block_size:
        raise ValueError(f"block_size {block_size} does not match the cache's block size "
                         f"{cache_block_size}")
    expected = kv_cache_shapes(layout, num_blocks, cache_block_size, num_kv_heads,
                               max(head_dim, 1), key_cache.dtype)
    device = key_cache.device
    check_cache_pair(key_cache, value_cache, expected, layout, device)
    _check_index_tensor("accepted_nodes", accepted_nodes, torch.int64, 2, device)
    batch_size = accepted_nodes.shape[0]
    _check_index_tensor("block_table", block_table, torch.int32, 2, device)
    if block_table.shape[0] < batch_size or block_table.shape[1] < 1:
        raise ValueError(f"block_table must be [>= batch_size={batch_size}, >= 1], got "
                         f"{tuple(block_table.shape)}")
    for name, t, dtype in (("context_lens", context_lens, torch.int32),
                           ("num_accepted", num_accepted, torch.int64)):
        _check_index_tensor(name, t, dtype, 1, device)
        if t.shape[0] != batch_size:
            raise ValueError(f"{name} has {t.shape[0]} entries, accepted_nodes {batch_size} rows")


def compact_kv_moves(block_table: torch.Tensor, context_lens: torch.Tensor,
                     accepted_nodes: torch.Tensor, num_accepted: torch.Tensor, block_size: int,
                     num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The moves of the module docstring, flattened over (request, depth):
    -> (valid [B * D] bool, src_slot [B * D] int64, dst_slot [B * D] int64); slots of invalid
    moves are 0.

    Example, block_size 4, block_table [[7, 2]], L = 1, accepted_nodes [[1, 4, -1]],
    num_accepted [2]: move 1 is seq 3 -> 2 (slots 31 -> 30), move 2 is seq 6 -> 3
    (slots 10 -> 31) -> valid [T, T, F], src [31, 10, 0], dst [30, 31, 0].
    """
    batch_size, depth = accepted_nodes.shape
    max_blocks = block_table.shape[1]
    steps = torch.arange(depth, device=accepted_nodes.device).view(1, -1)  # d - 1
    nodes = accepted_nodes.long()
    base = context_lens.long().view(-1, 1) + 1
    valid = ((steps < num_accepted.long().view(-1, 1)) & (nodes >= steps)
             & (context_lens.view(-1, 1) >= 0))
    src, dst = base + nodes, base + steps
    valid &= src // block_size < max_blocks
    valid &= src != dst
    src, dst = torch.where(valid, src, 0), torch.where(valid, dst, 0)
    rows = block_table[:batch_size]
    src_block = rows.gather(1, src // block_size).long()
    dst_block = rows.gather(1, dst // block_size).long()
    for block in (src_block, dst_block):
        valid &= (block >= 0) & (block < num_blocks)
    src_slot = torch.where(valid, src_block * block_size + src % block_size, 0)
    dst_slot = torch.where(valid, dst_block * block_size + dst % block_size, 0)
    return valid.flatten(), src_slot.flatten(), dst_slot.flatten()


def compact_kv_reference(cache: LayerKVCache, block_table: torch.Tensor,
                         context_lens: torch.Tensor, accepted_nodes: torch.Tensor,
                         num_accepted: torch.Tensor, block_size: int) -> None:
    """Torch reference: gather every valid move's source rows, then scatter them to the
    destinations (raw bytes). block_table [>= B, max_blocks] int32, context_lens [B] int32,
    accepted_nodes [B, D] int64 (-1 after the path), num_accepted [B] int64.

    Sync-free like write_kv_reference: invalid moves are redirected to the first valid move's
    destination and carry its data (with no valid move, slot 0 is rewritten with its own bytes).
    """
    check_compact_kv(cache.key, cache.value, cache.layout, block_table, context_lens,
                     accepted_nodes, num_accepted, block_size)
    if accepted_nodes.numel() == 0:  # a static shape, not a device read
        return
    apply_kv_moves(cache, plan_kv_moves(block_table, context_lens, accepted_nodes, num_accepted,
                                        block_size, cache.num_blocks), block_size)


def plan_kv_moves(block_table: torch.Tensor, context_lens: torch.Tensor,
                  accepted_nodes: torch.Tensor, num_accepted: torch.Tensor, block_size: int,
                  num_blocks: int) -> tuple[torch.Tensor, ...]:
    """The moves of ``compact_kv_moves`` ready to apply to any layer of one cache group:
    -> (valid [M, 1, 1] bool, src_slot [M], target_slot [M] (invalid moves redirected to the
    first valid one's destination, else slot 0), anchor [1] (that first valid move's index),
    anchor_valid [1, 1, 1], anchor_target [1])."""
    valid, src_slot, dst_slot = compact_kv_moves(block_table, context_lens, accepted_nodes,
                                                 num_accepted, block_size, num_blocks)
    anchor = valid.int().argmax().view(1)
    anchor_valid = valid.index_select(0, anchor)
    target = torch.where(valid, dst_slot, torch.where(anchor_valid, dst_slot[anchor], 0))
    return (valid.view(-1, 1, 1), src_slot, target, anchor, anchor_valid.view(1, 1, 1),
            target.index_select(0, anchor))


def apply_kv_moves(cache: LayerKVCache, plan: tuple[torch.Tensor, ...], block_size: int
                   ) -> None:
    """Apply ``plan_kv_moves``'s moves to one layer (every source read before any write):
    float caches copy whole [Hk, D] slot rows (exact), fp8 ones go through integer views."""
    valid, src_slot, target, anchor, anchor_valid, anchor_target = plan
    for store, is_value in ((cache.key, False), (cache.value, True)):
        bits = bits_view(store) if store.dtype in FP8_DTYPES else store
        if cache.layout == NHD:
            num_kv_heads, head_dim = store.shape[2], store.shape[3]
        else:
            num_kv_heads, head_dim = store.shape[1], cache.value.shape[3]
        if cache.layout == NHD and bits.is_contiguous():  # a slot is one [Hk, D] row
            flat = bits.view(-1, num_kv_heads, head_dim)
            rows = flat.index_select(0, src_slot)  # [M, Hk, D]: every read first
            anchor_rows = torch.where(anchor_valid, rows.index_select(0, anchor),
                                      flat.index_select(0, anchor_target))
            flat.index_copy_(0, target, torch.where(valid, rows, anchor_rows))
            continue

        def index(slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return _element_index(cache.layout, bits, slots // block_size, slots % block_size,
                                  num_kv_heads, head_dim, is_value)

        rows = bits[index(src_slot)]  # [M, num_kv_heads, head_dim]: every read first
        anchor_rows = torch.where(anchor_valid, rows.index_select(0, anchor),
                                  bits[index(anchor_target)])
        bits[index(target)] = torch.where(valid, rows, anchor_rows)
