"""Hardware checks of the vendor attention backends against TORCH_SDPA, on the device.

Marked ``gpu``. Each case skips, saying why, unless a GPU is visible and the backend can run
here (its ``availability()`` is None): ROCM_AITER_FA needs an AMD GPU with a ROCm torch and
amd-aiter; FLASH_ATTN needs a GPU and flash-attn. On an NVIDIA machine only FLASH_ATTN (and
TRITON_ATTN, checked in its own tests) can be checked here; ROCM_AITER_FA is skipped there.

Unlike tests/test_aiter_fa.py and tests/test_flash_attn.py (contract tests against emulated
vendor APIs on the CPU), nothing here is emulated: the real kernels run on the real device.
Attention-level equality only; end-to-end lossless generation will be added here too.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from rocdraft.backends import aiter_fa, registry
from rocdraft.backends.kv_cache import NHD, SPLIT_K, read_kv_nhd
from rocdraft.platform import detect_platform
from vendor_emulation import make_step, random_cache, random_qkv, run_against_torch_sdpa

pytestmark = pytest.mark.gpu

BATCHES = {  # name: (query_lens, seq_lens)
    "mixed": ([1, 37, 3, 1, 260], [90, 37, 600, 41, 300]),  # decode, prefill, verify, chunk
    "decode": ([1] * 6, [7, 300, 17, 1024, 5, 129]),
    "verify": ([4] * 5, [10, 4, 700, 33, 260]),  # 1 + 3 draft tokens each
}
NUM_HEADS, NUM_KV_HEADS = 8, 2
# (backend, batch, block_size, head_dim, dtype, layout, cache dtype or None, kernel expected)
CASES = [
    *[("ROCM_AITER_FA", b, bs, 128, dt, NHD, None, None)
      for b in BATCHES for bs in (16, 128) for dt in (torch.bfloat16, torch.float16)],
    ("ROCM_AITER_FA", "decode", 16, 128, torch.bfloat16, NHD, torch.float8_e4m3fnuz,
     "paged_attention_v1"),
    ("ROCM_AITER_FA", "mixed", 16, 128, torch.bfloat16, NHD, torch.float8_e4m3fnuz,
     "flash_attn_varlen_func"),
    ("ROCM_AITER_FA", "decode", 16, 128, torch.bfloat16, SPLIT_K, None, "pa_fwd_asm"),
    ("ROCM_AITER_FA", "decode", 16, 128, torch.float16, SPLIT_K, None, "pa_fwd_asm"),
    ("ROCM_AITER_FA", "verify", 16, 128, torch.bfloat16, SPLIT_K, None, "flash_attn_varlen_func"),
    *[("FLASH_ATTN", b, 256, hd, dt, NHD, None, None)
      for b in BATCHES for hd in (64, 128) for dt in (torch.bfloat16, torch.float16)],
]
# aiter's fp8 write stores x * (1 / scale), the reference x / scale: with a non-power-of-two
# scale they may differ by one fp8 ulp on a few entries (see tests/test_aiter_fa.py).
FP8_SCALE, FP8_DIFF_FRACTION = 0.37, 1e-3
VENDOR_MODULES = {"ROCM_AITER_FA": "aiter", "FLASH_ATTN": "flash_attn"}
DEVICE = "cuda"
ASM_ARCHS = ("gfx942", "gfx950")  # where aiter ships its prebuilt asm kernels


def _case_id(case) -> str:
    name, batch, block_size, head_dim, dtype, layout, cache_dtype, _ = case
    kv = str(cache_dtype).split(".")[-1] if cache_dtype else "kv=dtype"
    return f"{name}-{batch}-bs{block_size}-d{head_dim}-{str(dtype).split('.')[-1]}-{layout}-{kv}"


def _recorder(fn, name: str, calls: list[str]):
    """Records ``name`` per call, and ``name(block_table)`` when a block_table was passed."""
    def wrapper(*args, **kwargs):
        calls.append(name)
        if kwargs.get("block_table") is not None:
            calls.append(f"{name}(block_table)")
        return fn(*args, **kwargs)
    return wrapper


def _skip_unless_runnable(name: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no GPU visible (torch.cuda.is_available() is False)")
    reason = registry.get_backend(name).availability()
    if reason:
        pytest.skip(f"{name} cannot run here: {reason}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gpu_backend_matches_torch_sdpa(case, monkeypatch):
    name, batch, block_size, head_dim, dtype, layout, cache_dtype, kernel = case
    _skip_unless_runnable(name)
    if layout == SPLIT_K and detect_platform().arch not in ASM_ARCHS:
        pytest.skip(f"pa_fwd_asm ships for {ASM_ARCHS} only, not {detect_platform().arch}")
    calls: list[str] = []
    module = importlib.import_module(VENDOR_MODULES[name])
    for api in ("flash_attn_varlen_func", "flash_attn_with_kvcache", "paged_attention_v1",
                "pa_fwd_asm"):
        if hasattr(module, api):
            monkeypatch.setattr(module, api, _recorder(getattr(module, api), api, calls))

    query_lens, seq_lens = BATCHES[batch]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 4
    common = make_step(query_lens, seq_lens, block_size, num_blocks, DEVICE, num_padding_tokens=3)
    cache = random_cache(layout, num_blocks, block_size, NUM_KV_HEADS, head_dim,
                         cache_dtype or dtype, DEVICE, scale=FP8_SCALE if cache_dtype else 1.0)
    q, k, v = random_qkv(common.slot_mapping.shape[0], NUM_HEADS, NUM_KV_HEADS, head_dim, dtype,
                         DEVICE)
    out, ref, cache_out, cache_ref = run_against_torch_sdpa(name, common, cache, q, k, v,
                                                            NUM_HEADS, NUM_KV_HEADS, head_dim)
    torch.cuda.synchronize()
    atol = 3e-2 if (cache_dtype or dtype == torch.bfloat16) else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)
    if cache_dtype:
        _assert_fp8_within_one_ulp(cache_out, cache_ref)
    else:
        for got, want in zip(read_kv_nhd(cache_out), read_kv_nhd(cache_ref)):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    if kernel:
        assert kernel in calls, f"expected {kernel}, vendor calls were {calls}"
    if batch != "decode" and name == "ROCM_AITER_FA":
        # Multi-token queries must never reach a one-query-per-sequence decode kernel.
        assert "paged_attention_v1" not in calls and "pa_fwd_asm" not in calls
    if name == "ROCM_AITER_FA":
        # aiter 0.1.7's varlen ignores (fmha_v3) or cannot take (CK) a block_table.
        assert "flash_attn_varlen_func(block_table)" not in calls


def _assert_fp8_within_one_ulp(cache_out, cache_ref) -> None:
    for got, want in ((cache_out.key, cache_ref.key), (cache_out.value, cache_ref.value)):
        g, w = got.view(torch.uint8).int(), want.view(torch.uint8).int()
        distance = torch.where((g >> 7) == (w >> 7), ((g & 0x7F) - (w & 0x7F)).abs(), 1 << 8)
        assert int(distance.max()) <= 1
        assert float((distance > 0).float().mean()) <= FP8_DIFF_FRACTION


@pytest.mark.parametrize("num_heads, asm", [(16, True), (32, True), (48, False)])
def test_gpu_aiter_split_k_decode_gqa_ratio(num_heads, asm, monkeypatch):
    # pa_asm.csv ships bf16 kernels for GQA 8 and 16: ratio 24 must fall back, not raise
    # "cannot get heuristic kernel!".
    _skip_unless_runnable("ROCM_AITER_FA")
    if detect_platform().arch not in ASM_ARCHS:
        pytest.skip(f"pa_fwd_asm ships for {ASM_ARCHS} only, not {detect_platform().arch}")
    calls: list[str] = []
    module = importlib.import_module("aiter")
    for api in ("flash_attn_varlen_func", "pa_fwd_asm"):
        monkeypatch.setattr(module, api, _recorder(getattr(module, api), api, calls))
    query_lens, seq_lens = BATCHES["decode"]
    num_blocks = sum(-(-s // 16) for s in seq_lens) + 4
    common = make_step(query_lens, seq_lens, 16, num_blocks, DEVICE)
    cache = random_cache(SPLIT_K, num_blocks, 16, NUM_KV_HEADS, 128, torch.bfloat16, DEVICE)
    q, k, v = random_qkv(common.slot_mapping.shape[0], num_heads, NUM_KV_HEADS, 128,
                         torch.bfloat16, DEVICE)
    out, ref, _, _ = run_against_torch_sdpa("ROCM_AITER_FA", common, cache, q, k, v, num_heads,
                                            NUM_KV_HEADS, 128)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=0)
    assert ("pa_fwd_asm" in calls) == asm, calls


def test_gpu_aiter_split_k_env_picks_asm_layout(monkeypatch):
    _skip_unless_runnable("ROCM_AITER_FA")
    monkeypatch.setenv("ROCDRAFT_AITER_ASM_LAYOUT", "1")
    assert aiter_fa.AiterFABackend.kv_cache_layout() == SPLIT_K
