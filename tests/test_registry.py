"""The backend registry: selection per platform, explicit choice, capability queries,
metadata ownership, configuration checks. Fake backends are registered only for the
duration of a test (``monkeypatch`` restores the real registry afterwards)."""
from __future__ import annotations

import re

import pytest
import torch

from rocdraft import envs
from rocdraft.backends import registry
from rocdraft.backends.base import (AttentionBackend, BackendCapabilities, Feature,
                                    GraphCapture, MetadataBuilder, target_matches)
from rocdraft.backends.registry import ModelRequirements
from rocdraft.backends.torch_sdpa import TorchSDPABackend, TorchSDPAMetadata
from rocdraft.errors import BackendUnavailableError, RocdraftError, UnsupportedFeatureError

ALL_PLATFORMS = ("cpu", "cuda", "rocm")


def make_caps(**overrides) -> BackendCapabilities:
    fields = dict(multi_token_drafting=True, tree_drafting=False,
                  graph_capture=GraphCapture.UNIFORM_DECODE, kv_layouts=("NHD",),
                  block_size_multiple=1, dtypes=(torch.float16, torch.bfloat16),
                  head_sizes=None, platforms=ALL_PLATFORMS, kv_cache_dtypes=())
    fields.update(overrides)
    return BackendCapabilities(**fields)


def make_backend(name: str, unavailable: str | None = None, **caps) -> type[AttentionBackend]:
    """A fake backend class with its own metadata type; ``unavailable`` is its
    availability() reason (None: available)."""
    metadata_cls = type(f"{name.title()}Metadata", (), {})

    @classmethod
    def availability(cls):
        return unavailable

    return type(f"Fake_{name}", (AttentionBackend,), dict(
        name=name, metadata_cls=metadata_cls, builder_cls=MetadataBuilder,
        capabilities=make_caps(**caps), availability=availability))


@pytest.fixture
def fake_registry(monkeypatch):
    """An empty registry for this test; returns ``add(cls)`` registering into it."""
    monkeypatch.setattr(registry, "_BACKENDS", {})

    def add(*classes):
        for cls in classes:
            registry.register_backend(cls)
        return classes[0] if len(classes) == 1 else classes

    return add


def full_set(add, **unavailable):
    """Register the backends of the priority lists; ``unavailable`` maps name -> reason."""
    add(make_backend("CPU_ATTN", unavailable.get("CPU_ATTN"), platforms=("cpu",),
                     tree_drafting=True, dtypes=(torch.float32, torch.float16, torch.bfloat16)),
        make_backend("ROCM_AITER_FA", unavailable.get("ROCM_AITER_FA"), platforms=("rocm",),
                     block_size_multiple=16),
        make_backend("FLASH_ATTN", unavailable.get("FLASH_ATTN"), platforms=("cuda", "rocm")),
        make_backend("TRITON_ATTN", unavailable.get("TRITON_ATTN"), tree_drafting=True),
        make_backend("TORCH_SDPA", unavailable.get("TORCH_SDPA"), tree_drafting=True,
                     dtypes=(torch.float32, torch.float16, torch.bfloat16)))


# --- selection order per platform -----------------------------------------------------------

def test_priority_lists_are_the_documented_ones():
    assert registry.PRIORITY["rocm"] == ("ROCM_AITER_FA", "TRITON_ATTN", "TORCH_SDPA")
    assert registry.PRIORITY["cuda"] == ("FLASH_ATTN", "TRITON_ATTN", "TORCH_SDPA")
    assert registry.PRIORITY["cpu"] == ("CPU_ATTN", "TORCH_SDPA", "TRITON_ATTN")


@pytest.mark.parametrize("platform, expected", [
    ("rocm", "ROCM_AITER_FA"), ("cuda", "FLASH_ATTN"), ("cpu", "CPU_ATTN")])
def test_first_of_priority_list_wins_when_all_available(fake_registry, platform, expected):
    full_set(fake_registry)
    sel = registry.select_backend(platform)
    assert sel.backend.name == expected
    assert sel.refused == {}
    assert platform in sel.reason


def test_rocm_falls_back_in_order_keeping_reasons(fake_registry):
    full_set(fake_registry, ROCM_AITER_FA="aiter is not installed")
    sel = registry.select_backend("rocm")
    assert sel.backend.name == "TRITON_ATTN"
    assert sel.refused == {"ROCM_AITER_FA": "aiter is not installed"}


def test_rocm_falls_back_to_the_last_candidate(fake_registry):
    full_set(fake_registry, ROCM_AITER_FA="aiter is not installed",
             TRITON_ATTN="triton is too old")
    sel = registry.select_backend("rocm")
    assert sel.backend.name == "TORCH_SDPA"
    assert list(sel.refused) == ["ROCM_AITER_FA", "TRITON_ATTN"]
    assert sel.refused["TRITON_ATTN"] == "triton is too old"


def test_cuda_never_picks_a_backend_outside_its_list(fake_registry):
    full_set(fake_registry, FLASH_ATTN="flash_attn is not installed")
    sel = registry.select_backend("cuda")
    assert sel.backend.name == "TRITON_ATTN"  # not ROCM_AITER_FA, although it is registered
    assert sel.refused == {"FLASH_ATTN": "flash_attn is not installed"}


def test_cpu_order_prefers_cpu_attn_then_torch_sdpa_then_triton(fake_registry):
    full_set(fake_registry, CPU_ATTN="broken on purpose")
    assert registry.select_backend("cpu").backend.name == "TORCH_SDPA"
    full_set(fake_registry, CPU_ATTN="broken on purpose", TORCH_SDPA="also broken")
    sel = registry.select_backend("cpu")
    assert sel.backend.name == "TRITON_ATTN"
    assert sel.refused == {"CPU_ATTN": "broken on purpose", "TORCH_SDPA": "also broken"}


def test_platform_mismatch_is_a_refusal_reason(fake_registry):
    # A backend declaring only rocm is refused on cuda even though it is "available".
    fake_registry(make_backend("ROCM_AITER_FA", platforms=("rocm",)))
    reason = registry.refusal_reason(registry.get_backend("ROCM_AITER_FA"), "cuda")
    assert reason is not None and "cuda" in reason and "rocm" in reason


def test_unregistered_candidates_are_reported(fake_registry):
    fake_registry(make_backend("TORCH_SDPA"))
    sel = registry.select_backend("rocm")
    assert sel.backend.name == "TORCH_SDPA"
    assert sel.refused == {"ROCM_AITER_FA": "not registered", "TRITON_ATTN": "not registered"}


def test_nothing_usable_raises_with_every_reason(fake_registry):
    full_set(fake_registry, ROCM_AITER_FA="no aiter", TRITON_ATTN="no triton",
             TORCH_SDPA="no torch sdpa")
    with pytest.raises(BackendUnavailableError) as exc:
        registry.select_backend("rocm")
    msg = str(exc.value)
    for name, reason in [("ROCM_AITER_FA", "no aiter"), ("TRITON_ATTN", "no triton"),
                         ("TORCH_SDPA", "no torch sdpa")]:
        assert f"{name}: {reason}" in msg


def test_unknown_platform_is_rejected(fake_registry):
    full_set(fake_registry)
    with pytest.raises(RocdraftError, match="tpu"):
        registry.select_backend("tpu")


def test_requirements_refuse_and_fall_through(fake_registry):
    full_set(fake_registry)
    # ROCM_AITER_FA needs block sizes that are multiples of 16.
    sel = registry.select_backend("rocm", req=ModelRequirements(block_size=8))
    assert sel.backend.name == "TRITON_ATTN"
    assert "block_size 8" in sel.refused["ROCM_AITER_FA"]
    # Only TRITON_ATTN and TORCH_SDPA can draft trees.
    sel = registry.select_backend("rocm", req=ModelRequirements(features=(Feature.TREE_DRAFTING,)))
    assert sel.backend.name == "TRITON_ATTN"
    assert "tree_drafting" in sel.refused["ROCM_AITER_FA"]
    # Only TORCH_SDPA runs float32.
    sel = registry.select_backend("cuda", req=ModelRequirements(dtype=torch.float32))
    assert sel.backend.name == "TORCH_SDPA"
    assert set(sel.refused) == {"FLASH_ATTN", "TRITON_ATTN"}
    assert all("float32" in r for r in sel.refused.values())


def test_partial_requirements_are_checked(fake_registry):
    # A requirement with only a block size (no head_dim / dtype) must still be checked.
    full_set(fake_registry)
    assert registry.refusal_reason(registry.get_backend("ROCM_AITER_FA"), "rocm",
                                   ModelRequirements(block_size=8)) is not None
    assert registry.refusal_reason(registry.get_backend("ROCM_AITER_FA"), "rocm",
                                   ModelRequirements(block_size=32)) is None


# --- explicit choice ------------------------------------------------------------------------

def test_explicit_name_overrides_priority(fake_registry):
    full_set(fake_registry)
    sel = registry.select_backend("rocm", "TORCH_SDPA")
    assert sel.backend.name == "TORCH_SDPA"
    assert "explicit" in sel.reason


def test_explicit_backend_outside_priority_list_is_allowed(fake_registry):
    full_set(fake_registry)
    fake_registry(make_backend("CUSTOM_ATTN"))
    assert registry.select_backend("cuda", "CUSTOM_ATTN").backend.name == "CUSTOM_ATTN"


def test_explicit_name_from_env_var(fake_registry, monkeypatch):
    full_set(fake_registry)
    monkeypatch.setenv("ROCDRAFT_ATTENTION_BACKEND", "TRITON_ATTN")
    assert envs.attention_backend() == "TRITON_ATTN"
    assert registry.select_backend("rocm", envs.attention_backend()).backend.name == "TRITON_ATTN"
    # Empty or unset: the priority list decides.
    monkeypatch.setenv("ROCDRAFT_ATTENTION_BACKEND", "")
    assert envs.attention_backend() is None
    assert registry.select_backend("rocm", envs.attention_backend()).backend.name == \
        "ROCM_AITER_FA"
    monkeypatch.delenv("ROCDRAFT_ATTENTION_BACKEND")
    assert envs.attention_backend() is None


def test_env_var_is_read_at_call_time(monkeypatch):
    monkeypatch.setenv("ROCDRAFT_DRAFT_ATTENTION_BACKEND", "X1")
    assert envs.draft_attention_backend() == "X1"
    monkeypatch.setenv("ROCDRAFT_DRAFT_ATTENTION_BACKEND", "X2")
    assert envs.draft_attention_backend() == "X2"


def test_unknown_explicit_name_lists_every_registered_name(fake_registry, monkeypatch):
    full_set(fake_registry)
    monkeypatch.setenv("ROCDRAFT_ATTENTION_BACKEND", "NO_SUCH_ATTN")
    with pytest.raises(RocdraftError) as exc:
        registry.select_backend("cpu", envs.attention_backend())
    msg = str(exc.value)
    assert "NO_SUCH_ATTN" in msg
    for name in registry.registered_names():
        assert name in msg


def test_unknown_name_in_the_real_registry_lists_torch_sdpa():
    with pytest.raises(RocdraftError) as exc:
        registry.get_backend("nope")
    for name in registry.registered_names():
        assert name in str(exc.value)
    assert "TORCH_SDPA" in str(exc.value)


def test_explicit_unavailable_backend_names_the_reason(fake_registry):
    full_set(fake_registry, ROCM_AITER_FA="aiter needs hipconfig")
    with pytest.raises(BackendUnavailableError) as exc:
        registry.select_backend("rocm", "ROCM_AITER_FA")
    assert "ROCM_AITER_FA" in str(exc.value) and "aiter needs hipconfig" in str(exc.value)


def test_explicit_backend_on_wrong_platform_names_the_platform(fake_registry):
    full_set(fake_registry)
    with pytest.raises(BackendUnavailableError, match=r"ROCM_AITER_FA.*platform cpu"):
        registry.select_backend("cpu", "ROCM_AITER_FA")


def test_explicit_backend_failing_requirements(fake_registry):
    full_set(fake_registry)
    fake_registry(make_backend("PICKY", head_sizes=(64, 128)))
    with pytest.raises(BackendUnavailableError, match="PICKY.*head_dim 80"):
        registry.select_backend("cpu", "PICKY", ModelRequirements(head_dim=80))


def test_real_torch_sdpa_is_selected_on_cpu():
    assert registry.refusal_reason(TorchSDPABackend, "cpu") is None
    assert registry.select_backend("cpu", "TORCH_SDPA").backend is TorchSDPABackend


# --- capability queries ---------------------------------------------------------------------

def test_supports_and_backends_supporting(fake_registry):
    fake_registry(
        make_backend("A_ATTN", multi_token_drafting=False, graph_capture=GraphCapture.NONE),
        make_backend("B_ATTN", tree_drafting=True, graph_capture=GraphCapture.FULL,
                     kv_cache_dtypes=(torch.float8_e4m3fnuz,)),
        make_backend("C_ATTN", tree_drafting=True))
    assert not registry.supports("A_ATTN", Feature.MULTI_TOKEN_DRAFTING)
    assert registry.supports("C_ATTN", Feature.MULTI_TOKEN_DRAFTING)
    assert registry.backends_supporting(Feature.TREE_DRAFTING) == ["B_ATTN", "C_ATTN"]
    assert registry.backends_supporting(Feature.MULTI_TOKEN_DRAFTING) == ["B_ATTN", "C_ATTN"]
    # UNIFORM_DECODE capture is not full capture.
    assert registry.backends_supporting(Feature.FULL_GRAPH_CAPTURE) == ["B_ATTN"]
    assert registry.backends_supporting(Feature.FP8_KV_CACHE) == ["B_ATTN"]
    with pytest.raises(RocdraftError):
        registry.supports("Z_ATTN", Feature.TREE_DRAFTING)


def test_require_names_the_backends_that_do(fake_registry):
    fake_registry(make_backend("A_ATTN"), make_backend("B_ATTN", tree_drafting=True),
                  make_backend("C_ATTN", tree_drafting=True))
    registry.require("B_ATTN", Feature.TREE_DRAFTING)  # supported: no error
    with pytest.raises(UnsupportedFeatureError) as exc:
        registry.require("A_ATTN", Feature.TREE_DRAFTING, "EAGLE-2 trees")
    msg = str(exc.value)
    assert "A_ATTN" in msg and "tree_drafting" in msg and "EAGLE-2 trees" in msg
    assert re.search(r"B_ATTN, C_ATTN", msg)


def test_require_says_none_when_nobody_supports(fake_registry):
    fake_registry(make_backend("A_ATTN"))
    with pytest.raises(UnsupportedFeatureError, match="none"):
        registry.require("A_ATTN", Feature.FP8_KV_CACHE)


def test_unknown_feature_is_rejected():
    with pytest.raises(ValueError, match="bogus"):
        make_caps().has("bogus")


def test_real_torch_sdpa_capabilities():
    for feature in Feature:
        assert registry.supports("TORCH_SDPA", feature), feature
    assert "TORCH_SDPA" in registry.backends_supporting(Feature.TREE_DRAFTING)


# --- metadata ownership ---------------------------------------------------------------------

def test_backend_for_metadata_instance_and_type(fake_registry):
    a, b = fake_registry(make_backend("A_ATTN"), make_backend("B_ATTN"))
    assert registry.backend_for_metadata(a.metadata_cls) is a
    assert registry.backend_for_metadata(a.metadata_cls()) is a
    assert registry.backend_for_metadata(b.metadata_cls()) is b


def test_backend_for_metadata_unknown_type():
    class Stranger:
        pass

    with pytest.raises(RocdraftError, match="Stranger"):
        registry.backend_for_metadata(Stranger())
    # A subclass of a registered metadata type is not owned (exact type match).
    sub = type("SubMeta", (TorchSDPAMetadata,), {})
    with pytest.raises(RocdraftError, match="SubMeta"):
        registry.backend_for_metadata(sub)


def test_real_torch_sdpa_owns_its_metadata():
    assert registry.backend_for_metadata(TorchSDPAMetadata) is TorchSDPABackend


def test_duplicate_metadata_type_rejected(fake_registry):
    a = fake_registry(make_backend("A_ATTN"))
    clash = type("Clash", (AttentionBackend,), dict(
        name="CLASH_ATTN", metadata_cls=a.metadata_cls, capabilities=make_caps()))
    with pytest.raises(ValueError) as exc:
        registry.register_backend(clash)
    assert "A_ATTN" in str(exc.value) and a.metadata_cls.__name__ in str(exc.value)
    assert "CLASH_ATTN" not in registry.registered_names()


def test_reregistering_the_same_name_replaces(fake_registry):
    a = fake_registry(make_backend("A_ATTN"))
    a2 = type("A2", (AttentionBackend,), dict(name="A_ATTN", metadata_cls=a.metadata_cls,
                                              capabilities=make_caps()))
    registry.register_backend(a2)
    assert registry.get_backend("A_ATTN") is a2
    assert registry.registered_names() == ["A_ATTN"]


def test_backend_without_name_rejected(fake_registry):
    nameless = type("Nameless", (AttentionBackend,), dict(metadata_cls=type("M", (), {}),
                                                          capabilities=make_caps()))
    with pytest.raises(ValueError, match="Nameless"):
        registry.register_backend(nameless)


def test_fake_registrations_do_not_leak():
    assert "A_ATTN" not in registry.registered_names()
    assert "TORCH_SDPA" in registry.registered_names()


# --- configuration problems -----------------------------------------------------------------

@pytest.mark.parametrize("block_size, ok", [(16, True), (32, True), (128, True), (8, False),
                                            (24, False), (0, False), (-16, False)])
def test_config_problem_block_size(block_size, ok):
    caps = make_caps(block_size_multiple=16)
    problem = caps.config_problem(block_size=block_size)
    assert (problem is None) == ok
    if not ok:
        assert str(block_size) in problem and "16" in problem


def test_config_problem_head_size():
    caps = make_caps(head_sizes=(64, 128))
    assert caps.config_problem(head_dim=128) is None
    problem = caps.config_problem(head_dim=96)
    assert "96" in problem and "64" in problem and "128" in problem
    assert make_caps(head_sizes=None).config_problem(head_dim=96) is None


def test_config_problem_dtype():
    caps = make_caps(dtypes=(torch.float16,))
    assert caps.config_problem(dtype=torch.float16) is None
    problem = caps.config_problem(dtype=torch.float32)
    assert "float32" in problem and "float16" in problem


def test_config_problem_kv_cache_dtype():
    caps = make_caps(kv_cache_dtypes=(torch.float8_e4m3fnuz,))
    assert caps.config_problem(dtype=torch.float16, kv_cache_dtype=torch.float16) is None
    assert caps.config_problem(dtype=torch.float16,
                               kv_cache_dtype=torch.float8_e4m3fnuz) is None
    problem = caps.config_problem(dtype=torch.float16, kv_cache_dtype=torch.float8_e4m3fn)
    assert problem is not None and "float8_e4m3fn" in problem


def test_config_problem_checks_in_order_and_none_means_unchecked():
    caps = make_caps(block_size_multiple=16, head_sizes=(64,), dtypes=(torch.float16,))
    assert caps.config_problem() is None
    assert caps.config_problem(16, 64, torch.float16) is None
    assert "block_size" in caps.config_problem(8, 80, torch.float32)
    assert "head_dim" in caps.config_problem(16, 80, torch.float32)
    assert "dtype" in caps.config_problem(16, 64, torch.float32)


def test_config_problem_head_size_rule():
    caps = make_caps(head_size_multiple=16, max_head_size=256)
    for ok in (16, 48, 112, 256):
        assert caps.config_problem(head_dim=ok) is None, ok
    for bad in (8, 24, 264, 272, 0):
        assert caps.config_problem(head_dim=bad) == \
            f"head_dim {bad} is not a multiple of 16 up to 256"
    # An explicit list is checked first, then the rule.
    listed = make_caps(head_sizes=(64, 128), max_head_size=96)
    assert "one of [64, 128]" in listed.config_problem(head_dim=80)
    assert listed.config_problem(head_dim=64) is None
    assert "up to 96" in listed.config_problem(head_dim=128)
    with pytest.raises(ValueError, match="head_size_multiple"):
        make_caps(head_size_multiple=0)


# --- fp8 formats per platform and arch ------------------------------------------------------

@pytest.mark.parametrize("target, kind, arch, ok", [
    ("rocm", "rocm", "gfx942", True), ("rocm", "cuda", "sm_90", False),
    ("gfx942", "rocm", "gfx942", True), ("gfx942", "rocm", "gfx90a", False),
    ("gfx942", "rocm", None, False), ("sm_89+", "cuda", "sm_89", True),
    ("sm_89+", "cuda", "sm_90", True), ("sm_89+", "cuda", "sm_100", True),
    ("sm_89+", "cuda", "sm_80", False), ("sm_89+", "rocm", "gfx942", False),
    ("sm_89+", "cuda", None, False), ("sm_90", "cuda", "sm_90", True),
    ("sm_90", "cuda", "sm_100", False), ("cpu", "cpu", None, True)])
def test_target_matches(target, kind, arch, ok):
    assert target_matches(target, kind, arch) is ok


def test_unknown_format_target_is_rejected():
    with pytest.raises(ValueError, match="tpu"):
        make_caps(kv_cache_formats=(("tpu", torch.float8_e4m3fn),))


def test_fp8_formats_per_arch():
    fnuz, fn = torch.float8_e4m3fnuz, torch.float8_e4m3fn
    caps = make_caps(kv_cache_formats=(("gfx942", fnuz), ("sm_89+", fn)))
    assert caps.has(Feature.FP8_KV_CACHE)
    assert caps.kv_cache_dtypes_for("rocm", "gfx942") == (fnuz,)
    assert caps.kv_cache_dtypes_for("cuda", "sm_90") == (fn,)
    assert caps.kv_cache_dtypes_for("cuda", "sm_80") == ()
    assert caps.kv_cache_dtypes_for(None) == (fnuz, fn)  # unchecked platform: any declared
    assert caps.config_problem(dtype=torch.bfloat16, kv_cache_dtype=fnuz,
                               platform_kind="rocm", arch="gfx942") is None
    problem = caps.config_problem(dtype=torch.bfloat16, kv_cache_dtype=fnuz,
                                  platform_kind="cuda", arch="sm_90")
    assert problem == ("kv cache dtype float8_e4m3fnuz is not supported on cuda sm_90; "
                       "declared fp8 formats: gfx942: float8_e4m3fnuz, sm_89+: float8_e4m3fn")
    assert "arch unknown" in caps.config_problem(dtype=torch.bfloat16, kv_cache_dtype=fnuz,
                                                 platform_kind="rocm")


def test_selection_checks_the_fp8_format_of_the_arch(fake_registry):
    fnuz = torch.float8_e4m3fnuz
    fake_registry(make_backend("TRITON_ATTN", kv_cache_formats=(("gfx942", fnuz),)),
                  make_backend("TORCH_SDPA", kv_cache_dtypes=(fnuz,)))
    req = ModelRequirements(dtype=torch.float16, kv_cache_dtype=fnuz)
    assert registry.select_backend("rocm", "TRITON_ATTN", req, arch="gfx942").backend.name \
        == "TRITON_ATTN"
    with pytest.raises(BackendUnavailableError, match="not supported on cuda sm_90"):
        registry.select_backend("cuda", "TRITON_ATTN", req, arch="sm_90")
    sel = registry.select_backend("cuda", req=req, arch="sm_90")
    assert sel.backend.name == "TORCH_SDPA" and "sm_90" in sel.refused["TRITON_ATTN"]


def test_real_triton_attn_fp8_formats():
    caps = registry.get_backend("TRITON_ATTN").capabilities
    fnuz, fn = torch.float8_e4m3fnuz, torch.float8_e4m3fn
    assert caps.kv_cache_dtypes_for("rocm", "gfx942") == (fnuz,)
    assert caps.kv_cache_dtypes_for("rocm", "gfx90a") == (fnuz,)
    assert caps.kv_cache_dtypes_for("rocm", "gfx950") == (fn,)
    assert caps.kv_cache_dtypes_for("cuda", "sm_90") == (fn,)  # no fp8e4b8 on NVIDIA
    assert caps.kv_cache_dtypes_for("cuda", "sm_80") == ()  # fp8e4nv needs sm_89
    assert set(caps.kv_cache_dtypes_for("cpu")) == {fn, fnuz}


# --- the draft loop's backend ---------------------------------------------------------------

def rocm_set(add, **caps_of):
    """The real backends' shapes on an MI300: ROCM_AITER_FA captures UNIFORM_DECODE only,
    TRITON_ATTN and TORCH_SDPA capture FULL; all available unless ``caps_of`` says otherwise."""
    add(make_backend("ROCM_AITER_FA", platforms=("rocm",), block_size_multiple=16,
                     **caps_of.get("ROCM_AITER_FA", {})),
        make_backend("TRITON_ATTN", tree_drafting=True, graph_capture=GraphCapture.FULL,
                     head_size_multiple=16, max_head_size=256,
                     **caps_of.get("TRITON_ATTN", {})),
        make_backend("TORCH_SDPA", tree_drafting=True, graph_capture=GraphCapture.FULL))


def test_draft_loop_on_rocm_gets_triton_attn_with_a_reason(fake_registry, monkeypatch):
    monkeypatch.delenv("ROCDRAFT_DRAFT_ATTENTION_BACKEND", raising=False)
    rocm_set(fake_registry)
    assert registry.select_backend("rocm").backend.name == "ROCM_AITER_FA"
    sel = registry.select_draft_backend("rocm", "ROCM_AITER_FA", req=ModelRequirements(
        block_size=16, head_dim=128, dtype=torch.bfloat16), num_speculative_tokens=4,
        need_graphs=True, arch="gfx942")
    assert sel.backend.name == "TRITON_ATTN"
    assert "ROCM_AITER_FA" in sel.reason and "full_graph_capture" in sel.reason
    assert "TRITON_ATTN is the first in the rocm priority list" in sel.reason
    assert "full_graph_capture" in sel.refused["ROCM_AITER_FA"]


def test_draft_loop_without_graphs_keeps_the_targets_backend(fake_registry, monkeypatch):
    monkeypatch.delenv("ROCDRAFT_DRAFT_ATTENTION_BACKEND", raising=False)
    rocm_set(fake_registry)
    for k, graphs in ((4, False), (1, True)):  # enforce_eager, or no loop to capture
        sel = registry.select_draft_backend("rocm", "ROCM_AITER_FA", num_speculative_tokens=k,
                                            need_graphs=graphs)
        assert sel.backend.name == "ROCM_AITER_FA" and "target's backend" in sel.reason


def test_draft_loop_falls_past_an_unavailable_triton(fake_registry, monkeypatch):
    monkeypatch.delenv("ROCDRAFT_DRAFT_ATTENTION_BACKEND", raising=False)
    rocm_set(fake_registry)
    monkeypatch.setattr(registry.get_backend("TRITON_ATTN"), "availability",
                        classmethod(lambda cls: "triton cannot be imported"))
    sel = registry.select_draft_backend("rocm", "ROCM_AITER_FA", num_speculative_tokens=3,
                                        need_graphs=True)
    assert sel.backend.name == "TORCH_SDPA"
    assert sel.refused["TRITON_ATTN"] == "triton cannot be imported"


def test_draft_loop_head_dim_off_the_rule_falls_back(fake_registry, monkeypatch):
    monkeypatch.delenv("ROCDRAFT_DRAFT_ATTENTION_BACKEND", raising=False)
    rocm_set(fake_registry)
    sel = registry.select_draft_backend("rocm", "ROCM_AITER_FA",
                                        req=ModelRequirements(head_dim=72),
                                        num_speculative_tokens=3, need_graphs=True)
    assert sel.backend.name == "TORCH_SDPA"
    assert "multiple of 16" in sel.refused["TRITON_ATTN"]


def test_draft_loop_when_nothing_captures_runs_the_target_eagerly(fake_registry, monkeypatch):
    monkeypatch.delenv("ROCDRAFT_DRAFT_ATTENTION_BACKEND", raising=False)
    fake_registry(make_backend("ROCM_AITER_FA", platforms=("rocm",)),
                  make_backend("TRITON_ATTN", "no triton"), make_backend("TORCH_SDPA", "no"))
    sel = registry.select_draft_backend("rocm", "ROCM_AITER_FA", num_speculative_tokens=3,
                                        need_graphs=True)
    assert sel.backend.name == "ROCM_AITER_FA" and "eagerly" in sel.reason


def test_draft_override_wins(fake_registry, monkeypatch):
    rocm_set(fake_registry)
    monkeypatch.setenv("ROCDRAFT_DRAFT_ATTENTION_BACKEND", "ROCM_AITER_FA")
    sel = registry.select_draft_backend("rocm", "ROCM_AITER_FA", num_speculative_tokens=4,
                                        need_graphs=True)
    assert sel.backend.name == "ROCM_AITER_FA"
    assert sel.reason == "ROCDRAFT_DRAFT_ATTENTION_BACKEND=ROCM_AITER_FA"
    # The argument wins over the env var.
    sel = registry.select_draft_backend("rocm", "ROCM_AITER_FA", "TORCH_SDPA",
                                        num_speculative_tokens=4, need_graphs=True)
    assert sel.backend.name == "TORCH_SDPA" and sel.reason == "draft_attention_backend=TORCH_SDPA"


def test_draft_default_on_cpu_is_the_targets(fake_registry, monkeypatch):
    monkeypatch.delenv("ROCDRAFT_DRAFT_ATTENTION_BACKEND", raising=False)
    rocm_set(fake_registry)
    sel = registry.select_draft_backend("cpu", "TORCH_SDPA", num_speculative_tokens=4,
                                        need_graphs=False)
    assert sel.backend.name == "TORCH_SDPA" and "target's backend" in sel.reason


def test_draft_env_var_with_an_unknown_name(fake_registry, monkeypatch):
    rocm_set(fake_registry)
    monkeypatch.setenv("ROCDRAFT_DRAFT_ATTENTION_BACKEND", "NO_SUCH_ATTN")
    with pytest.raises(RocdraftError) as exc:
        registry.select_draft_backend("rocm", "ROCM_AITER_FA", num_speculative_tokens=2)
    msg = str(exc.value)
    assert msg.startswith("ROCDRAFT_DRAFT_ATTENTION_BACKEND='NO_SUCH_ATTN' is not a "
                          "registered attention backend")
    for name in ("ROCM_AITER_FA", "TORCH_SDPA", "TRITON_ATTN"):
        assert name in msg
    with pytest.raises(RocdraftError, match="draft_attention_backend='NOPE'"):
        registry.select_draft_backend("rocm", "ROCM_AITER_FA", "NOPE")


def test_draft_override_that_cannot_run_here(fake_registry, monkeypatch):
    rocm_set(fake_registry)
    monkeypatch.setenv("ROCDRAFT_DRAFT_ATTENTION_BACKEND", "ROCM_AITER_FA")
    with pytest.raises(BackendUnavailableError,
                       match="ROCM_AITER_FA.*ROCDRAFT_DRAFT_ATTENTION_BACKEND.*platform cpu"):
        registry.select_draft_backend("cpu", "TORCH_SDPA")
