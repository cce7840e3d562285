"""TRITON_ATTN backend: registration, declared capabilities, availability, builders, forward
(KV write + attention) against TORCH_SDPA; the kernel catalog's completeness and a real
ahead-of-time compile of one kernel for gfx942."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rocdraft.backends import registry
from rocdraft.backends.base import Feature, GraphCapture
from rocdraft.backends.kv_cache import (FP8_DTYPES, NHD, SPLIT_K, LayerKVCache,
                                        allocate_kv_cache, compute_slot_mapping,
                                        write_kv_reference)
from rocdraft.backends.metadata import CommonAttentionMetadata, token_layout
from rocdraft.backends.torch_sdpa import TorchSDPABuilder, TorchSDPAImpl
from rocdraft.backends.triton_attn import (CPU_REASON, FP8_FORMATS, TritonAttnBackend,
                                           TritonAttnImpl, TritonAttnMetadata)
from rocdraft.backends.triton_kernels import catalog

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO = Path(__file__).resolve().parents[1]


# --- registration and capabilities ----------------------------------------------------------

def test_registered_with_its_own_metadata_type():
    assert registry.get_backend("TRITON_ATTN") is TritonAttnBackend
    assert registry.backend_for_metadata(TritonAttnMetadata) is TritonAttnBackend


def test_declared_capabilities():
    caps = TritonAttnBackend.capabilities
    assert caps.multi_token_drafting and caps.tree_drafting
    assert caps.graph_capture is GraphCapture.FULL
    assert caps.kv_layouts == (NHD,) and caps.block_size_multiple == 1
    assert caps.head_sizes is None
    assert (caps.head_size_multiple, caps.max_head_size) == (16, 256)
    assert caps.dtypes == (torch.float32, torch.float16, torch.bfloat16)
    assert caps.kv_cache_dtypes == () and caps.kv_cache_formats == FP8_FORMATS
    assert caps.platforms == ("rocm", "cuda", "cpu")
    for feature in Feature:
        assert registry.supports("TRITON_ATTN", feature)
    assert caps.config_problem(block_size=5, head_dim=80, dtype=torch.bfloat16,
                               kv_cache_dtype=FP8_DTYPES[1]) is None
    assert "head_dim 24" in caps.config_problem(block_size=16, head_dim=24, dtype=torch.float16)


def test_fnuz_is_not_declared_for_nvidia():
    """Triton's NVIDIA backend has no fp8e4b8: an e4m3fnuz cache must be refused on sm_90."""
    caps = TritonAttnBackend.capabilities
    fnuz = torch.float8_e4m3fnuz
    assert fnuz not in caps.kv_cache_dtypes_for("cuda", "sm_90")
    assert "not supported on cuda sm_90" in caps.config_problem(
        dtype=torch.bfloat16, kv_cache_dtype=fnuz, platform_kind="cuda", arch="sm_90")
    assert caps.config_problem(dtype=torch.bfloat16, kv_cache_dtype=fnuz,
                               platform_kind="rocm", arch="gfx942") is None


@pytest.mark.parametrize("head_dim", [16, 48, 80, 112, 256])
def test_head_sizes_by_rule_are_accepted(head_dim):
    req = registry.ModelRequirements(block_size=16, head_dim=head_dim, dtype=torch.float16)
    assert TritonAttnBackend.capabilities.config_problem(16, head_dim, torch.float16) is None
    if TritonAttnBackend.availability() is None:
        assert registry.select_backend(
            "cpu" if DEVICE == "cpu" else "cuda", "TRITON_ATTN", req).backend \
            is TritonAttnBackend


@pytest.mark.parametrize("head_dim", [8, 24, 264, 272])
def test_head_sizes_off_the_rule_are_refused_naming_it(head_dim):
    problem = TritonAttnBackend.capabilities.config_problem(head_dim=head_dim)
    assert problem == f"head_dim {head_dim} is not a multiple of 16 up to 256"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU availability rule")
def test_cpu_availability_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonAttnBackend.availability() is None
    assert registry.select_backend("cpu", explicit="TRITON_ATTN").backend is TritonAttnBackend
    monkeypatch.delenv("TRITON_INTERPRET")
    assert TritonAttnBackend.availability() == CPU_REASON


def test_builders_wrap_the_common_metadata():
    block_table = torch.zeros(2, 1, dtype=torch.int32)
    common = CommonAttentionMetadata.from_cpu([0, 1, 3], [4, 2], block_table,
                                              torch.tensor([3, 0, 1]), DEVICE)
    builder = TritonAttnBackend.builder_cls(DEVICE)
    for meta in (builder.build(common), builder.build_for_drafting(common, 2),
                 builder.build_for_graph_capture(common)):
        assert isinstance(meta, TritonAttnMetadata) and meta.common is common


# --- forward against TORCH_SDPA -------------------------------------------------------------

def _step(query_lens, context_lens, dtype, cache_dtype, block_size=8, num_heads=4,
          num_kv_heads=2, head_dim=32, num_padding_tokens=1, seed=0):
    """Random cache + one step's new tokens with their real slot mapping."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 1
    block_table = torch.randperm(num_blocks, generator=g)[:len(seq_lens) * max_blocks]
    block_table = block_table.view(len(seq_lens), max_blocks).int()
    cache = allocate_kv_cache(1, num_blocks, block_size, num_kv_heads, head_dim, cache_dtype,
                              DEVICE, kv_scale=0.04)[0]
    old = torch.randn(2, num_blocks * block_size, num_kv_heads, head_dim, generator=g)
    write_kv_reference(old[0].to(DEVICE), old[1].to(DEVICE), cache,
                       torch.arange(num_blocks * block_size, device=DEVICE))
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    num_tokens = qsl[-1] + num_padding_tokens
    req, _, pos = token_layout(torch.tensor(qsl), torch.tensor(seq_lens), num_tokens)
    pos = pos.masked_fill(req >= len(seq_lens), -1)  # padding tokens write nothing
    slots = compute_slot_mapping(block_table, req.clamp(max=len(seq_lens) - 1), pos, block_size)
    common = CommonAttentionMetadata.from_cpu(qsl, seq_lens, block_table, slots, DEVICE)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g)
    qkv = qkv.to(dtype).to(DEVICE)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)  # strided views
    return q, k, v, cache, common


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float16, torch.float16),
                                               (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.float32),
                                               (torch.bfloat16, FP8_DTYPES[1])])
def test_forward_matches_torch_sdpa(dtype, cache_dtype):
    q, k, v, cache, common = _step([1, 6, 3], [9, 0, 4], dtype, cache_dtype)
    ref_cache = LayerKVCache(cache.key.clone(), cache.value.clone(), NHD, cache.k_scale,
                             cache.v_scale)
    args = (4, 2, 32, 32 ** -0.5)
    ref = TorchSDPAImpl(*args).forward(q, k, v, ref_cache, TorchSDPABuilder().build(common))
    out = TritonAttnImpl(*args).forward(q, k, v, cache,
                                        TritonAttnBackend.builder_cls(DEVICE).build(common))
    assert torch.equal(cache.key.view(torch.uint8), ref_cache.key.view(torch.uint8))
    assert torch.equal(cache.value.view(torch.uint8), ref_cache.value.view(torch.uint8))
    tol = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    real = common.num_actual_tokens
    torch.testing.assert_close(out[:real].float(), ref[:real].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32),
                                               (torch.bfloat16, FP8_DTYPES[0])])
def test_forward_with_per_request_tree_masks_matches_torch_sdpa(dtype, cache_dtype):
    """Per-request [num_reqs, S, S] masks through the backend: q < S (a tree level), q == S,
    q > S; each request sees its own tree (mask row S - q + j for query token j)."""
    q, k, v, cache, common = _step([2, 4, 6], [6, 3, 1], dtype, cache_dtype, seed=3)
    masks = torch.tril(torch.ones(3, 4, 4, dtype=torch.bool))
    masks[0, 3, 2] = masks[1, 2, 1] = masks[2, 3, 1] = False  # three different masks
    common = common.with_updates(spec_mask=masks.to(DEVICE))
    ref_cache = LayerKVCache(cache.key.clone(), cache.value.clone(), NHD, cache.k_scale,
                             cache.v_scale)
    args = (4, 2, 32, 32 ** -0.5)
    ref = TorchSDPAImpl(*args).forward(q, k, v, ref_cache, TorchSDPABuilder().build(common))
    out = TritonAttnImpl(*args).forward(q, k, v, cache, TritonAttnMetadata(common))
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype]
    real = common.num_actual_tokens
    torch.testing.assert_close(out[:real].float(), ref[:real].float(), atol=tol, rtol=tol)
    plain = TorchSDPAImpl(*args).forward(q, k, v, ref_cache, TorchSDPABuilder().build(
        common.with_updates(spec_mask=None)))
    assert not torch.allclose(out[:real].float(), plain[:real].float(), atol=tol)


@pytest.mark.parametrize("head_dim", [48, 112])
def test_head_size_off_the_old_list_matches_torch_sdpa(head_dim):
    """48 and 112 pad to 64 and 128 inside both kernels (masked): same cache bytes, same
    attention as TORCH_SDPA."""
    q, k, v, cache, common = _step([1, 3], [5, 2], torch.float32, torch.float32,
                                   head_dim=head_dim, seed=head_dim)
    ref_cache = LayerKVCache(cache.key.clone(), cache.value.clone(), NHD, cache.k_scale,
                             cache.v_scale)
    args = (4, 2, head_dim, head_dim ** -0.5)
    ref = TorchSDPAImpl(*args).forward(q, k, v, ref_cache, TorchSDPABuilder().build(common))
    out = TritonAttnImpl(*args).forward(q, k, v, cache, TritonAttnMetadata(common))
    assert torch.equal(cache.key, ref_cache.key) and torch.equal(cache.value, ref_cache.value)
    real = common.num_actual_tokens
    torch.testing.assert_close(out[:real], ref[:real], atol=1e-4, rtol=1e-4)


def test_forward_rejects_split_k_cache():
    q, k, v, cache, common = _step([1], [3], torch.float16, torch.float16)
    cache.layout = SPLIT_K
    with pytest.raises(ValueError, match="NHD"):
        TritonAttnImpl(4, 2, 32, 1.0).forward(q, k, v, cache, TritonAttnMetadata(common))


# --- kernel catalog and compile check -------------------------------------------------------

def test_every_jit_function_is_catalogued():
    assert catalog.uncatalogued_kernels() == []
    sources = catalog.jit_functions_in_sources()
    entries = catalog.kernel_catalog()
    assert len({s.name for s in entries}) == len(entries)
    for spec in entries:
        assert spec.kernel_name in sources
        assert set(spec.helpers) <= set(sources), spec.name


def test_a_new_kernel_file_is_reported(tmp_path):
    (tmp_path / "new_kernel.py").write_text(
        "import triton\n\n@triton.jit\ndef forgotten_kernel(x_ptr):\n    pass\n")
    assert catalog.uncatalogued_kernels(directory=tmp_path) == ["new_kernel.py:forgotten_kernel"]


def test_compile_one_kernel_for_gfx942_without_a_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile, not a cache hit
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_kernels_compile.py"),
         "--kernel", "advance_draft_step", "--target", "gfx942"],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK    advance_draft_step" in result.stdout and "hip:gfx942  hsaco" in result.stdout
