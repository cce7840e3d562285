"""The compile check's list (scripts/check_kernels_compile.py over catalog.compile_plan):
every (target, dtype, KV-cache dtype) pair TRITON_ATTN declares is compiled for that target,
for the KV write, the attention kernel and the fused RoPE + KV write, and no undeclared pair
is (the fused norm and SiLU-mul: every dtype on every target), so an fp8 format
declared for an arch Triton cannot build for (e4m3fnuz on sm_90) fails in CI."""
from __future__ import annotations

import torch

from rocdraft.backends.triton_attn import TritonAttnBackend
from rocdraft.backends.triton_kernels import catalog

KERNELS = ("kv_write_kernel", "unified_attention_kernel", "rope_kv_write_kernel")


def _compiled_pairs(kernel_name: str) -> set[tuple[str, torch.dtype, torch.dtype]]:
    return {(target.name, *spec.dtype_pair) for spec, target in catalog.compile_plan()
            if spec.dtype_pair is not None and spec.kernel_name == kernel_name}


def _source_type(signature: dict[str, str]) -> str:
    """The pointer type of a KV-writing kernel's input: query, key, or fused qkv."""
    return next(signature[n] for n in ("query_ptr", "key_ptr", "qkv_ptr") if n in signature)


def test_dense_fused_kernels_compile_for_every_dtype_and_target():
    """Residual add + RMSNorm and SiLU-mul: every model dtype TRITON_ATTN declares, every
    target (they touch no cache, so there is no cache dtype to pair)."""
    dtypes = TritonAttnBackend.capabilities.dtypes
    for kernel in ("add_rms_norm_kernel", "silu_mul_kernel"):
        built = {(target.name, spec.signature_dict()["out_ptr"])
                 for spec, target in catalog.compile_plan() if spec.kernel_name == kernel}
        assert built == {(t, f"*{catalog.TRITON_TYPES[d]}") for t in catalog.ALL_TARGETS
                         for d in dtypes}, kernel


def _declared_pairs() -> set[tuple[str, torch.dtype, torch.dtype]]:
    caps = TritonAttnBackend.capabilities
    declared = set()
    for target in catalog.TARGETS:
        fp8 = caps.kv_cache_dtypes_for(target.platform_kind, target.name)
        for dtype in caps.dtypes:
            declared |= {(target.name, dtype, cache) for cache in (dtype, *fp8)}
    return declared


def test_targets_include_every_documented_arch():
    assert catalog.ALL_TARGETS == ("gfx942", "gfx90a", "gfx950", "sm_90")
    assert {t.name: t.platform_kind for t in catalog.TARGETS} == {
        "gfx942": "rocm", "gfx90a": "rocm", "gfx950": "rocm", "sm_90": "cuda"}


def test_compile_list_is_exactly_the_declared_pairs():
    declared = _declared_pairs()
    assert (("gfx942", torch.bfloat16, torch.float8_e4m3fnuz) in declared
            and ("sm_90", torch.bfloat16, torch.float8_e4m3fn) in declared)
    for kernel in KERNELS:
        assert _compiled_pairs(kernel) == declared, kernel


def test_no_entry_compiles_an_undeclared_pair():
    """Shape variants included: the (source, cache) pointer types of every compile are a pair
    declared for its target."""
    by_name = {name: dtype for dtype, name in catalog.TRITON_TYPES.items()}
    declared = _declared_pairs()
    for spec, target in catalog.compile_plan():
        sig = dict(spec.signature)
        if "key_cache_ptr" not in sig:
            continue
        source = _source_type(sig)[1:]
        cache = sig["key_cache_ptr"][1:]
        assert (target.name, by_name[source], by_name[cache]) in declared, \
            (spec.name, target.name)


def test_fnuz_is_neither_declared_nor_compiled_for_sm_90():
    caps = TritonAttnBackend.capabilities
    assert torch.float8_e4m3fnuz not in caps.kv_cache_dtypes_for("cuda", "sm_90")
    for spec, target in catalog.compile_plan():
        if target.name == "sm_90":
            types = dict(spec.signature).values()
            assert "*fp8e4b8" not in types, spec.name


def test_every_entry_types_its_pointers_with_the_pair():
    for spec in catalog.kernel_catalog():
        if spec.dtype_pair is None:
            continue
        dtype, cache = (catalog.TRITON_TYPES[d] for d in spec.dtype_pair)
        sig = dict(spec.signature)
        assert sig["key_cache_ptr"] == sig["value_cache_ptr"] == f"*{cache}", spec.name
        assert _source_type(sig) == f"*{dtype}", spec.name


def test_compile_plan_respects_a_target_filter():
    gfx942 = tuple(t for t in catalog.TARGETS if t.name == "gfx942")
    plan = catalog.compile_plan(targets=gfx942)
    assert plan and {t.name for _, t in plan} == {"gfx942"}
    assert len(plan) == sum("gfx942" in s.targets for s in catalog.kernel_catalog())


def test_fused_entries_compile_with_the_wrappers_launch_options():
    """The RoPE + KV write launches without FP fusion and the norm with 8 warps at hidden 4096:
    the compile check builds what runs."""
    from rocdraft.backends.triton_kernels import fused_norm

    for spec in catalog.kernel_catalog():
        if spec.kernel_name == "rope_kv_write_kernel":
            assert dict(spec.options) == {"enable_fp_fusion": False}, spec.name
        elif spec.kernel_name == "add_rms_norm_kernel":
            assert dict(spec.options) == {"num_warps": fused_norm.num_warps_for(4096)}
        else:
            assert spec.options == (), spec.name
