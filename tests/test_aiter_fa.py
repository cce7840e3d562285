"""ROCM_AITER_FA: contract tests against an EMULATED aiter, on the CPU. Not a hardware run.

The ``aiter_vendor`` fixture puts the TEST-ONLY emulation (tests/vendor_emulation) in
``sys.modules["aiter"]`` for one test and makes the ROCm check pass; the backend's real adapter
code then runs on CPU tensors and is compared with TORCH_SDPA. The emulation raises whenever a
call breaks aiter's documented preconditions, so these tests prove the adapter's calls, kernel
choice and index math, not the kernels. Where aiter is really usable (ROCm torch + amd-aiter)
the same tests run against the real package on the GPU and the emulation-only checks skip.
Hardware equality lives in tests/test_gpu_vendor_backends.py.
"""
from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rocdraft import envs
from rocdraft.backends import aiter_fa, registry
from rocdraft.backends.base import Feature, GraphCapture
from rocdraft.backends.kv_cache import NHD, SPLIT_K, read_kv_nhd
from rocdraft.backends.varlen_context import build_varlen_context, exact_kv_rows, gather_kv
from rocdraft.errors import BackendUnavailableError, RocdraftError, UnsupportedFeatureError
from rocdraft.platform import detect_platform
from vendor_emulation import (Vendor, VendorContractError, install_vendor, make_step, random_cache, random_qkv,
                              run_against_torch_sdpa)
from vendor_emulation import aiter_emulation

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_BLOCKS = 4, 2, 64, 24
BATCHES = {  # name: (query_lens, seq_lens)
    "mixed": ([1, 5, 3, 1], [9, 5, 20, 40]),  # decode, prefill, 1 + 2 verify, decode
    "decode": ([1, 1, 1], [7, 30, 17]),
    "verify": ([4, 4, 4], [10, 4, 35]),  # 1 + 3 draft tokens each
}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


@pytest.fixture
def aiter_vendor(monkeypatch) -> Vendor:
    """The real aiter where it can run, else the emulation; every API call is recorded."""
    return install_vendor(monkeypatch, "aiter", aiter_fa.AiterFABackend.availability() is None, aiter_emulation.make_aiter_module, aiter_emulation.API,
                          lambda: monkeypatch.setattr(aiter_fa, "_on_rocm", lambda: True))


def _run(vendor: Vendor, batch: str, block_size: int, dtype=torch.bfloat16, layout=NHD,
         cache_dtype=None, kv_scale=1.0, head_dim=HEAD_DIM, num_padding_tokens=2, build=None):
    query_lens, seq_lens = BATCHES[batch]
    common = make_step(query_lens, seq_lens, block_size, NUM_BLOCKS, vendor.device,
                       num_padding_tokens=num_padding_tokens)
    cache = random_cache(layout, NUM_BLOCKS, block_size, NUM_KV_HEADS, head_dim,
                         cache_dtype or dtype, vendor.device, scale=kv_scale)
    q, k, v = random_qkv(common.slot_mapping.shape[0], NUM_HEADS, NUM_KV_HEADS, head_dim, dtype,
                         vendor.device)
    return run_against_torch_sdpa("ROCM_AITER_FA", common, cache, q, k, v, NUM_HEADS,
                                  NUM_KV_HEADS, head_dim, build=build)


def _assert_same(out, ref, cache_out, cache_ref, atol):
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)
    for got, want in zip(read_kv_nhd(cache_out), read_kv_nhd(cache_ref)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


class TestContractEmulatedAiter:
    """Adapter vs TORCH_SDPA through the (emulated unless on ROCm) aiter API."""

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("block_size", [16, 32, 48, 128])
    @pytest.mark.parametrize("batch", sorted(BATCHES))
    def test_contract_emulated_matches_torch_sdpa(self, aiter_vendor, batch, block_size, dtype):
        out, ref, cache_out, cache_ref = _run(aiter_vendor, batch, block_size, dtype)
        _assert_same(out, ref, cache_out, cache_ref, TOLERANCE[dtype])
        calls = aiter_vendor.calls
        assert "reshape_and_cache_flash" in calls
        if batch == "decode" and block_size in aiter_fa.DECODE_BLOCK_SIZES:
            assert "paged_attention_v1" in calls and "flash_attn_varlen_func" not in calls
        else:
            assert "flash_attn_varlen_func" in calls and "paged_attention_v1" not in calls

    @pytest.mark.parametrize("block_size", [16, 32])
    def test_contract_emulated_multi_token_queries_never_reach_decode_kernel(
            self, aiter_vendor, block_size):
        # 1 + k verification and a multi-token draft step (built for drafting) with a block
        # size the decode kernel would accept: they must still take the varlen path.
        for build in (None, lambda builder, common: builder.build_for_drafting(common, 1)):
            aiter_vendor.calls.clear()
            out, ref, cache_out, cache_ref = _run(aiter_vendor, "verify", block_size,
                                                  build=build)
            _assert_same(out, ref, cache_out, cache_ref, TOLERANCE[torch.bfloat16])
            assert "paged_attention_v1" not in aiter_vendor.calls
            assert "flash_attn_varlen_func" in aiter_vendor.calls

    def test_contract_emulated_suite_catches_multi_token_decode_routing(self, aiter_vendor,
                                                                         monkeypatch):
        # vLLM's old bug, re-created: route 1 + k queries to the decode kernel. The emulated
        # kernel refuses (it checks one query per sequence through cu_query_lens).
        if not aiter_vendor.emulated:
            pytest.skip("checks the emulation's precondition, not the real kernel")
        monkeypatch.setattr(aiter_fa, "choose_path", lambda *args: aiter_fa.DECODE_V1)
        with pytest.raises(VendorContractError, match="exactly 1 query token"):
            _run(aiter_vendor, "verify", 16)

    @pytest.mark.parametrize("batch", ["decode", "mixed"])
    def test_contract_emulated_fp8_e4m3fnuz_cache(self, aiter_vendor, batch):
        out, ref, cache_out, cache_ref = _run(aiter_vendor, batch, 16,
                                              cache_dtype=torch.float8_e4m3fnuz, kv_scale=0.5)
        _assert_same(out, ref, cache_out, cache_ref, atol=3e-2)
        assert "reshape_and_cache_flash" in aiter_vendor.calls
        decode = "paged_attention_v1" in aiter_vendor.calls
        assert decode == (batch == "decode")

    def test_contract_emulated_fp8_per_head_scales_use_reference_write(self, aiter_vendor):
        query_lens, seq_lens = BATCHES["mixed"]
        common = make_step(query_lens, seq_lens, 16, NUM_BLOCKS, aiter_vendor.device)
        cache = random_cache(NHD, NUM_BLOCKS, 16, NUM_KV_HEADS, HEAD_DIM,
                             torch.float8_e4m3fnuz, aiter_vendor.device)
        cache.k_scale = torch.tensor([0.5, 0.25], device=aiter_vendor.device)
        cache.v_scale = torch.tensor([0.75, 1.0], device=aiter_vendor.device)
        q, k, v = random_qkv(common.slot_mapping.shape[0], NUM_HEADS, NUM_KV_HEADS, HEAD_DIM,
                             torch.bfloat16, aiter_vendor.device)
        results = run_against_torch_sdpa("ROCM_AITER_FA", common, cache, q, k, v, NUM_HEADS,
                                         NUM_KV_HEADS, HEAD_DIM)
        _assert_same(*results, atol=3e-2)
        assert "reshape_and_cache_flash" not in aiter_vendor.calls

    @pytest.mark.parametrize("batch", ["decode", "mixed"])
    def test_contract_emulated_split_k_asm_layout(self, aiter_vendor, monkeypatch, batch):
        if not aiter_vendor.emulated and detect_platform().arch not in ("gfx942", "gfx950"):
            pytest.skip("aiter ships pa_fwd_asm for gfx942/gfx950 only")
        monkeypatch.setenv("ROCDRAFT_AITER_ASM_LAYOUT", "1")
        layout = aiter_fa.AiterFABackend.kv_cache_layout()
        assert layout == SPLIT_K
        out, ref, cache_out, cache_ref = _run(aiter_vendor, batch, 16, layout=layout,
                                              head_dim=128)
        _assert_same(out, ref, cache_out, cache_ref, TOLERANCE[torch.bfloat16])
        assert "reshape_and_cache" in aiter_vendor.calls
        assert ("pa_fwd_asm" in aiter_vendor.calls) == (batch == "decode")
        assert "paged_attention_v1" not in aiter_vendor.calls

    def test_contract_emulated_emulation_enforces_preconditions(self, aiter_vendor):
        if not aiter_vendor.emulated:
            pytest.skip("checks the emulation itself")
        q = torch.zeros(4, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        pages = torch.zeros(2, 64, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        cu = torch.tensor([0, 4], dtype=torch.int32)
        table = torch.zeros(1, 2, dtype=torch.int32)
        with pytest.raises(VendorContractError, match="multiple of 128"):
            aiter_emulation.flash_attn_varlen_func(q, pages, pages, cu, cu, 4, 4,
                                                   block_table=table)
        with pytest.raises(VendorContractError, match="int32"):
            aiter_emulation.flash_attn_varlen_func(q, q[:, :2], q[:, :2], cu.long(), cu, 4, 4)
        with pytest.raises(VendorContractError, match="fp16/bf16"):
            aiter_emulation.flash_attn_varlen_func(q.float(), q[:, :2].float(),
                                                   q[:, :2].float(), cu, cu, 4, 4)


def test_choose_path_sends_only_single_token_batches_to_decode_kernels():
    def path(single, layout=NHD, block_size=16, head_dim=128, dtype=torch.bfloat16, fp8=False,
             per_tensor=True, scale=128 ** -0.5):
        return aiter_fa.choose_path(single, layout, block_size, head_dim, dtype, fp8,
                                    per_tensor, scale)

    assert path(True) == aiter_fa.DECODE_V1
    assert path(True, block_size=32, fp8=True) == aiter_fa.DECODE_V1
    assert path(True, fp8=True, per_tensor=False) == aiter_fa.VARLEN_GATHERED
    assert path(True, block_size=128) == aiter_fa.VARLEN_PAGED
    assert path(True, layout=SPLIT_K) == aiter_fa.DECODE_ASM
    assert path(True, layout=SPLIT_K, scale=0.1) == aiter_fa.VARLEN_GATHERED
    assert path(True, layout=SPLIT_K, head_dim=64, scale=0.125) == aiter_fa.VARLEN_GATHERED
    for kwargs in ({}, {"block_size": 32}, {"layout": SPLIT_K}, {"fp8": True}):
        assert path(False, **kwargs) in (aiter_fa.VARLEN_GATHERED, aiter_fa.VARLEN_PAGED)
    assert path(False, block_size=256) == aiter_fa.VARLEN_PAGED
    assert path(False, block_size=256, fp8=True) == aiter_fa.VARLEN_GATHERED


@pytest.mark.parametrize("query_lens, single", [([1, 1, 1], True), ([1, 2, 1], False)])
def test_build_for_drafting_reads_no_device_tensor(query_lens, single):
    # Device tensors live on "meta": any host read (.item(), .tolist(), bool()) would raise.
    common = make_step(query_lens, [5, 9, 3], 16, 8, "meta")
    meta = aiter_fa.AiterFABuilder("meta").build_for_drafting(common, draft_index=1)
    assert meta.single_token_queries is single
    assert meta.varlen.kv_req.device.type == "meta"


def test_tree_drafting_is_refused_naming_the_backends_that_can():
    with pytest.raises(UnsupportedFeatureError, match="TORCH_SDPA") as info:
        registry.require("ROCM_AITER_FA", Feature.TREE_DRAFTING)
    assert "ROCM_AITER_FA" not in info.value.args[0].split("backends that do:")[1]
    common = make_step([2, 2], [4, 6], 16, 4, "cpu").with_updates(
        spec_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(UnsupportedFeatureError, match="TORCH_SDPA"):
        aiter_fa.AiterFABuilder("cpu").build(common)


def test_cpu_selection_gives_a_one_line_reason(monkeypatch):
    monkeypatch.setenv("ROCDRAFT_ATTENTION_BACKEND", "ROCM_AITER_FA")
    with pytest.raises(BackendUnavailableError) as info:
        registry.select_backend("cpu", envs.attention_backend())
    message = str(info.value)
    assert "\n" not in message and "ROCM_AITER_FA" in message and "rocm" in message
    with pytest.raises(BackendUnavailableError, match="ROCM_AITER_FA"):
        registry.select_backend("cpu", "ROCM_AITER_FA")


def test_availability_reasons(monkeypatch):
    if aiter_fa.AiterFABackend.availability() is None:
        pytest.skip("aiter is usable here")
    monkeypatch.setattr(aiter_fa, "_on_rocm", lambda: False)
    assert "torch.version.hip" in aiter_fa.AiterFABackend.availability()
    monkeypatch.setattr(aiter_fa, "_on_rocm", lambda: True)
    monkeypatch.delitem(sys.modules, "aiter", raising=False)
    reason = aiter_fa.AiterFABackend.availability()
    assert reason and ("amd-aiter" in reason or "import aiter failed" in reason)


def test_capabilities_are_declared_honestly():
    caps = aiter_fa.AiterFABackend.capabilities
    assert caps.multi_token_drafting and not caps.tree_drafting
    assert caps.graph_capture is GraphCapture.UNIFORM_DECODE
    assert caps.platforms == ("rocm",)
    assert caps.config_problem(16, 128, torch.bfloat16) is None
    assert caps.config_problem(16, 128, torch.bfloat16, torch.float8_e4m3fnuz) is None
    assert "dtype" in caps.config_problem(16, 128, torch.float32)
    assert "block_size" in caps.config_problem(8, 128, torch.bfloat16)
    assert "head_dim" in caps.config_problem(16, 96, torch.bfloat16)
    assert "kv cache dtype" in caps.config_problem(16, 128, torch.bfloat16, torch.float8_e4m3fn)


def test_fp32_query_is_a_user_error_naming_the_dtype():
    impl = aiter_fa.AiterFAImpl(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    common = make_step([1], [3], 16, 2, "cpu")
    cache = random_cache(NHD, 2, 16, NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    q, k, v = random_qkv(1, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    with pytest.raises(RocdraftError, match="float32"):
        impl.forward(q, k, v, cache, aiter_fa.AiterFABuilder("cpu").build(common))


class TestVarlenContext:
    """varlen_context.gather_kv against a naive per-request loop over read_kv_nhd."""

    @settings(max_examples=25, deadline=None)
    @given(seq_lens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
           block_size=st.sampled_from([8, 16]), layout=st.sampled_from([NHD, SPLIT_K]),
           slack=st.integers(0, 5))
    def test_gather_matches_naive_loop(self, seq_lens, block_size, layout, slack):
        common = make_step([1] * len(seq_lens), seq_lens, block_size, 32, "cpu")
        cache = random_cache(layout, 32, block_size, 2, 16, torch.float16, "cpu")
        ctx = build_varlen_context(common, exact_kv_rows(common) + slack)  # slack: upper bound
        key, value = gather_kv(cache, common.block_table, ctx, torch.float16)
        key_nhd, value_nhd = read_kv_nhd(cache)
        assert ctx.cu_seqlens_k.tolist() == [0] + torch.tensor(seq_lens).cumsum(0).tolist()
        row = 0
        for req, seq_len in enumerate(seq_lens):
            for pos in range(seq_len):
                block = int(common.block_table[req, pos // block_size])
                want_k = key_nhd[block, pos % block_size].half()
                want_v = value_nhd[block, pos % block_size].half()
                assert torch.equal(key[row], want_k) and torch.equal(value[row], want_v)
                row += 1
        assert key.shape[0] == row + slack
