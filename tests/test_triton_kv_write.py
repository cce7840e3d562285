"""Triton paged KV write against ``write_kv_reference``: bit-exact cache bytes for every cache
dtype x layout x scale mode, strided (fused qkv) inputs, padding slots, keys longer than
slot_mapping, rounding ties and saturation; plus the checked wrapper's errors.
Runs under TRITON_INTERPRET=1 on the CPU (conftest.py sets it)."""
from __future__ import annotations

import pytest
import torch

from device_helpers import require_fp8_cache_here
from rocdraft.backends.kv_cache import (FP8_DTYPES, NHD, SPLIT_K, LayerKVCache,
                                        allocate_kv_cache, write_kv_reference)
from rocdraft.backends.triton_kernels.kv_write import write_kv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 4, 16, 2, 16


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16) \
        if t.element_size() == 2 else t.view(torch.int32)


def _cache_pair(layout: str, dtype: torch.dtype, scale_mode: str) -> tuple[LayerKVCache,
                                                                            LayerKVCache]:
    """Two identical caches with random contents (so skipped slots are visible)."""
    cache = allocate_kv_cache(1, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype, DEVICE,
                              layout, kv_scale=0.37)[0]
    g = torch.Generator().manual_seed(1)
    for t in (cache.key, cache.value):
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    if scale_mode == "per_head":
        cache.k_scale = torch.tensor([0.3, 0.011], device=DEVICE)
        cache.v_scale = torch.tensor([2.5, 0.07], device=DEVICE)
    elif scale_mode == "none":
        cache.k_scale = cache.v_scale = None
    twin = LayerKVCache(cache.key.clone(), cache.value.clone(), layout, cache.k_scale,
                        cache.v_scale)
    return cache, twin


def _assert_same_cache(a: LayerKVCache, b: LayerKVCache) -> None:
    assert torch.equal(_bits(a.key), _bits(b.key))
    assert torch.equal(_bits(a.value), _bits(b.value))


def _wide_range_qkv(num_rows: int, input_dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[num_rows, 3 * num_kv_heads, head_dim]: magnitudes from 1e-4 to 1e3 (fp8 subnormals
    through saturation)."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_rows, 3 * NUM_KV_HEADS, HEAD_DIM)
    magnitude = 10.0 ** (torch.rand(shape, generator=g) * 7 - 4)
    return (torch.randn(shape, generator=g) * magnitude).to(input_dtype).to(DEVICE)


CASES = [(layout, dtype, mode)
         for layout in (NHD, SPLIT_K)
         for dtype in (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES)
         for mode in (("per_tensor", "per_head", "none") if dtype in FP8_DTYPES else ("none",))]


@pytest.mark.parametrize("layout,dtype,scale_mode", CASES)
def test_bit_exact_with_reference(layout, dtype, scale_mode):
    require_fp8_cache_here(dtype)
    ref_cache, tri_cache = _cache_pair(layout, dtype, scale_mode)
    qkv = _wide_range_qkv(9, torch.float32, seed=2)
    key, value = qkv[:, NUM_KV_HEADS:2 * NUM_KV_HEADS], qkv[:, 2 * NUM_KV_HEADS:]  # strided
    # 7 slots (key has 9 rows: the last 2 are graph padding), two of them padding (-1).
    slots = torch.tensor([3, -1, 17, 40, 63, -1, 0], device=DEVICE)
    write_kv_reference(key, value, ref_cache, slots)
    write_kv_triton(key, value, tri_cache, slots)
    _assert_same_cache(ref_cache, tri_cache)


@pytest.mark.parametrize("input_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, FP8_DTYPES[0]])
def test_half_inputs(input_dtype, dtype):
    ref_cache, tri_cache = _cache_pair(NHD, dtype, "per_head" if dtype in FP8_DTYPES else "none")
    qkv = _wide_range_qkv(5, input_dtype, seed=3)
    key, value = qkv[:, :NUM_KV_HEADS], qkv[:, NUM_KV_HEADS:2 * NUM_KV_HEADS]
    slots = torch.tensor([5, 6, 33, -1, 50], device=DEVICE)
    write_kv_reference(key, value, ref_cache, slots)
    write_kv_triton(key, value, tri_cache, slots)
    _assert_same_cache(ref_cache, tri_cache)


def _midpoints(dtype: torch.dtype) -> torch.Tensor:
    """Every value exactly halfway between two adjacent finite values of ``dtype`` (ties)."""
    if dtype == torch.bfloat16:
        codes = torch.arange(0x3F00, 0x3F80, dtype=torch.int16)  # [0.5, 1) in bf16
        values = codes.view(torch.bfloat16).float()
    else:
        values = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(dtype).float()
        values = values[values.isfinite()].unique()
    values = values.sort().values
    return torch.cat([(values[:-1] + values[1:]) / 2, -(values[:-1] + values[1:]) / 2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, *FP8_DTYPES])
def test_round_half_to_even_like_torch(dtype):
    require_fp8_cache_here(dtype)
    ties = _midpoints(dtype)
    per_token = NUM_KV_HEADS * HEAD_DIM
    num_tokens = -(-ties.numel() // per_token)
    padded = torch.cat([ties, torch.zeros(num_tokens * per_token - ties.numel())])
    key = padded.view(num_tokens, NUM_KV_HEADS, HEAD_DIM).to(DEVICE)
    cache = allocate_kv_cache(1, -(-num_tokens // BLOCK_SIZE), BLOCK_SIZE, NUM_KV_HEADS,
                              HEAD_DIM, dtype, DEVICE)[0]
    twin = LayerKVCache(cache.key.clone(), cache.value.clone(), NHD, cache.k_scale, cache.v_scale)
    slots = torch.arange(num_tokens, device=DEVICE)
    write_kv_reference(key, -key, cache, slots)
    write_kv_triton(key, -key, twin, slots)
    _assert_same_cache(cache, twin)


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_DTYPES[1]])
def test_many_tokens_span_several_programs(dtype):
    require_fp8_cache_here(dtype)
    num_tokens, num_blocks = 150, 12  # 150 of 192 slots, shuffled, some padding
    caches = [allocate_kv_cache(1, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype,
                                DEVICE)[0] for _ in range(2)]
    g = torch.Generator().manual_seed(6)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:num_tokens]
    slots[::7] = -1
    qkv = _wide_range_qkv(num_tokens, torch.float32, seed=7)
    key, value = qkv[:, :NUM_KV_HEADS], qkv[:, NUM_KV_HEADS:2 * NUM_KV_HEADS]
    write_kv_reference(key, value, caches[0], slots.to(DEVICE))
    write_kv_triton(key, value, caches[1], slots.to(DEVICE))
    _assert_same_cache(*caches)


def test_all_padding_and_empty_batches_write_nothing():
    ref_cache, tri_cache = _cache_pair(NHD, torch.float16, "none")
    before = tri_cache.key.clone()
    qkv = _wide_range_qkv(3, torch.float32, seed=4)
    write_kv_triton(qkv[:, :2], qkv[:, 2:4], tri_cache, torch.full((3,), -1, device=DEVICE))
    write_kv_triton(qkv[:, :2], qkv[:, 2:4], tri_cache,
                    torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(before, tri_cache.key)


def test_int32_slot_mapping():
    ref_cache, tri_cache = _cache_pair(SPLIT_K, torch.bfloat16, "none")
    qkv = _wide_range_qkv(4, torch.float32, seed=5)
    slots = torch.tensor([9, -1, 62, 1], dtype=torch.int32, device=DEVICE)
    write_kv_reference(qkv[:, :2], qkv[:, 2:4], ref_cache, slots)
    write_kv_triton(qkv[:, :2], qkv[:, 2:4], tri_cache, slots)
    _assert_same_cache(ref_cache, tri_cache)


def _bad_args(case: str):
    _, cache = _cache_pair(NHD, FP8_DTYPES[0], "per_tensor")
    key = torch.randn(4, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    value, slots = key.clone(), torch.arange(4, device=DEVICE)
    if case == "key":
        key = torch.randn(4, NUM_KV_HEADS + 1, HEAD_DIM, device=DEVICE)
    elif case == "value":
        value = value[:3]
    elif case == "head_dim":  # last dim not contiguous
        key = torch.randn(4, NUM_KV_HEADS, HEAD_DIM * 2, device=DEVICE)[..., ::2]
    elif case == "slot_mapping":
        slots = slots.float()
    elif case == "k_scale":
        cache.k_scale = torch.ones(3, device=DEVICE)
    elif case == "dtype":
        key = key.double()
    return key, value, cache, slots


@pytest.mark.parametrize("case", ["key", "value", "head_dim", "slot_mapping", "k_scale", "dtype"])
def test_checked_wrapper_rejects_bad_arguments(case):
    key, value, cache, slots = _bad_args(case)
    with pytest.raises(ValueError, match=case if case not in ("head_dim", "dtype") else "key"):
        write_kv_triton(key, value, cache, slots)
