"""The kernel ops as torch.library custom ops (rocdraft::write_kv, ::advance_draft_step,
::prepare_padded_drafting) and the dispatch API the drafter and backends call.

What these tests prove, on the CPU: each op gives the reference's results through both of its
CPU implementations (the shim-compiled HIP kernels and the torch reference fallback); the
schemas declare exactly the arguments each op mutates; the fake impls give the right output
shapes/dtypes under FakeTensorMode, on meta tensors and in AOT dispatch (torch.library.opcheck);
bad arguments raise ValueError naming them; on CPU torch no GPU extension is attempted. What
only a GPU run proves: that the GPU extension builds and loads (hipcc/nvcc), and that the ops
run on the current stream and inside graph capture.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from rocdraft.backends.kv_cache import (NHD, SPLIT_K, LayerKVCache, allocate_kv_cache,
                                        read_kv_nhd, write_kv_reference)
from rocdraft.drafter import index_math
from rocdraft.hip_kernels import build, dispatch, ops

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


@pytest.fixture(scope="module")
def shim():
    try:
        return build.load_cpu_shim()
    except (RuntimeError, OSError) as error:  # no C++ compiler on this machine
        pytest.skip(f"CPU shim extension cannot be built here: {error}")


@pytest.fixture(params=["cpu_shim", "reference"])
def implementation(request, shim, monkeypatch):
    """Run the ops through the shim kernels, or force the torch reference fallback."""
    kernels = shim if request.param == "cpu_shim" else None
    monkeypatch.setattr(ops, "kernels_for", lambda device: kernels)
    return request.param


def write_kv_args(layout=NHD, dtype=FNUZ, per_head=True, num_tokens=6, seed=0):
    """(key, value, cache, slot_mapping) with a padding slot and strided key/value views."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim, block_size = 2, 16, 16
    cache = allocate_kv_cache(1, 4, block_size, num_kv_heads, head_dim, dtype, "cpu", layout,
                              kv_scale=0.5)[0]
    if per_head and cache.is_fp8:
        cache.k_scale = torch.tensor([0.25, 1.5])
        cache.v_scale = torch.tensor([3.0, 0.7])
    src = torch.bfloat16 if cache.is_fp8 else dtype
    qkv = torch.randn(num_tokens + 2, 4 * num_kv_heads * head_dim, generator=gen).to(src) * 10
    key = qkv[:, 2 * num_kv_heads * head_dim:3 * num_kv_heads * head_dim]
    value = qkv[:, 3 * num_kv_heads * head_dim:]
    key = key.view(-1, num_kv_heads, head_dim)
    value = value.view(-1, num_kv_heads, head_dim)
    slots = torch.randperm(4 * block_size, generator=gen)[:num_tokens]
    slots[1] = -1
    return key, value, cache, slots


def clone_cache(cache: LayerKVCache) -> LayerKVCache:
    return LayerKVCache(cache.key.clone(), cache.value.clone(), cache.layout, cache.k_scale,
                        cache.v_scale)


def test_eager_write_kv_hip_skips_the_custom_op_wrapper(implementation, monkeypatch):
    """Eager calls run ops.write_kv_impl directly (the custom op's Python dispatch cost 3.6x
    the op's body on the host); the op itself stays registered for torch.compile / opcheck."""
    key, value, cache, slots = write_kv_args(NHD, torch.float16, False)
    expected = clone_cache(cache)
    write_kv_reference(key, value, expected, slots)

    def refuse(*args, **kwargs):
        raise AssertionError("eager write_kv_hip went through the custom op")
    monkeypatch.setattr(ops, "write_kv", refuse)
    dispatch.write_kv_hip(key, value, cache, slots)
    assert torch.equal(cache.key, expected.key) and torch.equal(cache.value, expected.value)


@pytest.mark.parametrize("layout,dtype,per_head", [(NHD, torch.float16, False),
                                                   (NHD, FN, False), (SPLIT_K, FNUZ, True),
                                                   (SPLIT_K, torch.bfloat16, False)])
def test_write_kv_hip_equals_reference(implementation, layout, dtype, per_head):
    key, value, cache, slots = write_kv_args(layout, dtype, per_head)
    expected = clone_cache(cache)
    write_kv_reference(key, value, expected, slots)
    dispatch.write_kv_hip(key, value, cache, slots)
    assert torch.equal(cache.key.view(torch.uint8), expected.key.view(torch.uint8))
    assert torch.equal(cache.value.view(torch.uint8), expected.value.view(torch.uint8))
    k, _ = read_kv_nhd(cache)  # the written rows read back close to the input
    block, offset = slots[0] // 16, slots[0] % 16
    assert torch.allclose(k[block, offset], key[0].float(), rtol=0.07, atol=0.02)


def test_advance_draft_step_hip_equals_index_math(implementation):
    positions = torch.tensor([4, 9, 30, 0])
    seq_lens = torch.tensor([5, 10, 31, 1], dtype=torch.int32)
    block_table = torch.tensor([[3, 7, 1], [2, 5, 6], [8, 9, 4], [0, 1, 2]], dtype=torch.int32)
    expected = index_math.advance_draft_step(positions, seq_lens, block_table, 4, 10)
    clamped, slots = torch.empty(4, dtype=torch.int64), torch.empty(4, dtype=torch.int64)
    dispatch.advance_draft_step_hip_(positions, seq_lens, block_table, clamped, slots, 4, 10)
    for got, want in zip((positions, clamped, slots, seq_lens), expected):
        assert torch.equal(got, want)


def padded_args():
    return (torch.tensor([[5, 7, -1], [-1, -1, -1], [4, 2, 9], [1, 1, 1]]),
            torch.tensor([False, False, True, False]), torch.tensor([1, 2, 3, 4]), 8,
            torch.tensor([0, 3, 4, 8, 12], dtype=torch.int32),
            torch.tensor([2, 0, 3, 2], dtype=torch.int32))


def test_prepare_padded_drafting_hip_equals_index_math(implementation):
    sampled, discard, backup, vocab_size, qsl, num_draft = padded_args()
    next_ids, count = index_math.prepare_next_token_ids_padded(sampled, discard, backup,
                                                               vocab_size)
    indices, rejected = index_math.prepare_inputs_padded(qsl, num_draft, count)
    got = dispatch.prepare_padded_drafting_hip(*padded_args())
    for g, want in zip(got, (next_ids, count, indices, rejected)):
        assert g.dtype == want.dtype and torch.equal(g, want)


def test_empty_batch_is_valid_whatever_its_strides(implementation):
    """An empty batch launches nothing; its strides carry no meaning (torch.where gives
    sampled [0, 1] strides (1, 0), an empty slice of a block table may have any strides)."""
    accepted = torch.ones(0, 1, dtype=torch.int64)
    sampled = torch.where(torch.arange(1) < accepted, torch.zeros(0, 1, dtype=torch.int64), -1)
    assert sampled.stride() == (1, 0)
    none_i32, none_i64 = torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int64)
    got = dispatch.prepare_padded_drafting_hip(sampled, torch.zeros(0, dtype=torch.bool),
                                               none_i64, 8, torch.zeros(1, dtype=torch.int32),
                                               none_i32)
    assert [(t.shape, t.dtype) for t in got] == [((0,), torch.int64), ((0,), torch.int32),
                                                  ((0,), torch.int64), ((0,), torch.int64)]
    block_table = torch.zeros(1, 1, dtype=torch.int32).expand(0, 3)
    dispatch.advance_draft_step_hip_(none_i64.clone(), none_i32.clone(), block_table,
                                     none_i64.clone(), none_i64.clone(), 4, 10)
    key, value, cache, _ = write_kv_args(NHD, torch.float16, per_head=False)
    empty_key = torch.zeros(1, 2, 1, dtype=torch.float16).expand(0, 2, 16)
    before = clone_cache(cache)
    dispatch.write_kv_hip(empty_key, empty_key, cache, none_i64)
    assert torch.equal(cache.key, before.key) and torch.equal(cache.value, before.value)


def test_opcheck_all_ops(implementation):
    """Schema (declared mutations), fake impls, AOT dispatch with dynamic shapes."""
    for dtype in (torch.bfloat16, FNUZ):
        key, value, cache, slots = write_kv_args(SPLIT_K, dtype, per_head=True)
        # torch's schema checker cannot compare fp8 tensors (no fp8 mul on the CPU)
        utils = ("test_faketensor", "test_aot_dispatch_dynamic") if dtype == FNUZ else "ALL"
        torch.library.opcheck(ops.write_kv, (key, value, cache.key, cache.value, slots,
                                             cache.k_scale, cache.v_scale, cache.layout),
                              test_utils=utils)
    block_table = torch.tensor([[3, 7, 1], [2, 5, 6]], dtype=torch.int32)
    torch.library.opcheck(ops.advance_draft_step, (
        torch.tensor([4, 9]), torch.tensor([5, 10], dtype=torch.int32), block_table,
        torch.empty(2, dtype=torch.int64), torch.empty(2, dtype=torch.int64), 4, 10))
    torch.library.opcheck(ops.prepare_padded_drafting, padded_args())


def test_fake_tensor_mode_gives_output_metadata():
    with FakeTensorMode():
        sampled = torch.empty(5, 4, dtype=torch.int64)
        outputs = ops.prepare_padded_drafting(
            sampled, torch.empty(5, dtype=torch.bool), torch.empty(5, dtype=torch.int64), 100,
            torch.empty(6, dtype=torch.int32), torch.empty(5, dtype=torch.int32))
        assert [(tuple(t.shape), t.dtype) for t in outputs] == [
            ((5,), torch.int64), ((5,), torch.int32), ((5,), torch.int64), ((5,), torch.int64)]
        cache_key = torch.empty(4, 16, 2, 8, dtype=FN)
        ops.write_kv(torch.empty(3, 2, 8), torch.empty(3, 2, 8), cache_key,
                     torch.empty_like(cache_key), torch.empty(3, dtype=torch.int64),
                     torch.ones(1), None, NHD)
        with pytest.raises(ValueError, match="value_cache has shape"):
            ops.write_kv(torch.empty(3, 2, 8), torch.empty(3, 2, 8), cache_key,
                         torch.empty(4, 16, 2, 4, dtype=FN), torch.empty(3, dtype=torch.int64),
                         None, None, NHD)


def test_meta_tensors_use_the_fake_impls():
    positions = torch.empty(3, dtype=torch.int64, device="meta")
    ops.advance_draft_step(positions, torch.empty(3, dtype=torch.int32, device="meta"),
                           torch.empty(3, 2, dtype=torch.int32, device="meta"),
                           torch.empty_like(positions), torch.empty_like(positions), 16, 64)
    outputs = ops.prepare_padded_drafting(
        torch.empty(3, 2, dtype=torch.int64, device="meta"),
        torch.empty(3, dtype=torch.bool, device="meta"),
        torch.empty(3, dtype=torch.int64, device="meta"), 10,
        torch.empty(4, dtype=torch.int32, device="meta"),
        torch.empty(3, dtype=torch.int32, device="meta"))
    assert all(t.device.type == "meta" and t.shape == (3,) for t in outputs)


def bad_write_kv_cases():
    key, value, cache, slots = write_kv_args(NHD, FN, per_head=False)
    base = dict(key=key, value=value, key_cache=cache.key, value_cache=cache.value,
                slot_mapping=slots, k_scale=cache.k_scale, v_scale=cache.v_scale, layout=NHD)
    yield "layout", dict(base, layout="HND"), "unknown KV layout 'HND'"
    yield "slot dtype", dict(base, slot_mapping=slots.int()), "slot_mapping must be"
    yield "too few rows", dict(base, key=key[:2], value=value[:2]), "key has 2 rows"
    yield "input dtype", dict(base, key=key.to(FN), value=value.to(FN)), "cache takes keys in"
    yield "copy dtype", dict(base, key_cache=cache.key.half(), value_cache=cache.value.half()), \
        "must equal the cache dtype"
    yield "scale size", dict(base, k_scale=torch.ones(3)), "k_scale has 3 entries"
    yield "scale dtype", dict(base, v_scale=torch.ones(1, dtype=torch.float64)), "v_scale must"
    yield "cache rank", dict(base, layout=SPLIT_K), "not a SPLIT_K cache"
    yield "strided dim", dict(base, key=key.transpose(1, 2).contiguous().transpose(1, 2)), \
        "head_dim must be contiguous"


@pytest.mark.parametrize("case", list(bad_write_kv_cases()), ids=lambda c: c[0])
def test_write_kv_rejects_bad_arguments(case):
    _, kwargs, message = case
    with pytest.raises(ValueError, match=message):
        ops.write_kv(**kwargs)


def test_other_ops_reject_bad_arguments():
    block_table = torch.zeros(2, 3, dtype=torch.int32)
    i64 = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="seq_lens must be"):
        ops.advance_draft_step(i64.clone(), i64.clone(), block_table, i64.clone(), i64.clone(),
                               4, 10)
    with pytest.raises(ValueError, match="block_table must be int32"):
        ops.advance_draft_step(i64.clone(), torch.zeros(2, dtype=torch.int32),
                               block_table.long(), i64.clone(), i64.clone(), 4, 10)
    with pytest.raises(ValueError, match=r"block_size \(0\)"):
        ops.advance_draft_step(i64.clone(), torch.zeros(2, dtype=torch.int32), block_table,
                               i64.clone(), i64.clone(), 0, 10)
    sampled, discard, backup, vocab_size, qsl, num_draft = padded_args()
    with pytest.raises(ValueError, match="query_start_loc has 4 entries, expected 5"):
        ops.prepare_padded_drafting(sampled, discard, backup, vocab_size, qsl[:4], num_draft)
    with pytest.raises(ValueError, match="sampled must be int64"):
        ops.prepare_padded_drafting(sampled.int(), discard, backup, vocab_size, qsl, num_draft)
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        ops.prepare_padded_drafting(sampled, discard, backup, 0, qsl, num_draft)


def test_no_gpu_extension_on_cpu_torch(monkeypatch):
    """On CPU torch nothing GPU is built: hip_available() is False with a reason; the env
    switch ROCDRAFT_HIP_KERNELS=0 is reported first."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert dispatch.hip_available() is False
    assert "no GPU" in dispatch.hip_unavailable_reason()
    monkeypatch.setenv("ROCDRAFT_HIP_KERNELS", "0")
    assert dispatch.hip_unavailable_reason() == "ROCDRAFT_HIP_KERNELS='0': switched off"
    monkeypatch.setenv("ROCDRAFT_HIP_KERNELS", "off")
    assert dispatch.hip_unavailable_reason() == "ROCDRAFT_HIP_KERNELS='off': switched off"


class NoBinaryKernels:
    """A GPU extension built for other archs: every launch fails as the bindings report it."""

    def __init__(self, message: str):
        self.message, self.launches = message, 0

    def __getattr__(self, op):
        def launch(*args):
            self.launches += 1
            raise RuntimeError(f"{op}: {self.message}")
        return launch


def extension_for_other_archs(monkeypatch, message: str) -> NoBinaryKernels:
    """Pretend ROCm torch with a loaded GPU extension whose launches find no kernel binary."""
    kernels = NoBinaryKernels(message)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(build, "gpu_archs", lambda environ=None: ("gfx942",))
    monkeypatch.setattr(build, "_LOADED", {build.GPU_EXT: kernels})
    monkeypatch.setattr(ops, "kernels_for", lambda device: build.load_gpu_extension())
    return kernels


def test_launch_without_a_binary_for_the_gpu_falls_back_once(monkeypatch, caplog):
    """An extension built for gfx942 on a gfx90a GPU: the first launch's "no kernel image"
    disables it with a logged reason and the torch reference answers; later calls never try
    the extension again and hip_available() turns False, so callers take Triton/torch."""
    kernels = extension_for_other_archs(monkeypatch, (
        "no kernel image for this GPU (error 98: invalid device function / no kernel image); "
        "the extension was built for other archs"))
    assert dispatch.hip_available()
    sampled, discard, backup, vocab_size, qsl, num_draft = padded_args()
    next_ids, count = index_math.prepare_next_token_ids_padded(sampled, discard, backup,
                                                               vocab_size)
    indices, rejected = index_math.prepare_inputs_padded(qsl, num_draft, count)
    with caplog.at_level("WARNING", logger=dispatch.__name__):
        for _ in range(2):
            got = dispatch.prepare_padded_drafting_hip(*padded_args())
            for g, want in zip(got, (next_ids, count, indices, rejected)):
                assert torch.equal(g, want)
        key, value, cache, slots = write_kv_args(NHD, torch.float16, per_head=False)
        expected = clone_cache(cache)
        write_kv_reference(key, value, expected, slots)
        dispatch.write_kv_hip(key, value, cache, slots)
        assert torch.equal(cache.key, expected.key)
    assert kernels.launches == 1
    assert not dispatch.hip_available()
    assert "no kernel for this GPU" in dispatch.hip_unavailable_reason()
    assert "gfx942" in dispatch.hip_unavailable_reason()
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "Triton/torch" in warnings[0].getMessage()


def test_other_launch_errors_still_raise(monkeypatch):
    extension_for_other_archs(monkeypatch, "kernel launch failed with error 700")
    with pytest.raises(RuntimeError, match="error 700"):
        dispatch.prepare_padded_drafting_hip(*padded_args())
    assert dispatch.hip_available()


def test_the_bindings_report_a_missing_binary_in_words_dispatch_matches():
    """The message of torch_ops.h's check_launch for error 98 / 209 is what dispatch matches."""
    source = (build.CSRC / "torch_ops.h").read_text(encoding="utf-8")
    assert "kInvalidDeviceFunction = 98" in source and "kNoBinaryForGpu = 209" in source
    assert all(marker in source for marker in dispatch.NO_BINARY_MARKERS)
    assert dispatch.is_missing_binary(RuntimeError("HIP error: invalid device function"))
    assert not dispatch.is_missing_binary(RuntimeError("out of memory"))


def test_cpu_tensors_use_the_shim_only_once_it_is_loaded(shim):
    assert ops.kernels_for(torch.device("cpu")) is shim
    assert ops.kernels_for(torch.device("meta")) is None
