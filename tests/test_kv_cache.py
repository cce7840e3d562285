"""Paged KV cache: slot mapping and the torch reference KV write against naive per-token
loops, for both layouts and every cache dtype, plus the cache's shape rules."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rocdraft.backends.kv_cache import (FP8_DTYPES, NHD, PADDING_SLOT_ID, SPLIT_K, LayerKVCache,
                                        allocate_kv_cache, compute_slot_mapping,
                                        kv_cache_shapes, read_kv_nhd, split_k_x,
                                        write_kv_reference)

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES)
FAST = settings(max_examples=40, deadline=None)


# --- slot mapping ---------------------------------------------------------------------------

def naive_slot_mapping(block_table, req_indices, positions, block_size):
    out = []
    for req, pos in zip(req_indices.tolist(), positions.tolist()):
        if pos < 0:
            out.append(PADDING_SLOT_ID)
        else:
            out.append(int(block_table[req, pos // block_size]) * block_size + pos % block_size)
    return torch.tensor(out, dtype=torch.int64)


def test_slot_mapping_docstring_example():
    block_table = torch.tensor([[7, 2], [5, 0]], dtype=torch.int32)
    slots = compute_slot_mapping(block_table, torch.tensor([0, 0, 0, 1]),
                                 torch.tensor([2, 3, 4, 1]), 4)
    assert slots.tolist() == [30, 31, 8, 21]
    assert slots.dtype == torch.int64


@FAST
@given(st.data())
def test_slot_mapping_matches_naive_loop(data):
    batch_size = data.draw(st.integers(1, 5))
    max_blocks = data.draw(st.integers(1, 6))
    block_size = data.draw(st.integers(1, 16))
    num_blocks = data.draw(st.integers(1, 64))
    num_tokens = data.draw(st.integers(0, 30))
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    block_table = torch.randint(0, num_blocks, (batch_size, max_blocks), generator=g,
                                dtype=torch.int32)
    req_indices = torch.randint(0, batch_size, (num_tokens,), generator=g)
    positions = torch.randint(-4, max_blocks * block_size, (num_tokens,), generator=g)
    got = compute_slot_mapping(block_table, req_indices, positions, block_size)
    assert torch.equal(got, naive_slot_mapping(block_table, req_indices, positions, block_size))
    assert bool((got[positions < 0] == PADDING_SLOT_ID).all())


# --- KV write -------------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a tensor (fp8 tensors do not support every comparison)."""
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else \
        t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def naive_quantize_row(row: torch.Tensor, dtype: torch.dtype, scale, head: int):
    """One head's [head_dim] row as stored in a cache of ``dtype``."""
    if dtype in FP8_DTYPES:
        s = 1.0 if scale is None else scale.float().view(-1)[head if scale.numel() > 1 else 0]
        info = torch.finfo(dtype)
        return (row.float() / s).clamp(info.min, info.max).to(dtype)
    return row.to(dtype)


def naive_write(key, value, cache: LayerKVCache, slot_mapping):
    """Per-token, per-head loop using the documented element addresses of each layout."""
    bs = cache.block_size
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, bs)
        for h in range(key.shape[1]):
            k = naive_quantize_row(key[t, h], cache.key.dtype, cache.k_scale, h)
            v = naive_quantize_row(value[t, h], cache.value.dtype, cache.v_scale, h)
            if cache.layout == NHD:
                cache.key[b, o, h] = k
                cache.value[b, o, h] = v
            else:
                x = cache.key.shape[-1]
                # key[b, h, d // x, o, d % x], value[b, h, o // x, d, o % x]
                cache.key[b, h, :, o, :] = k.view(-1, x)
                cache.value[b, h, o // x, :, o % x] = v


def random_cache(layout, num_blocks, block_size, num_kv_heads, head_dim, dtype, g,
                 per_head_scale=False) -> LayerKVCache:
    """A cache prefilled with random contents (so untouched slots are detectable)."""
    kshape, vshape = kv_cache_shapes(layout, num_blocks, block_size, num_kv_heads, head_dim,
                                     dtype)
    key = torch.randn(kshape, generator=g).to(dtype)
    value = torch.randn(vshape, generator=g).to(dtype)
    k_scale = v_scale = None
    if dtype in FP8_DTYPES:
        n = num_kv_heads if per_head_scale else 1
        k_scale = torch.rand(n, generator=g) * 0.5 + 0.05
        v_scale = torch.rand(n, generator=g) * 0.5 + 0.05
    return LayerKVCache(key, value, layout, k_scale, v_scale)


def clone_cache(c: LayerKVCache) -> LayerKVCache:
    return LayerKVCache(c.key.clone(), c.value.clone(), c.layout,
                        None if c.k_scale is None else c.k_scale.clone(),
                        None if c.v_scale is None else c.v_scale.clone())


def assert_same_cache(a: LayerKVCache, b: LayerKVCache):
    assert torch.equal(_bits(a.key), _bits(b.key))
    assert torch.equal(_bits(a.value), _bits(b.value))


def input_dtype_for(cache_dtype):
    return torch.bfloat16 if cache_dtype in FP8_DTYPES else cache_dtype


@FAST
@given(st.data())
def test_write_matches_naive_loop(data):
    layout = data.draw(st.sampled_from((NHD, SPLIT_K)))
    dtype = data.draw(st.sampled_from(CACHE_DTYPES))
    per_head = data.draw(st.booleans())
    num_kv_heads = data.draw(st.integers(1, 3))
    if layout == SPLIT_K:
        x = split_k_x(dtype)
        block_size = x * data.draw(st.integers(1, 2))
        head_dim = x * data.draw(st.integers(1, 2))
    else:
        block_size = data.draw(st.integers(1, 8))
        head_dim = data.draw(st.integers(1, 8))
    num_blocks = data.draw(st.integers(1, 4))
    num_slots = num_blocks * block_size
    num_tokens = data.draw(st.integers(0, min(num_slots, 12)))
    extra_rows = data.draw(st.integers(0, 3))  # key longer than slot_mapping
    strided = data.draw(st.booleans())  # key/value are views into a fused qkv tensor
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))

    cache = random_cache(layout, num_blocks, block_size, num_kv_heads, head_dim, dtype, g,
                         per_head)
    expected = clone_cache(cache)
    # Distinct slots (a step never writes one slot twice), some marked as padding.
    slots = torch.randperm(num_slots, generator=g)[:num_tokens]
    padding = torch.rand(num_tokens, generator=g) < 0.3
    slot_mapping = slots.masked_fill(padding, PADDING_SLOT_ID)
    rows = num_tokens + extra_rows
    in_dtype = input_dtype_for(dtype)
    scale_up = 40.0 if dtype in FP8_DTYPES else 1.0  # push some fp8 values into saturation
    if strided:
        num_heads = 2 * num_kv_heads
        qkv = (torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
               * scale_up).to(in_dtype)
        q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
        key = qkv[:, q_end:k_end].view(rows, num_kv_heads, head_dim)
        value = qkv[:, k_end:].view(rows, num_kv_heads, head_dim)
        assert rows <= 1 or not key.is_contiguous()
    else:
        key = (torch.randn(rows, num_kv_heads, head_dim, generator=g) * scale_up).to(in_dtype)
        value = (torch.randn(rows, num_kv_heads, head_dim, generator=g) * scale_up).to(in_dtype)

    write_kv_reference(key, value, cache, slot_mapping)
    naive_write(key, value, expected, slot_mapping)
    assert_same_cache(cache, expected)


@pytest.mark.parametrize("layout", (NHD, SPLIT_K))
@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_all_padding_batch_leaves_cache_untouched(layout, dtype):
    g = torch.Generator().manual_seed(0)
    cache = random_cache(layout, 3, 16, 2, 16, dtype, g)
    before = clone_cache(cache)
    key = torch.randn(5, 2, 16, generator=g).to(input_dtype_for(dtype))
    write_kv_reference(key, key * 2, cache, torch.full((5,), PADDING_SLOT_ID))
    assert_same_cache(cache, before)


@pytest.mark.parametrize("layout", (NHD, SPLIT_K))
def test_empty_slot_mapping_writes_nothing(layout):
    g = torch.Generator().manual_seed(1)
    cache = random_cache(layout, 2, 16, 1, 16, torch.float16, g)
    before = clone_cache(cache)
    key = torch.randn(3, 1, 16, generator=g).half()  # graph padding only
    write_kv_reference(key, key, cache, torch.empty(0, dtype=torch.long))
    assert_same_cache(cache, before)


def test_padding_rows_never_leak_their_data():
    # The padding row carries huge values; none of them may reach the cache.
    cache = LayerKVCache(torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 2))
    key = torch.tensor([[[1.0, 2.0]], [[999.0, 999.0]], [[3.0, 4.0]], [[777.0, 777.0]]])
    write_kv_reference(key, -key, cache, torch.tensor([5, -1, 0]))  # 4th row: past the mapping
    assert cache.key[1, 1, 0].tolist() == [1.0, 2.0]
    assert cache.key[0, 0, 0].tolist() == [3.0, 4.0]
    assert cache.value[1, 1, 0].tolist() == [-1.0, -2.0]
    assert cache.key.abs().max() < 10 and cache.value.abs().max() < 10
    assert int((cache.key != 0).sum()) == 4


def test_padding_first_in_batch():
    # The first row is padding: the anchor must be the first *valid* row.
    cache = LayerKVCache(torch.zeros(1, 4, 1, 1), torch.zeros(1, 4, 1, 1))
    key = torch.tensor([9.0, 1.0, 2.0]).view(3, 1, 1)
    write_kv_reference(key, key, cache, torch.tensor([-1, 3, 1]))
    assert cache.key.view(-1).tolist() == [0.0, 2.0, 0.0, 1.0]


# --- reading back ---------------------------------------------------------------------------

@pytest.mark.parametrize("layout", (NHD, SPLIT_K))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
def test_read_round_trip_exact(layout, dtype):
    g = torch.Generator().manual_seed(2)
    nb, bs, hk, d = 3, 16, 2, 16
    cache = allocate_kv_cache(1, nb, bs, hk, d, dtype, "cpu", layout=layout)[0]
    key = torch.randn(nb * bs, hk, d, generator=g).to(dtype)
    value = torch.randn(nb * bs, hk, d, generator=g).to(dtype)
    slots = torch.randperm(nb * bs, generator=g)
    write_kv_reference(key, value, cache, slots)
    k_nhd, v_nhd = read_kv_nhd(cache)
    assert k_nhd.dtype == torch.float32 and k_nhd.shape == (nb, bs, hk, d)
    assert torch.equal(k_nhd.reshape(-1, hk, d)[slots], key.float())
    assert torch.equal(v_nhd.reshape(-1, hk, d)[slots], value.float())


@pytest.mark.parametrize("layout", (NHD, SPLIT_K))
@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("per_head", (False, True))
def test_read_round_trip_fp8(layout, dtype, per_head):
    g = torch.Generator().manual_seed(3)
    nb, bs, hk, d = 2, 16, 2, 16
    kshape, vshape = kv_cache_shapes(layout, nb, bs, hk, d, dtype)
    n = hk if per_head else 1
    k_scale, v_scale = torch.rand(n, generator=g) + 0.5, torch.rand(n, generator=g) * 0.1 + 0.02
    cache = LayerKVCache(torch.zeros(kshape, dtype=dtype), torch.zeros(vshape, dtype=dtype),
                         layout, k_scale, v_scale)
    key = torch.randn(nb * bs, hk, d, generator=g)
    value = torch.randn(nb * bs, hk, d, generator=g) * 0.5
    slots = torch.randperm(nb * bs, generator=g)
    write_kv_reference(key, value, cache, slots)
    k_nhd, v_nhd = read_kv_nhd(cache)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4; plus subnormal granularity near 0.
    for got, want, scale in ((k_nhd, key, k_scale), (v_nhd, value, v_scale)):
        got = got.reshape(-1, hk, d)[slots]
        tol = want.abs() * 2 ** -4 + 2 ** -9 * scale.view(1, -1, 1)
        assert bool(((got - want).abs() <= tol).all())


def test_fp8_saturates_instead_of_overflowing():
    for dtype in FP8_DTYPES:
        cache = LayerKVCache(torch.zeros(1, 2, 1, 2, dtype=dtype),
                             torch.zeros(1, 2, 1, 2, dtype=dtype), NHD,
                             torch.ones(1), torch.ones(1))
        big = torch.tensor([[[1e6, -1e6]], [[0.5, 1.0]]])
        write_kv_reference(big, big, cache, torch.tensor([0, 1]))
        k, _ = read_kv_nhd(cache)
        assert k[0, 0, 0].tolist() == [torch.finfo(dtype).max, torch.finfo(dtype).min]
        assert torch.isfinite(k).all()


@pytest.mark.parametrize("layout", (NHD, SPLIT_K))
def test_fp8_cache_without_scales_stores_the_plain_cast(layout):
    """No k_scale / v_scale means scale 1: the stored values are the fp8 casts."""
    for dtype in FP8_DTYPES:
        kshape, vshape = kv_cache_shapes(layout, 2, 16, 3, 16, dtype)
        cache = LayerKVCache(torch.zeros(kshape, dtype=dtype), torch.zeros(vshape, dtype=dtype),
                             layout)
        key = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(5))
        slots = torch.tensor([3, 17, 0, 31, 8])
        write_kv_reference(key, 2 * key, cache, slots)
        k_nhd, v_nhd = read_kv_nhd(cache)
        assert torch.equal(k_nhd.reshape(-1, 3, 16)[slots], key.to(dtype).float())
        assert torch.equal(v_nhd.reshape(-1, 3, 16)[slots], (2 * key).to(dtype).float())


def test_split_k_and_nhd_read_back_the_same():
    g = torch.Generator().manual_seed(4)
    caches = [allocate_kv_cache(1, 2, 16, 2, 32, torch.float16, "cpu", layout=lay)[0]
              for lay in (NHD, SPLIT_K)]
    key = torch.randn(20, 2, 32, generator=g).half()
    value = torch.randn(20, 2, 32, generator=g).half()
    slots = torch.randperm(32, generator=g)[:20]
    for c in caches:
        write_kv_reference(key, value, c, slots)
    for a, b in zip(read_kv_nhd(caches[0]), read_kv_nhd(caches[1])):
        assert torch.equal(a, b)


# --- shapes and allocation ------------------------------------------------------------------

def test_kv_cache_shapes():
    assert kv_cache_shapes(NHD, 5, 16, 2, 64, torch.float16) == ((5, 16, 2, 64),) * 2
    assert kv_cache_shapes(SPLIT_K, 5, 16, 2, 64, torch.float16) == \
        ((5, 2, 8, 16, 8), (5, 2, 2, 64, 8))
    assert kv_cache_shapes(SPLIT_K, 5, 16, 2, 64, torch.float8_e4m3fnuz) == \
        ((5, 2, 4, 16, 16), (5, 2, 1, 64, 16))
    assert split_k_x(torch.float32) == 4
    assert split_k_x(torch.bfloat16) == 8
    assert split_k_x(torch.float8_e4m3fn) == 16


@pytest.mark.parametrize("block_size, head_dim, bad", [(16, 60, "60"), (12, 64, "12")])
def test_kv_cache_shapes_split_k_errors(block_size, head_dim, bad):
    with pytest.raises(ValueError, match=bad):
        kv_cache_shapes(SPLIT_K, 4, block_size, 2, head_dim, torch.float16)


def test_kv_cache_shapes_fp8_split_k_needs_multiple_of_16():
    with pytest.raises(ValueError, match="x=16"):
        kv_cache_shapes(SPLIT_K, 4, 8, 2, 64, torch.float8_e4m3fnuz)


def test_kv_cache_shapes_unknown_layout():
    with pytest.raises(ValueError, match="HND"):
        kv_cache_shapes("HND", 4, 16, 2, 64, torch.float16)


def test_allocate_kv_cache():
    caches = allocate_kv_cache(3, 4, 16, 2, 32, torch.float8_e4m3fnuz, "cpu", layout=SPLIT_K,
                               kv_scale=0.25)
    assert len(caches) == 3 and caches[0].key is not caches[1].key
    c = caches[0]
    assert c.is_fp8 and c.block_size == 16 and c.num_blocks == 4 and c.layout == SPLIT_K
    assert c.k_scale.tolist() == [0.25] and c.v_scale.tolist() == [0.25]
    assert c.k_scale is not c.v_scale
    plain = allocate_kv_cache(1, 4, 8, 2, 32, torch.bfloat16, "cpu")[0]
    assert not plain.is_fp8 and plain.k_scale is None and plain.block_size == 8
    assert plain.key.shape == (4, 8, 2, 32) and not plain.key.any()
