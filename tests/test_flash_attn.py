"""FLASH_ATTN: contract tests against an EMULATED flash_attn, on the CPU. Not a hardware run.

The ``flash_vendor`` fixture puts the TEST-ONLY emulation (tests/vendor_emulation) in
``sys.modules["flash_attn"]`` for one test and makes the GPU check pass; the backend's real
adapter code then runs on CPU tensors and is compared with TORCH_SDPA. The emulation raises
whenever a call breaks flash-attn's documented preconditions (page size multiple of 256, int32
cu_seqlens / cache_seqlens / block_table, fp16/bf16, contiguous last dim), so these tests prove
the adapter, not the kernels. Where flash_attn is really usable (a GPU + the package) the same
tests run against it on the GPU and the emulation-only checks skip. Hardware equality lives in
tests/test_gpu_vendor_backends.py.
"""
from __future__ import annotations


import pytest
import torch

from rocdraft.backends import flash_attn as flash_attn_backend
from rocdraft.backends import registry
from rocdraft.backends.base import Feature, GraphCapture
from rocdraft.backends.kv_cache import NHD, SPLIT_K, read_kv_nhd
from rocdraft.errors import BackendUnavailableError, RocdraftError, UnsupportedFeatureError
from vendor_emulation import (Vendor, VendorContractError, install_vendor, make_step, random_cache, random_qkv,
                              run_against_torch_sdpa)
from vendor_emulation import flash_attn_emulation

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 64, 256, 8
BATCHES = {  # name: (query_lens, seq_lens); seq lens cross the 256-token page boundary
    "mixed": ([1, 5, 3, 1], [9, 5, 300, 40]),  # decode, prefill, 1 + 2 verify, decode
    "decode": ([1, 1, 1], [7, 260, 17]),
    "verify": ([4, 4, 4], [10, 4, 270]),  # 1 + 3 draft tokens each
    "draft_step": ([2, 2], [3, 2]),
}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


@pytest.fixture
def flash_vendor(monkeypatch) -> Vendor:
    """The real flash_attn where it can run, else the emulation; every API call is recorded."""
    return install_vendor(monkeypatch, "flash_attn", flash_attn_backend.FlashAttnBackend.availability() is None, flash_attn_emulation.make_flash_attn_module, flash_attn_emulation.API,
                          lambda: monkeypatch.setattr(flash_attn_backend, "_gpu_present", lambda: True))


def _run(vendor: Vendor, batch: str, dtype=torch.bfloat16, num_heads=NUM_HEADS,
         num_kv_heads=NUM_KV_HEADS, build=None):
    query_lens, seq_lens = BATCHES[batch]
    common = make_step(query_lens, seq_lens, BLOCK_SIZE, NUM_BLOCKS, vendor.device,
                       num_padding_tokens=2)
    cache = random_cache(NHD, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM, dtype,
                         vendor.device)
    q, k, v = random_qkv(common.slot_mapping.shape[0], num_heads, num_kv_heads, HEAD_DIM, dtype,
                         vendor.device)
    return run_against_torch_sdpa("FLASH_ATTN", common, cache, q, k, v, num_heads,
                                  num_kv_heads, HEAD_DIM, build=build)


def _assert_same(out, ref, cache_out, cache_ref, atol):
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)
    for got, want in zip(read_kv_nhd(cache_out), read_kv_nhd(cache_ref)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


class TestContractEmulatedFlashAttn:
    """Adapter vs TORCH_SDPA through the (emulated unless on a GPU) flash_attn API."""

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("batch", sorted(BATCHES))
    def test_contract_emulated_matches_torch_sdpa(self, flash_vendor, batch, dtype):
        out, ref, cache_out, cache_ref = _run(flash_vendor, batch, dtype)
        _assert_same(out, ref, cache_out, cache_ref, TOLERANCE[dtype])
        uniform = batch != "mixed"
        assert ("flash_attn_with_kvcache" in flash_vendor.calls) == uniform
        assert ("flash_attn_varlen_func" in flash_vendor.calls) == (not uniform)

    @pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 2), (4, 4), (4, 1)])
    @pytest.mark.parametrize("batch", ["mixed", "verify"])
    def test_contract_emulated_gqa(self, flash_vendor, batch, num_heads, num_kv_heads):
        results = _run(flash_vendor, batch, num_heads=num_heads, num_kv_heads=num_kv_heads)
        _assert_same(*results, atol=TOLERANCE[torch.bfloat16])

    def test_contract_emulated_multi_token_draft_step_built_for_drafting(self, flash_vendor):
        results = _run(flash_vendor, "draft_step",
                       build=lambda builder, common: builder.build_for_drafting(common, 1))
        _assert_same(*results, atol=TOLERANCE[torch.bfloat16])

    def test_contract_emulated_emulation_enforces_preconditions(self, flash_vendor):
        if not flash_vendor.emulated:
            pytest.skip("checks the emulation itself")
        q = torch.zeros(2, 1, NUM_HEADS, HEAD_DIM, dtype=torch.float16)
        small_pages = torch.zeros(4, 128, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float16)
        seqlens = torch.tensor([5, 9], dtype=torch.int32)
        table = torch.zeros(2, 1, dtype=torch.int32)
        with pytest.raises(VendorContractError, match="multiple of 256"):
            flash_attn_emulation.flash_attn_with_kvcache(
                q, small_pages, small_pages, cache_seqlens=seqlens, block_table=table,
                causal=True)
        pages = torch.zeros(4, 256, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float16)
        with pytest.raises(VendorContractError, match="int32"):
            flash_attn_emulation.flash_attn_with_kvcache(
                q, pages, pages, cache_seqlens=seqlens.long(), block_table=table, causal=True)
        flat = torch.zeros(4, NUM_HEADS, HEAD_DIM, dtype=torch.float16)
        cu = torch.tensor([0, 2, 4], dtype=torch.int32)
        with pytest.raises(VendorContractError, match="max_seqlen_k"):
            flash_attn_emulation.flash_attn_varlen_func(flat, flat, flat, cu, cu, 2, 1)


def test_emulation_refuses_head_dims_above_256():
    q = torch.zeros(2, 1, NUM_HEADS, 264, dtype=torch.float16)
    pages = torch.zeros(2, 256, NUM_KV_HEADS, 264, dtype=torch.float16)
    with pytest.raises(VendorContractError, match="at most 256"):
        flash_attn_emulation.flash_attn_with_kvcache(
            q, pages, pages, cache_seqlens=torch.tensor([3, 4], dtype=torch.int32),
            block_table=torch.zeros(2, 1, dtype=torch.int32), causal=True)
    flat = torch.zeros(4, NUM_HEADS, 264, dtype=torch.float16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(VendorContractError, match="at most 256"):
        flash_attn_emulation.flash_attn_varlen_func(flat, flat[:, :2], flat[:, :2], cu, cu, 4, 4)


def test_uniform_query_len_from_host_ints_only():
    assert flash_attn_backend.uniform_query_len(make_step([3, 3], [5, 9], 256, 2, "cpu")) == 3
    assert flash_attn_backend.uniform_query_len(make_step([1, 2], [5, 9], 256, 2, "cpu")) is None
    common = make_step([2, 2], [5, 9], 256, 2, "meta")  # any host read of a device tensor raises
    meta = flash_attn_backend.FlashAttnBuilder("meta").build_for_drafting(common, draft_index=1)
    assert meta.uniform_query_len == 2


def test_tree_drafting_is_refused_naming_the_backends_that_can():
    with pytest.raises(UnsupportedFeatureError, match="TORCH_SDPA"):
        registry.require("FLASH_ATTN", Feature.TREE_DRAFTING)
    common = make_step([2, 2], [4, 6], 256, 2, "cpu").with_updates(
        spec_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(UnsupportedFeatureError, match="TORCH_SDPA"):
        flash_attn_backend.FlashAttnBuilder("cpu").build(common)


def test_capabilities_are_declared_honestly():
    caps = flash_attn_backend.FlashAttnBackend.capabilities
    assert caps.multi_token_drafting and not caps.tree_drafting
    assert caps.graph_capture is GraphCapture.UNIFORM_DECODE
    assert caps.platforms == ("rocm", "cuda") and caps.kv_layouts == (NHD,)
    assert caps.config_problem(256, 128, torch.float16) is None
    assert caps.config_problem(512, 64, torch.bfloat16) is None
    assert "block_size" in caps.config_problem(16, 128, torch.float16)
    assert caps.config_problem(256, 256, torch.float16) is None
    assert "head_dim" in caps.config_problem(256, 264, torch.float16)
    assert "dtype" in caps.config_problem(256, 128, torch.float32)
    assert "kv cache dtype" in caps.config_problem(256, 128, torch.float16, torch.float8_e4m3fn)


def test_cpu_selection_and_availability_reasons():
    with pytest.raises(BackendUnavailableError, match="FLASH_ATTN") as info:
        registry.select_backend("cpu", "FLASH_ATTN")
    assert "\n" not in str(info.value)
    if not torch.cuda.is_available():
        assert "GPU" in flash_attn_backend.FlashAttnBackend.availability()


@pytest.mark.parametrize("case", ["fp32", "fp8", "split_k", "head_dim"])
def test_unsupported_inputs_are_user_errors(case):
    dtype = torch.float32 if case == "fp32" else torch.float16
    cache_dtype = torch.float8_e4m3fn if case == "fp8" else dtype
    layout, block_size = (SPLIT_K, 16) if case == "split_k" else (NHD, BLOCK_SIZE)
    head_dim = 264 if case == "head_dim" else HEAD_DIM
    impl = flash_attn_backend.FlashAttnImpl(NUM_HEADS, NUM_KV_HEADS, head_dim, head_dim ** -0.5)
    common = make_step([1], [3], block_size, 2, "cpu")
    cache = random_cache(layout, 2, block_size, NUM_KV_HEADS, head_dim, cache_dtype, "cpu")
    q, k, v = random_qkv(1, NUM_HEADS, NUM_KV_HEADS, head_dim, dtype, "cpu")
    expected = {"fp32": "float32", "fp8": "float8_e4m3fn", "split_k": "SPLIT_K",
                "head_dim": "head_dim 264"}[case]
    with pytest.raises(RocdraftError, match=expected):
        impl.forward(q, k, v, cache, flash_attn_backend.FlashAttnBuilder("cpu").build(common))
