"""The HIP kernels run on the CPU through the serial shim, checked bit for bit against the torch
references (backends.kv_cache.write_kv_reference, drafter.index_math).

What these tests prove: the kernels' index math (slot -> block/offset, both cache layouts,
strided rows, padding slots, clamping, rejected-token compaction) and every stored bit
(fp16/bf16/fp32 copies, fp8 e4m3fn / e4m3fnuz quantisation with per-tensor and per-head
scales) equal the references, on both the 16-byte vector path and the scalar path, compiled
from the very sources the GPU build uses. What they do not prove: behaviour of 64-wide
wavefronts running concurrently, real vector memory instructions, or speed; only a GPU run
proves those (scripts/check_hip_kernels.py proves the sources compile for gfx942/gfx90a).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rocdraft.backends.kv_cache import (NHD, SPLIT_K, LayerKVCache, kv_cache_shapes, split_k_x,
                                        write_kv_reference)
from rocdraft.drafter import index_math
from rocdraft.hip_kernels import build
from rocdraft.hip_kernels.ops import LAYOUT_CODES

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
FP8_KIND = {FN: 3, FNUZ: 4}
DTYPE_PAIRS = [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
               (torch.float32, torch.float32)] + [
    (src, fp8) for fp8 in (FN, FNUZ) for src in (torch.float16, torch.bfloat16, torch.float32)]
SHORT = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", FN: "e4m3fn",
         FNUZ: "e4m3fnuz"}
HYPOTHESIS = settings(max_examples=50, deadline=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def shim():
    """The CPU shim extension's ops (built once; cached on disk between runs)."""
    try:
        return build.load_cpu_shim()
    except (RuntimeError, OSError) as error:  # no C++ compiler on this machine
        pytest.skip(f"CPU shim extension cannot be built here: {error}")


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Byte view for bit-exact comparisons (NaN == NaN, -0 != +0)."""
    return t.contiguous().view(torch.uint8)


# ---------------------------------------------------------------------------- fp8 conversion

def fp8_reference(f: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    finfo = torch.finfo(dtype)
    return as_bits(f.clamp(finfo.min, finfo.max).to(dtype))


def shim_fp8(shim, f: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(f.numel(), dtype=torch.uint8)
    shim.float_to_fp8(f, out, FP8_KIND[dtype], 0)
    return out


def structured_float_bits() -> torch.Tensor:
    """Every sign and exponent, crossed with mantissas that sit on, just below and just above a
    rounding tie at every bit position (the subnormal fp8 range rounds at other positions than
    the normal range), with varied high bits. ~280K float32 bit patterns."""
    shifts = torch.arange(1, 24, dtype=torch.int64).view(-1, 1, 1)
    half = 1 << (shifts - 1)
    lows = torch.cat([half - 1, half, half + 1, torch.zeros_like(half), 2 * half - 1], dim=2)
    highs = torch.tensor([0, 1, 2, 3, 5, 7, 0x55, 0x3FF, 0xFFFF, 0x7FFFFF],
                         dtype=torch.int64).view(1, -1, 1)
    mantissas = ((highs << shifts) | lows) & 0x7FFFFF  # [23, 10, 5]
    mantissas = mantissas.flatten().unique()
    exponents = torch.arange(256, dtype=torch.int64)
    magnitude = (exponents.view(-1, 1) << 23) | mantissas.view(1, -1)
    bits = torch.cat([magnitude.flatten(), magnitude.flatten() | (1 << 31)])
    return bits.to(torch.int32)  # two's complement wrap keeps the sign bit


@pytest.mark.parametrize("dtype", [FN, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
def test_fp8_conversion_matches_torch_on_structured_and_random_floats(shim, dtype):
    """float -> fp8 (saturating, round-to-nearest-even) equals torch's clamp().to(fp8) on every
    exponent, tie and near-tie mantissas, subnormal floats and fp8 subnormals, +-0, +-inf,
    NaNs, and 4M random bit patterns."""
    random_bits = torch.randint(-2**31, 2**31, (1 << 22,), dtype=torch.int64,
                                generator=torch.Generator().manual_seed(0)).to(torch.int32)
    floats = torch.cat([structured_float_bits(), random_bits]).view(torch.float32)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 448.0, 464.0,
                             240.0, 248.0, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-10 * 1.0001])
    floats = torch.cat([floats, specials, -specials])
    ours, ref = shim_fp8(shim, floats, dtype), fp8_reference(floats, dtype)
    bad = (ours != ref).nonzero().flatten()[:5]
    assert bad.numel() == 0, (floats[bad].tolist(), ours[bad].tolist(), ref[bad].tolist())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [FN, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
def test_fp8_conversion_exhaustive_over_the_rounding_range(shim, dtype):
    """Every positive float32 with a biased exponent in [100, 136): all floats whose fp8 value
    is neither certainly zero nor certainly saturated (negatives mirror them bit for bit, which
    the structured test checks). ~300M values per format, about a minute."""
    base = torch.arange(1 << 23, dtype=torch.int64)
    for exponent in range(100, 136):
        floats = (base | (exponent << 23)).to(torch.int32).view(torch.float32)
        assert torch.equal(shim_fp8(shim, floats, dtype), fp8_reference(floats, dtype)), exponent


# ---------------------------------------------------------------------------- paged KV write

def make_rows(num_rows: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              stride_mode: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """key, value [num_rows, num_kv_heads, head_dim] laid out as ``stride_mode`` says:
    contiguous | fused_qkv (views into one [rows, (3 + 2 * H) * D] buffer) | head_padded
    (head stride D + 3) | misaligned (data pointer 1 element past a 16-byte boundary)."""
    def values(*shape):
        x = torch.randn(*shape, generator=gen) * 4
        x = x * torch.where(torch.rand(*shape, generator=gen) < 0.1, 200.0, 1.0)  # saturate
        x = x * torch.where(torch.rand(*shape, generator=gen) < 0.05, 1e-5, 1.0)  # subnormals
        flat = x.view(-1)
        specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])
        count = min(flat.numel() // 8, specials.numel())
        flat[torch.randperm(flat.numel(), generator=gen)[:count]] = specials[:count]
        return x.to(dtype)

    h, d = num_kv_heads, head_dim
    if stride_mode == "contiguous":
        return values(num_rows, h, d), values(num_rows, h, d)
    if stride_mode == "fused_qkv":
        qkv = values(num_rows, (3 + 2 * h) * d)
        return (qkv[:, 3 * d:(3 + h) * d].view(num_rows, h, d),
                qkv[:, (3 + h) * d:].view(num_rows, h, d))
    if stride_mode == "head_padded":
        return values(num_rows, h, d + 3)[..., :d], values(num_rows, h, d + 3)[..., :d]
    if stride_mode == "misaligned":
        n = num_rows * h * d
        return values(n + 1)[1:].view(num_rows, h, d), values(n + 1)[1:].view(num_rows, h, d)
    raise ValueError(stride_mode)


def random_cache(layout, num_blocks, block_size, num_kv_heads, head_dim, dtype, gen):
    """A cache filled with random bytes, so that untouched slots are checked too."""
    shapes = kv_cache_shapes(layout, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    size = torch.empty((), dtype=dtype).element_size()
    tensors = []
    for shape in shapes:
        raw = torch.randint(0, 256, (torch.Size(shape).numel() * size,), dtype=torch.uint8,
                            generator=gen)
        tensors.append(raw.view(dtype).view(shape))
    return tensors


def run_write_case(shim, layout, src_dtype, cache_dtype, data) -> None:
    x = split_k_x(cache_dtype)
    if layout == SPLIT_K:
        head_dim = x * data.draw(st.sampled_from([1, 2, 4]), label="head_dim / x")
        block_size = x * data.draw(st.sampled_from([1, 2]), label="block_size / x")
    else:
        head_dim = data.draw(st.sampled_from([1, 3, 8, 20, 32, 64]), label="head_dim")
        block_size = data.draw(st.sampled_from([1, 4, 16]), label="block_size")
    num_kv_heads = data.draw(st.integers(1, 3), label="num_kv_heads")
    num_blocks = data.draw(st.integers(1, 5), label="num_blocks")
    num_slots = num_blocks * block_size
    num_tokens = data.draw(st.integers(0, min(num_slots, 10)), label="num_tokens")
    extra_rows = data.draw(st.integers(0, 2), label="padded rows past num_tokens")
    stride_mode = data.draw(st.sampled_from(["contiguous", "fused_qkv", "head_padded",
                                             "misaligned"]), label="stride_mode")
    scale_mode = "none"
    if cache_dtype in (FN, FNUZ):
        scale_mode = data.draw(st.sampled_from(["none", "tensor", "head"]), label="scale")
    allow_vector = data.draw(st.booleans(), label="allow_vector")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    gen = torch.Generator().manual_seed(seed)

    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    padding = torch.rand(num_tokens, generator=gen) < 0.3
    slot_mapping = torch.where(padding, -1, slots).to(torch.int64)
    key, value = make_rows(num_tokens + extra_rows, num_kv_heads, head_dim, src_dtype,
                           stride_mode, gen)
    scales = [None, None]
    if scale_mode != "none":
        count = 1 if scale_mode == "tensor" else num_kv_heads
        scales = [torch.rand(count, generator=gen) * 3 + 0.05 for _ in range(2)]
    key_cache, value_cache = random_cache(layout, num_blocks, block_size, num_kv_heads,
                                          head_dim, cache_dtype, gen)
    expected = LayerKVCache(key_cache.clone(), value_cache.clone(), layout, *scales)
    write_kv_reference(key, value, expected, slot_mapping)

    shim.write_kv(key, value, key_cache, value_cache, slot_mapping, scales[0], scales[1],
                  LAYOUT_CODES[layout], allow_vector, 0)
    assert torch.equal(as_bits(key_cache), as_bits(expected.key))
    assert torch.equal(as_bits(value_cache), as_bits(expected.value))

    vector_ok = shim.write_kv_vector_ok(key, value, key_cache, value_cache, slot_mapping,
                                        LAYOUT_CODES[layout])
    if key.numel() == 0:
        pass  # empty tensors have a null data pointer: nothing to say about alignment
    elif stride_mode == "misaligned" or head_dim % x:
        assert not vector_ok
    elif stride_mode == "contiguous":
        assert vector_ok  # the vector path is what ran when allow_vector was drawn


@pytest.mark.parametrize("layout", [NHD, SPLIT_K])
@pytest.mark.parametrize("src_dtype,cache_dtype", DTYPE_PAIRS,
                         ids=[f"{SHORT[a]}_to_{SHORT[b]}" for a, b in DTYPE_PAIRS])
@HYPOTHESIS
@given(data=st.data())
def test_write_kv_matches_reference_bit_for_bit(shim, layout, src_dtype, cache_dtype, data):
    """Random shapes, slots (30% padding, -1), extra rows past num_tokens, four stride layouts
    of the inputs, no/per-tensor/per-head scales, vector and scalar paths: the whole cache
    (written and untouched slots) equals write_kv_reference byte for byte."""
    run_write_case(shim, layout, src_dtype, cache_dtype, data)


@pytest.mark.parametrize("src_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [FN, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
def test_write_kv_every_16_bit_input_to_fp8(shim, src_dtype, cache_dtype):
    """All 65536 fp16 (or bf16) bit patterns, as one token of 1 kv head x 65536 dims, through
    the quantising write with a non-power-of-two scale: exhaustive for the input conversion."""
    key = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(src_dtype)
    key = key.view(1, 1, -1)
    value = key.flip(-1)
    scale = torch.tensor([0.37])
    cache = LayerKVCache(torch.zeros(2, 1, 1, key.shape[-1], dtype=cache_dtype),
                         torch.zeros(2, 1, 1, key.shape[-1], dtype=cache_dtype), NHD, scale,
                         scale.clone())
    slot_mapping = torch.tensor([1])
    expected_key, expected_value = cache.key.clone(), cache.value.clone()
    write_kv_reference(key, value, LayerKVCache(expected_key, expected_value, NHD, scale, scale),
                       slot_mapping)
    shim.write_kv(key, value, cache.key, cache.value, slot_mapping, scale, scale, 0, True, 0)
    assert torch.equal(as_bits(cache.key), as_bits(expected_key))
    assert torch.equal(as_bits(cache.value), as_bits(expected_value))


def test_write_kv_skips_every_padding_slot(shim):
    """Only padding slots: the cache is untouched (the reference rewrites slot 0 with itself)."""
    key = torch.randn(4, 2, 8, dtype=torch.float16)
    cache = torch.randn(3, 4, 2, 8).half(), torch.randn(3, 4, 2, 8).half()
    before = [c.clone() for c in cache]
    shim.write_kv(key, key, *cache, torch.full((4,), -1), None, None, 0, True, 0)
    assert all(torch.equal(a, b) for a, b in zip(cache, before))


# ---------------------------------------------------------------------------- draft-loop index math

@HYPOTHESIS
@given(batch_size=st.integers(0, 20), block_size=st.sampled_from([1, 2, 4, 16]),
       max_blocks=st.integers(1, 6), max_model_len=st.integers(1, 80),
       extra_rows=st.integers(0, 3), row_padding=st.integers(0, 2), seed=st.integers(0, 2**31))
def test_advance_draft_step_matches_index_math(shim, batch_size, block_size, max_blocks,
                                               max_model_len, extra_rows, row_padding, seed):
    """In-place kernel == index_math.advance_draft_step: positions straddling max_model_len
    (clamped rows: position 0, slot -1, seq_len 1), block columns past the table (clamped to
    the last), block tables with strided rows and more rows than requests."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(-1, max_model_len + 3, (batch_size,), generator=gen)
    seq_lens = torch.randint(1, 500, (batch_size,), generator=gen, dtype=torch.int32)
    wide = torch.randint(0, 1000, (batch_size + extra_rows, max_blocks + row_padding),
                         generator=gen, dtype=torch.int32)
    block_table = wide[:, :max_blocks]
    expected = index_math.advance_draft_step(positions, seq_lens, block_table[:batch_size],
                                             block_size, max_model_len)
    clamped = torch.full((batch_size,), -7, dtype=torch.int64)
    slots = torch.full((batch_size,), -7, dtype=torch.int64)
    shim.advance_draft_step(positions, seq_lens, block_table, clamped, slots, block_size,
                            max_model_len, 0)
    for got, want in zip((positions, clamped, slots, seq_lens), expected):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_advance_draft_step_docstring_example(shim):
    positions, seq_lens = torch.tensor([4, 9]), torch.tensor([5, 10], dtype=torch.int32)
    block_table = torch.tensor([[3, 7, 1], [2, 5, 6]], dtype=torch.int32)
    clamped, slots = torch.empty(2, dtype=torch.int64), torch.empty(2, dtype=torch.int64)
    shim.advance_draft_step(positions, seq_lens, block_table, clamped, slots, 4, 10, 0)
    assert positions.tolist() == [5, 10] and clamped.tolist() == [5, 0]
    assert slots.tolist() == [29, -1] and seq_lens.tolist() == [6, 1]


def padded_drafting_inputs(batch_size, k, vocab_size, gen, realistic):
    """sampled [batch_size, k + 1] with -1 rejections (accepted prefix when ``realistic``, else
    arbitrary values in [-2, vocab_size + 2)), and the other inputs of the fused op."""
    if realistic:
        accepted = torch.randint(1, k + 2, (batch_size, 1), generator=gen)
        tokens = torch.randint(0, vocab_size, (batch_size, k + 1), generator=gen)
        sampled = torch.where(torch.arange(k + 1) < accepted, tokens, -1)
    else:
        sampled = torch.randint(-2, vocab_size + 2, (batch_size, k + 1), generator=gen)
    num_draft = torch.randint(0, k + 1, (batch_size,), generator=gen, dtype=torch.int32)
    query_lens = num_draft + 1 + torch.randint(0, 3, (batch_size,), generator=gen,
                                               dtype=torch.int32)
    query_start_loc = torch.zeros(batch_size + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    discard = torch.rand(batch_size, generator=gen) < 0.2
    backup = torch.randint(0, vocab_size, (batch_size,), generator=gen)
    return sampled, discard, backup, query_start_loc, num_draft


def shim_padded_drafting(shim, sampled, discard, backup, vocab_size, qsl, num_draft):
    batch_size = sampled.shape[0]
    outs = (torch.full((batch_size,), -9, dtype=torch.int64),
            torch.full((batch_size,), -9, dtype=torch.int32),
            torch.full((batch_size,), -9, dtype=torch.int64),
            torch.full((batch_size,), -9, dtype=torch.int64))
    shim.prepare_padded_drafting(sampled, discard, backup, vocab_size, qsl, num_draft, *outs, 0)
    return outs


@HYPOTHESIS
@given(batch_size=st.integers(0, 24), k=st.integers(0, 6), vocab_size=st.integers(1, 50),
       realistic=st.booleans(), strided=st.booleans(), seed=st.integers(0, 2**31))
# An empty batch: torch.where gives sampled [0, 1] strides (1, 0), which must be accepted.
@example(batch_size=0, k=0, vocab_size=1, realistic=True, strided=False, seed=0)
def test_prepare_padded_drafting_matches_index_math(shim, batch_size, k, vocab_size, realistic,
                                                    strided, seed):
    """Fused kernel == prepare_next_token_ids_padded then prepare_inputs_padded, for accepted
    prefixes and for arbitrary sampled values (out-of-vocab, -1 anywhere), discarded requests,
    prefill rows (0 drafts) and a row-strided ``sampled``."""
    gen = torch.Generator().manual_seed(seed)
    sampled, discard, backup, qsl, num_draft = padded_drafting_inputs(batch_size, k, vocab_size,
                                                                      gen, realistic)
    if strided:
        sampled = torch.cat([sampled, sampled], dim=1)[:, :k + 1]
    next_ids, count = index_math.prepare_next_token_ids_padded(sampled, discard, backup,
                                                               vocab_size)
    indices, rejected = index_math.prepare_inputs_padded(qsl, num_draft, count)
    got = shim_padded_drafting(shim, sampled, discard, backup, vocab_size, qsl, num_draft)
    for g, want in zip(got, (next_ids, count, indices, rejected)):
        assert g.dtype == want.dtype and torch.equal(g, want)


def test_prepare_padded_drafting_worked_example(shim):
    sampled = torch.tensor([[5, 7, -1], [-1, -1, -1], [4, 2, 9]])
    discard = torch.tensor([False, False, True])
    got = shim_padded_drafting(shim, sampled, discard, torch.tensor([1, 2, 3]), 100,
                               torch.tensor([0, 3, 4, 8], dtype=torch.int32),
                               torch.tensor([2, 0, 3], dtype=torch.int32))
    assert [t.tolist() for t in got] == [[7, 2, 3], [2, 0, 0], [1, 3, 4], [1, 0, 3]]
