"""Triton unified paged attention against TORCH_SDPA's ``paged_attention_reference``: ragged
batches mixing prefill chunks, decodes and multi-token queries, GQA group sizes, block sizes,
fp8 caches with per-tensor and per-head scales, spec_mask (chain and tree), non-causal,
every declared head size, upper-bound metadata and graph-padding tokens."""
from __future__ import annotations

import pytest
import torch

from device_helpers import require_fp8_cache_here
from rocdraft.backends.kv_cache import (FP8_DTYPES, SPLIT_K, allocate_kv_cache,
                                        write_kv_reference)
from rocdraft.backends.metadata import CommonAttentionMetadata
from rocdraft.backends.torch_sdpa import TorchSDPABuilder, paged_attention_reference
from rocdraft.backends.triton_attn import HEAD_SIZE_MULTIPLE, MAX_HEAD_SIZE
from rocdraft.backends.triton_kernels.unified_attention import launch_config, unified_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_batch(query_lens, context_lens, *, block_size=16, num_heads=4, num_kv_heads=2,
               head_dim=32, dtype=torch.float16, cache_dtype=None, num_padding_tokens=2,
               seed=0):
    """(query [num_tokens, num_heads, head_dim], cache, common) with random cache contents,
    blocks scattered over the cache, and ``num_padding_tokens`` graph-padding rows."""
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_seq + [1]) + 1
    num_blocks = sum(blocks_per_seq) + 3
    ids = torch.randperm(num_blocks, generator=g).int()
    block_table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_table[i, :n] = ids[used:used + n]
        used += n
    cache = allocate_kv_cache(1, num_blocks, block_size, num_kv_heads, head_dim, cache_dtype,
                              DEVICE, kv_scale=0.05)[0]
    every_slot = torch.arange(num_blocks * block_size, device=DEVICE)
    kv = torch.randn(2, num_blocks * block_size, num_kv_heads, head_dim, generator=g)
    write_kv_reference(kv[0].to(DEVICE), kv[1].to(DEVICE), cache, every_slot)
    query_start_loc = [0]
    for q in query_lens:
        query_start_loc.append(query_start_loc[-1] + q)
    num_tokens = query_start_loc[-1] + num_padding_tokens
    query = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64)
    common = CommonAttentionMetadata.from_cpu(query_start_loc, seq_lens, block_table,
                                              slot_mapping, DEVICE)
    return query, cache, common


def gpu_tiling(query, cache, common):
    """The launch config a GPU would use (the interpreter otherwise takes the big tiles)."""
    group = query.shape[1] // cache.key.shape[2]
    return launch_config(query.shape[0], common.num_reqs, common.max_query_len, group,
                         query.shape[2], interpreted=False)


def assert_matches_reference(query, cache, common, scale=0.3, tiling="auto"):
    launch = gpu_tiling(query, cache, common) if tiling == "gpu" else None
    out = unified_attention(query, cache, common, scale, launch)
    ref = paged_attention_reference(query, cache, TorchSDPABuilder().build(common), scale)
    assert out.shape == query.shape and out.dtype == query.dtype
    real = common.num_actual_tokens
    tol = TOLERANCE[query.dtype]
    torch.testing.assert_close(out[:real].float(), ref[:real].to(query.dtype).float(),
                               atol=tol, rtol=tol)
    assert bool(out[real:].float().isfinite().all())  # graph padding rows
    return out


@pytest.mark.parametrize("tiling", ["auto", "gpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5])
def test_mixed_prefill_decode_and_multi_token(dtype, block_size, tiling):
    # decode, prefill from scratch, verify 1 + 2 drafts, long-context decode, chunked prefill
    query, cache, common = make_batch([1, 9, 3, 1, 4], [7, 0, 12, 30, 2], dtype=dtype,
                                      block_size=block_size)
    assert_matches_reference(query, cache, common, tiling=tiling)


@pytest.mark.parametrize("tiling", ["auto", "gpu"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (8, 1)])
def test_gqa_group_sizes(num_heads, num_kv_heads, tiling):
    query, cache, common = make_batch([1, 5, 2], [4, 3, 17], num_heads=num_heads,
                                      num_kv_heads=num_kv_heads)
    assert_matches_reference(query, cache, common, tiling=tiling)


def test_gpu_tiling_of_decode_batches():
    """Decode-only batches: 16-row programs, several programs per request group."""
    query, cache, common = make_batch([1, 1, 1, 1, 1], [3, 40, 17, 0, 9], num_heads=4,
                                      num_kv_heads=1, seed=8)
    cfg = gpu_tiling(query, cache, common)
    assert (cfg.block_q, cfg.block_m) == (4, 16)
    assert_matches_reference(query, cache, common, tiling="gpu")


@pytest.mark.parametrize("tiling", ["auto", "gpu"])
def test_long_prefill(tiling):
    # Several query blocks per request; on a GPU max_query_len * group > 16 takes 64 rows.
    query, cache, common = make_batch([37, 1, 70], [10, 20, 0], block_size=8, seed=1)
    assert_matches_reference(query, cache, common, tiling=tiling)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_cache(cache_dtype, per_head):
    require_fp8_cache_here(cache_dtype)
    query, cache, common = make_batch([1, 4, 2], [6, 0, 19], dtype=torch.bfloat16,
                                      cache_dtype=cache_dtype, seed=2)
    if per_head:
        cache.k_scale = torch.tensor([0.02, 0.09], device=DEVICE)
        cache.v_scale = torch.tensor([0.5, 0.03], device=DEVICE)
    assert_matches_reference(query, cache, common)


def _tree_mask() -> torch.Tensor:
    """Node i sees its ancestors and itself. Parents: 0 <- 1, 0 <- 2, 1 <- 3, 2 <- 4."""
    parents = [-1, 0, 0, 1, 2]
    mask = torch.zeros(5, 5, dtype=torch.bool)
    for i in range(5):
        node = i
        while node >= 0:
            mask[i, node] = True
            node = parents[node]
    return mask


@pytest.mark.parametrize("tiling", ["auto", "gpu"])
@pytest.mark.parametrize("mask_kind", ["chain", "tree"])
def test_spec_mask(mask_kind, tiling):
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool)) if mask_kind == "chain" \
        else _tree_mask()
    # Requests whose last 5 query tokens are speculative, one shorter query, one decode.
    query, cache, common = make_batch([5, 6, 2, 1], [3, 11, 20, 8], seed=3)
    common = common.with_updates(spec_mask=mask.to(DEVICE))
    out = assert_matches_reference(query, cache, common, tiling=tiling)
    if mask_kind == "tree":  # the mask changed the answer: it is not just causal
        plain = unified_attention(query, cache, common.with_updates(spec_mask=None), 0.3)
        assert not torch.allclose(out[:5].float(), plain[:5].float(), atol=1e-2)


def _random_tree_masks(num_reqs: int, num_spec: int, seed: int) -> torch.Tensor:
    """[num_reqs, S, S]: a different random tree (parents[i] < i) per request."""
    g = torch.Generator().manual_seed(seed)
    masks = torch.zeros(num_reqs, num_spec, num_spec, dtype=torch.bool)
    for b in range(num_reqs):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, num_spec)]
        for i in range(num_spec):
            node = i
            while node >= 0:
                masks[b, i, node] = True
                node = parents[node]
    return masks


# S = 6 over a ragged batch: q < S (a tree level), q == S, q > S, a decode, no context.
TREE_QUERY_LENS, TREE_CONTEXT_LENS = [2, 6, 8, 1, 6], [7, 4, 3, 10, 0]


@pytest.mark.parametrize("tiling", ["auto", "gpu"])
@pytest.mark.parametrize("heads", [(4, 2), (6, 1)], ids=["gqa2", "gqa6"])
def test_per_request_spec_masks(heads, tiling):
    query, cache, common = make_batch(TREE_QUERY_LENS, TREE_CONTEXT_LENS, num_heads=heads[0],
                                      num_kv_heads=heads[1], num_padding_tokens=3, seed=8)
    masks = _random_tree_masks(len(TREE_QUERY_LENS), 6, seed=8).to(DEVICE)
    out = assert_matches_reference(query, cache, common.with_updates(spec_mask=masks),
                                   tiling=tiling)
    real = common.num_actual_tokens
    assert not out[real:].any()  # graph padding rows stay 0
    # Each request used its own tree: request 1's tree for everyone changes the answer.
    shared = unified_attention(query, cache, common.with_updates(spec_mask=masks[1]), 0.3)
    assert not torch.allclose(out[:real].float(), shared[:real].float(), atol=1e-2)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_per_request_spec_masks_with_fp8_cache(cache_dtype):
    require_fp8_cache_here(cache_dtype)
    query, cache, common = make_batch(TREE_QUERY_LENS, TREE_CONTEXT_LENS,
                                      dtype=torch.bfloat16, cache_dtype=cache_dtype, seed=9)
    masks = _random_tree_masks(len(TREE_QUERY_LENS), 6, seed=9).to(DEVICE)
    assert_matches_reference(query, cache, common.with_updates(spec_mask=masks))


def test_shared_mask_equals_every_per_request_form():
    """Shared [S, S], a per-request copy, a stride-0 expanded view and a column-major copy
    all give bit-identical outputs (the kernel honours the batch and row/column strides)."""
    query, cache, common = make_batch(TREE_QUERY_LENS, TREE_CONTEXT_LENS, seed=10)
    mask = _random_tree_masks(1, 6, seed=10)[0].to(DEVICE)
    num_reqs = len(TREE_QUERY_LENS)
    shared = unified_attention(query, cache, common.with_updates(spec_mask=mask), 0.3)
    column_major = mask.expand(num_reqs, 6, 6).transpose(1, 2).contiguous().transpose(1, 2)
    for form in (mask.expand(num_reqs, 6, 6).clone(), mask.expand(num_reqs, 6, 6),
                 column_major):
        out = unified_attention(query, cache, common.with_updates(spec_mask=form), 0.3)
        assert torch.equal(out, shared)


def test_non_causal():
    query, cache, common = make_batch([3, 1, 4], [2, 5, 0], seed=4)
    assert_matches_reference(query, cache, common.with_updates(causal=False))


# The rule's ends, powers of two and sizes the kernels pad (48 -> 64, 80/96/112 -> 128).
RULE_HEAD_SIZES = (HEAD_SIZE_MULTIPLE, 32, 48, 64, 80, 96, 112, 128, MAX_HEAD_SIZE)


@pytest.mark.parametrize("head_dim", RULE_HEAD_SIZES)
def test_head_sizes_of_the_declared_rule(head_dim):
    query, cache, common = make_batch([1, 3], [5, 2], num_heads=2, num_kv_heads=1,
                                      head_dim=head_dim, seed=5)
    assert_matches_reference(query, cache, common, scale=head_dim ** -0.5)


def test_upper_bound_metadata_and_empty_padded_requests():
    """Drafting passes upper bounds for max_query_len / max_seq_len and graph buckets add
    requests with no query tokens: the result on real tokens is unchanged."""
    query, cache, common = make_batch([2, 1, 0, 0], [6, 13, 1, 1], seed=6)
    exact = assert_matches_reference(query, cache, common)
    loose = unified_attention(query, cache, common.with_updates(
        max_query_len=common.max_query_len + 5, max_seq_len=common.max_seq_len + 40), 0.3)
    assert torch.equal(exact[:common.num_actual_tokens], loose[:common.num_actual_tokens])


def test_strided_query_from_fused_qkv():
    query, cache, common = make_batch([3, 1], [4, 9], seed=7)
    fused = torch.cat([query, torch.randn_like(query)], dim=1)  # [num_tokens, 2 * heads, dim]
    strided = fused[:, :query.shape[1]]
    assert not strided.is_contiguous()
    assert torch.equal(unified_attention(strided, cache, common, 0.3),
                       unified_attention(query, cache, common, 0.3))


@pytest.mark.parametrize("case", ["layout", "spec_mask", "head_dim", "query_start_loc"])
def test_checked_wrapper_rejects_bad_arguments(case):
    query, cache, common = make_batch([1], [3], num_padding_tokens=0)
    if case == "layout":
        cache.layout = SPLIT_K
    elif case == "spec_mask":
        with pytest.raises(ValueError, match=r"spec_mask.*shape \[2, 3\]"):  # the metadata
            common.with_updates(spec_mask=torch.ones(2, 3, dtype=torch.bool))
        common = common.with_updates(spec_mask=torch.ones(1, 1, dtype=torch.bool,
                                                          device="meta"))  # wrong device
    elif case == "head_dim":
        query = query[..., :16].contiguous()
    else:
        common = common.with_updates(query_start_loc=common.query_start_loc.long())
    with pytest.raises(ValueError, match=case if case != "layout" else "NHD"):
        unified_attention(query, cache, common, 0.3)
