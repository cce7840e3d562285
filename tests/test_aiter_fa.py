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
from rocdraft.backends.kv_cache import NHD, SPLIT_K, read_kv_nhd, write_kv_reference
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
         cache_dtype=None, kv_scale=1.0, head_dim=HEAD_DIM, num_padding_tokens=2, build=None,
         num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, num_blocks=NUM_BLOCKS):
    query_lens, seq_lens = BATCHES[batch]
    common = make_step(query_lens, seq_lens, block_size, num_blocks, vendor.device,
                       num_padding_tokens=num_padding_tokens)
    cache = random_cache(layout, num_blocks, block_size, num_kv_heads, head_dim,
                         cache_dtype or dtype, vendor.device, scale=kv_scale)
    q, k, v = random_qkv(common.slot_mapping.shape[0], num_heads, num_kv_heads, head_dim, dtype,
                         vendor.device)
    return run_against_torch_sdpa("ROCM_AITER_FA", common, cache, q, k, v, num_heads,
                                  num_kv_heads, head_dim, build=build)


def _assert_same(out, ref, cache_out, cache_ref, atol):
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)
    for got, want in zip(read_kv_nhd(cache_out), read_kv_nhd(cache_ref)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


# aiter writes fp8 as x * (1 / scale) (cache_kernels.cu), the reference write as x / scale.
# The two float32 results differ by at most one float32 ulp, so after rounding to fp8 they can
# differ by at most ONE fp8 ulp, and only where x / scale lies within a float32 ulp of an fp8
# rounding midpoint: for fp16/bf16 inputs and scale 0.37 that never happens (checked over every
# finite bf16 and fp16 value), for 0.3 once (test_emulated_aiter_fp8_write_...). Tolerance:
# one fp8 ulp on at most FP8_DIFF_FRACTION of the entries.
FP8_DIFF_FRACTION = 1e-3
FP8_SCALE = 0.37  # not a power of two: x * (1 / s) and x / s are not the same operation


def _fp8_ulp_distance(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|code difference| of same-signed fp8 values (a huge value where the signs differ)."""
    g, w = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    same_sign = (g >> 7) == (w >> 7)
    return torch.where(same_sign, ((g & 0x7F) - (w & 0x7F)).abs(), 1 << 8)


def _assert_fp8_caches_close(cache_out, cache_ref):
    for got, want in ((cache_out.key, cache_ref.key), (cache_out.value, cache_ref.value)):
        distance = _fp8_ulp_distance(got, want)
        assert int(distance.max()) <= 1, "aiter's fp8 write is more than one ulp off"
        assert float((distance > 0).float().mean()) <= FP8_DIFF_FRACTION


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
        if batch == "decode" and block_size in aiter_fa.V1_BLOCK_SIZES:
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
        monkeypatch.setattr(aiter_fa, "choose_path",
                            lambda *args: aiter_fa.PathChoice(aiter_fa.DECODE_V1, "forced"))
        with pytest.raises(VendorContractError, match="exactly 1 query token"):
            _run(aiter_vendor, "verify", 16)

    @pytest.mark.parametrize("batch", ["decode", "mixed"])
    def test_contract_emulated_fp8_e4m3fnuz_cache(self, aiter_vendor, batch):
        out, ref, cache_out, cache_ref = _run(aiter_vendor, batch, 16,
                                              cache_dtype=torch.float8_e4m3fnuz,
                                              kv_scale=FP8_SCALE)
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=0)
        _assert_fp8_caches_close(cache_out, cache_ref)
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

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("batch", ["decode", "mixed"])
    def test_contract_emulated_split_k_asm_layout(self, aiter_vendor, monkeypatch, batch,
                                                  dtype):
        if not aiter_vendor.emulated and detect_platform().arch not in ("gfx942", "gfx950"):
            pytest.skip("aiter ships pa_fwd_asm for gfx942/gfx950 only")
        monkeypatch.setenv("ROCDRAFT_AITER_ASM_LAYOUT", "1")
        layout = aiter_fa.AiterFABackend.kv_cache_layout()
        assert layout == SPLIT_K
        out, ref, cache_out, cache_ref = _run(aiter_vendor, batch, 16, dtype, layout=layout,
                                              head_dim=128)
        _assert_same(out, ref, cache_out, cache_ref, TOLERANCE[dtype])
        assert "reshape_and_cache" in aiter_vendor.calls
        assert ("pa_fwd_asm" in aiter_vendor.calls) == (batch == "decode")
        assert "paged_attention_v1" not in aiter_vendor.calls

    @pytest.mark.parametrize("num_blocks", [24, 64])  # 24: v3 would read past the cache
    @pytest.mark.parametrize("batch", ["verify", "mixed"])
    def test_contract_emulated_bf16_head_dim_128_paged_cache(self, aiter_vendor, batch,
                                                             num_blocks):
        # Llama-3 / Qwen2 / Mistral in bf16 with 128-token pages: aiter sends this to
        # fmha_v3_varlen_fwd, which ignores block_table, so the pages must be gathered first.
        out, ref, cache_out, cache_ref = _run(aiter_vendor, batch, 128, torch.bfloat16,
                                              head_dim=128, num_blocks=num_blocks)
        _assert_same(out, ref, cache_out, cache_ref, TOLERANCE[torch.bfloat16])
        assert "flash_attn_varlen_func" in aiter_vendor.calls

    @pytest.mark.parametrize("dtype, head_dim", [(torch.float16, 128), (torch.bfloat16, 64)])
    def test_contract_emulated_ck_varlen_with_128_token_pages(self, aiter_vendor, dtype,
                                                              head_dim):
        # aiter's CK path cannot take a block_table at all (cmdGenFunc_mha_varlen_fwd raises
        # UnboundLocalError), so these must be gathered too.
        out, ref, cache_out, cache_ref = _run(aiter_vendor, "verify", 128, dtype,
                                              head_dim=head_dim)
        _assert_same(out, ref, cache_out, cache_ref, TOLERANCE[dtype])
        assert "flash_attn_varlen_func" in aiter_vendor.calls

    @pytest.mark.parametrize("num_heads, asm", [(2, True), (16, True), (32, True),
                                                (48, False), (64, False)])
    def test_contract_emulated_split_k_decode_gqa_ratios(self, aiter_vendor, monkeypatch,
                                                         num_heads, asm):
        # pa_asm.csv has bf16 kernels for GQA 8 and 16 only (ratios round up to a multiple of
        # 8): ratios 1, 8, 16 run pa_fwd_asm, 24 and 32 fall back to the varlen path.
        if not aiter_vendor.emulated and detect_platform().arch not in ("gfx942", "gfx950"):
            pytest.skip("aiter ships pa_fwd_asm for gfx942/gfx950 only")
        monkeypatch.setenv("ROCDRAFT_AITER_ASM_LAYOUT", "1")
        out, ref, cache_out, cache_ref = _run(aiter_vendor, "decode", 16, layout=SPLIT_K,
                                              head_dim=128, num_heads=num_heads)
        _assert_same(out, ref, cache_out, cache_ref, TOLERANCE[torch.bfloat16])
        assert ("pa_fwd_asm" in aiter_vendor.calls) == asm
        assert ("flash_attn_varlen_func" in aiter_vendor.calls) == (not asm)

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


def _choice(single, layout=NHD, block_size=16, head_dim=128, gqa=2, dtype=torch.bfloat16,
            fp8=False, per_tensor=True, scale=None) -> aiter_fa.PathChoice:
    scale = head_dim ** -0.5 if scale is None else scale
    return aiter_fa.choose_path(single, layout, block_size, head_dim, gqa, dtype, fp8,
                                per_tensor, scale)


def _path(*args, **kwargs) -> str:
    return _choice(*args, **kwargs).path


@pytest.mark.parametrize("option", [{"min_seqlen_q": 1}, {"dropout_p": 0.1},
                                    {"logits_soft_cap": 30.0}, {"window_size": (8, 0)},
                                    {"return_lse": True}, {"return_attn_probs": True},
                                    {"cu_seqlens_q_padded": "cu"}, {"cu_seqlens_k_padded": "cu"},
                                    {"alibi_slopes": torch.zeros(NUM_HEADS)}])
def test_emulated_varlen_refuses_options_it_does_not_model(option):
    q = torch.zeros(4, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    kv = torch.zeros(4, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    option = {k: cu if isinstance(v, str) else v for k, v in option.items()}
    with pytest.raises(VendorContractError, match="emulation covers"):
        aiter_emulation.flash_attn_varlen_func(q, kv, kv, cu, cu, 4, 4, **option)


@pytest.mark.parametrize("dtype, head_dim, v3", [(torch.bfloat16, 128, True),
                                                 (torch.float16, 128, False),
                                                 (torch.bfloat16, 64, False)])
def test_emulated_varlen_dispatches_like_aiter(dtype, head_dim, v3):
    # Two requests of 3 and 2 keys on 128-token pages 3 and 1 of a 4-page cache. The CK path
    # raises with any block_table; fmha_v3 reads rows 0..4 of the cache seen as
    # [num_blocks, Hk, D] with row stride = page stride (pages 0..3, then past the end).
    generator = torch.Generator().manual_seed(0)
    pages = torch.randn(4, 128, 1, head_dim, generator=generator).to(dtype)
    q = torch.randn(2, 1, head_dim, generator=generator).to(dtype)
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    table = torch.tensor([[3], [1]], dtype=torch.int32)
    assert aiter_emulation.uses_fmha_v3(q, pages, 0.0, (-1, -1), 3, None, None, None,
                                        None) == v3
    cu_k = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(VendorContractError,
                       match="ignores block_table" if v3 else "UnboundLocalError"):
        aiter_emulation.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, 1, 3, causal=True,
                                               block_table=table)
    if not v3:
        return
    cu_k = torch.tensor([0, 2, 4], dtype=torch.int32)  # in range: silently the wrong rows
    out = aiter_emulation.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, 1, 3,
                                                 causal=True, block_table=table)
    for b, start in enumerate((0, 2)):
        keys = pages[start:start + 2, 0]  # pages 0, 1 / 2, 3 (token 0), not the table's
        want = aiter_emulation.attend(q[b:b + 1], keys, keys, head_dim ** -0.5, True)
        torch.testing.assert_close(out[b:b + 1].float(), want, atol=2e-2, rtol=0)


@pytest.mark.parametrize("layout", [NHD, SPLIT_K])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_aiter_fp8_write_rounds_like_aiter(layout, dtype):
    # Every finite value of the input dtype, written by the emulated aiter kernel and by the
    # reference with scale 0.3, where the two roundings really differ for one input.
    values = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    values = values[torch.isfinite(values)]
    head_dim = 128
    rows = -(-values.numel() // head_dim)
    key = torch.zeros(rows * head_dim, dtype=dtype)
    key[:values.numel()] = values
    key = key.view(rows, 1, head_dim)
    slots = torch.arange(rows, dtype=torch.int64)
    fp8 = torch.float8_e4m3fnuz
    written, reference = (random_cache(layout, -(-rows // 16), 16, 1, head_dim, fp8, "cpu",
                                       scale=0.3) for _ in range(2))
    scale = written.k_scale
    if layout == NHD:
        aiter_emulation.reshape_and_cache_flash(key, key, written.key, written.value, slots,
                                                "fp8", scale, scale)
    else:
        aiter_emulation.reshape_and_cache(key, key, written.key, written.value, slots, "fp8",
                                          k_scale=scale, v_scale=scale, asm_layout=True)
    write_kv_reference(key, key, reference, slots)
    got, want = (_key_codes(c)[:values.numel()] for c in (written, reference))
    finfo = torch.finfo(fp8)
    aiter_rounding = (values.float() * torch.reciprocal(scale)).clamp(finfo.min, finfo.max)
    assert torch.equal(got, aiter_rounding.to(fp8).view(torch.uint8))
    differ = got != want
    assert 1 <= int(differ.sum()) <= FP8_DIFF_FRACTION * values.numel()
    assert int(_fp8_ulp_distance(got[differ], want[differ]).max()) == 1


def _key_codes(cache) -> torch.Tensor:
    """The key cache's fp8 codes (uint8) in slot order, [num_slots * Hk * D]."""
    codes = cache.key.view(torch.uint8)
    if cache.layout == SPLIT_K:  # [nb, Hk, D // x, bs, x] -> [nb, bs, Hk, D]
        nb, hk, dx, bs, x = codes.shape
        codes = codes.permute(0, 3, 1, 2, 4).reshape(nb, bs, hk, dx * x)
    return codes.reshape(-1)


def test_choose_path_sends_only_single_token_batches_to_decode_kernels():
    assert _path(True) == aiter_fa.DECODE_V1
    assert _path(True, block_size=32, fp8=True) == aiter_fa.DECODE_V1
    assert _path(True, fp8=True, per_tensor=False) == aiter_fa.VARLEN_GATHERED
    assert _path(True, block_size=128, dtype=torch.float16) == aiter_fa.VARLEN_GATHERED
    assert _path(True, layout=SPLIT_K) == aiter_fa.DECODE_ASM
    assert _path(True, layout=SPLIT_K, scale=0.1) == aiter_fa.VARLEN_GATHERED
    assert _path(True, layout=SPLIT_K, head_dim=64) == aiter_fa.VARLEN_GATHERED
    for kwargs in ({}, {"block_size": 32}, {"layout": SPLIT_K}, {"fp8": True}):
        assert _path(False, **kwargs) == aiter_fa.VARLEN_GATHERED
    assert "multi-token" in _choice(False).reason


@pytest.mark.parametrize("dtype, head_dim, block_size, v3", [
    (torch.bfloat16, 128, 128, True),  # fmha_v3_varlen_fwd: block_table ignored
    (torch.bfloat16, 128, 256, True),
    (torch.float16, 128, 128, False),  # CK mha_varlen_fwd: raises with a block_table
    (torch.bfloat16, 64, 128, False),
    (torch.bfloat16, 256, 256, False),
])
def test_choose_path_never_hands_aiter_varlen_a_block_table(dtype, head_dim, block_size, v3):
    for single in (True, False):
        choice = _choice(single, block_size=block_size, head_dim=head_dim, dtype=dtype)
        assert choice.path == aiter_fa.VARLEN_GATHERED
        reason = aiter_fa.FMHA_V3_IGNORES_BLOCK_TABLE if v3 else aiter_fa.CK_PAGED_VARLEN_RAISES
        assert reason in choice.reason


@pytest.mark.parametrize("gqa, asm", [(1, True), (4, True), (8, True), (12, True), (16, True),
                                      (17, False), (24, False), (32, False)])
def test_choose_path_runs_pa_fwd_asm_only_for_gqa_ratios_in_pa_asm_csv(gqa, asm):
    choice = _choice(True, layout=SPLIT_K, gqa=gqa)
    assert choice.path == (aiter_fa.DECODE_ASM if asm else aiter_fa.VARLEN_GATHERED)
    if not asm:
        assert f"GQA ratio {gqa}" in choice.reason and "pa_asm.csv" in choice.reason
    assert aiter_fa.pa_asm_kernel_exists(torch.bfloat16, gqa, 16) == asm
    assert not aiter_fa.pa_asm_kernel_exists(torch.bfloat16, gqa, 32)
    # The emulated lookup follows the csv itself (same round-up rule), independently.
    if asm:
        aiter_emulation.pa_asm_kernel(torch.bfloat16, torch.bfloat16, gqa, 16)
    else:
        with pytest.raises(VendorContractError, match="cannot get heuristic kernel!"):
            aiter_emulation.pa_asm_kernel(torch.bfloat16, torch.bfloat16, gqa, 16)


@pytest.mark.parametrize("kwargs, reason", [
    ({"head_dim": 96}, "head_dim 96"), ({"head_dim": 192, "fp8": True}, "head_dim 192"),
    ({"gqa": 17}, "GQA ratio 17"), ({"block_size": 64}, "block_size 64"),
])
def test_choose_path_keeps_decode_v1_to_the_shapes_its_kernel_compiles(kwargs, reason):
    choice = _choice(True, **kwargs)
    assert choice.path == aiter_fa.VARLEN_GATHERED and reason in choice.reason
    assert _path(True, gqa=24) == _path(True, gqa=32) == aiter_fa.DECODE_V1  # 2 loops of 12/16


def test_emulated_paged_attention_v1_refuses_shapes_its_kernel_miscomputes():
    emulation = aiter_emulation
    emulation.check_v1_shape(128, 16, 24, 2)
    for args, message in (((96, 16, 4, 2), "head_size 96"), ((192, 16, 4, 1), "head_size 192"),
                          ((128, 64, 4, 2), "block size"), ((128, 16, 17, 2), "GQA ratio 17")):
        with pytest.raises(VendorContractError, match=message):
            emulation.check_v1_shape(*args)


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
    assert caps.config_problem(16, 128, torch.bfloat16, torch.float8_e4m3fn) is None  # gfx950
    # Per arch, only aiter's own fp8 type (aiter/utility/dtypes.py) is declared.
    assert caps.kv_cache_dtypes_for("rocm", "gfx942") == (torch.float8_e4m3fnuz,)
    assert caps.kv_cache_dtypes_for("rocm", "gfx950") == (torch.float8_e4m3fn,)
    assert caps.kv_cache_dtypes_for("rocm", "gfx90a") == ()
    assert "dtype" in caps.config_problem(16, 128, torch.float32)
    assert "block_size" in caps.config_problem(8, 128, torch.bfloat16)
    # CK varlen runs head dims up to 256 (multiples of 8); decode kernels take subsets.
    for head_dim in (8, 80, 96, 112, 192, 256):
        assert caps.config_problem(16, head_dim, torch.bfloat16) is None
    for head_dim in (12, 264, 512):
        assert "head_dim" in caps.config_problem(16, head_dim, torch.bfloat16)


@pytest.mark.parametrize("arch, good, bad", [
    ("gfx942", torch.float8_e4m3fnuz, torch.float8_e4m3fn),
    ("gfx950", torch.float8_e4m3fn, torch.float8_e4m3fnuz),
])
def test_fp8_cache_dtype_follows_aiter_per_arch(monkeypatch, arch, good, bad):
    from rocdraft.platform import Platform

    monkeypatch.setattr(aiter_fa, "detect_platform", lambda: Platform("rocm", arch, "cuda"))
    assert aiter_fa.fp8_cache_dtype(arch) == good
    impl = aiter_fa.AiterFAImpl(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    common = make_step([1], [3], 16, 2, "cpu")
    cache = random_cache(NHD, 2, 16, NUM_KV_HEADS, HEAD_DIM, bad, "cpu")
    q, k, v = random_qkv(1, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, "cpu")
    with pytest.raises(RocdraftError, match=str(good).split(".")[-1]):
        impl.forward(q, k, v, cache, aiter_fa.AiterFABuilder("cpu").build(common))


def test_fp32_query_is_a_user_error_naming_the_dtype():
    impl = aiter_fa.AiterFAImpl(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    common = make_step([1], [3], 16, 2, "cpu")
    cache = random_cache(NHD, 2, 16, NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    q, k, v = random_qkv(1, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    with pytest.raises(RocdraftError, match="float32"):
        impl.forward(q, k, v, cache, aiter_fa.AiterFABuilder("cpu").build(common))


def test_head_dim_above_ck_limit_is_a_user_error():
    impl = aiter_fa.AiterFAImpl(NUM_HEADS, NUM_KV_HEADS, 264, 264 ** -0.5)
    common = make_step([2], [3], 16, 2, "cpu")
    cache = random_cache(NHD, 2, 16, NUM_KV_HEADS, 264, torch.bfloat16, "cpu")
    q, k, v = random_qkv(2, NUM_HEADS, NUM_KV_HEADS, 264, torch.bfloat16, "cpu")
    with pytest.raises(RocdraftError, match="head_dim 264"):
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
