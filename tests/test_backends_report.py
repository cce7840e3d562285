"""backends_report / format_backends_report: every registered backend with its capabilities
and availability, which backend would be selected now and why, and the draft loop's."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rocdraft.entrypoints import backends_report as report_module
from rocdraft.backends import registry
from rocdraft.entrypoints.backends_report import backends_report, format_backends_report
from rocdraft.platform import Platform, detect_platform

CAPABILITY_KEYS = {"multi_token_drafting", "tree_drafting", "graph_capture", "kv_layouts",
                   "block_size_multiple", "dtypes", "head_sizes", "kv_cache_dtypes",
                   "kv_cache_formats", "platforms"}


@pytest.fixture(autouse=True)
def _no_env_choice(monkeypatch):
    monkeypatch.delenv("ROCDRAFT_ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv("ROCDRAFT_DRAFT_ATTENTION_BACKEND", raising=False)


def test_structure():
    report = backends_report()
    platform = detect_platform()
    assert set(report) == {"platform", "arch", "backends", "selected", "draft"}
    assert set(report["draft"]) == {"name", "reason", "refused"}
    assert report["platform"] == platform.kind and report["arch"] == platform.arch
    assert [row["name"] for row in report["backends"]] == registry.registered_names()
    for row in report["backends"]:
        cls = registry.get_backend(row["name"])
        assert set(row) == {"name", "metadata_type", "available", "unavailable_reason",
                            "capabilities"}
        assert row["metadata_type"] == cls.metadata_cls.__name__
        caps = row["capabilities"]
        assert set(caps) == CAPABILITY_KEYS
        assert caps["multi_token_drafting"] == cls.capabilities.multi_token_drafting
        assert caps["tree_drafting"] == cls.capabilities.tree_drafting
        assert caps["graph_capture"] == cls.capabilities.graph_capture.name
        assert caps["platforms"] == list(cls.capabilities.platforms)
        assert all(not d.startswith("torch.") for d in caps["dtypes"] + caps["kv_cache_dtypes"])
        assert isinstance(caps["head_sizes"], str) or all(isinstance(h, int)
                                                          for h in caps["head_sizes"])
    # The report is what ``rocdraft backends --json`` prints.
    assert json.loads(json.dumps(report)) == report


def test_availability_matches_registry():
    report = backends_report()
    kind = report["platform"]
    for row in report["backends"]:
        reason = registry.refusal_reason(registry.get_backend(row["name"]), kind)
        assert row["available"] == (reason is None)
        if row["available"]:
            assert row["unavailable_reason"] is None
        else:
            assert isinstance(row["unavailable_reason"], str) and row["unavailable_reason"]


@pytest.mark.skipif(detect_platform().kind != "cpu", reason="CPU-only expectations")
def test_cpu_expectations():
    report = backends_report()
    rows = {row["name"]: row for row in report["backends"]}
    assert rows["TORCH_SDPA"]["available"]
    for name in ("ROCM_AITER_FA", "FLASH_ATTN"):
        assert not rows[name]["available"]
        assert "cpu" in rows[name]["unavailable_reason"]
    assert report["selected"]["name"] == "CPU_ATTN"
    assert "priority" in report["selected"]["reason"]
    assert report["arch"] is None


def test_unavailable_backend_reason_from_availability(monkeypatch):
    """A backend that supports this platform but lacks its package says why."""
    kind = detect_platform().kind
    base = registry.get_backend("TORCH_SDPA")

    class Missing(base):
        name = "ZZ_MISSING"
        capabilities = replace(base.capabilities, platforms=(kind,))

        @classmethod
        def availability(cls):
            return "package zz_attn is not installed"

    Missing.metadata_cls = type("ZZMetadata", (base.metadata_cls,), {})
    monkeypatch.setitem(registry._BACKENDS, "ZZ_MISSING", Missing)
    report = backends_report()
    row = [r for r in report["backends"] if r["name"] == "ZZ_MISSING"][0]
    assert not row["available"]
    assert row["unavailable_reason"] == "package zz_attn is not installed"
    assert row["metadata_type"] == "ZZMetadata"
    text = format_backends_report(report)
    assert "ZZ_MISSING  [unavailable: package zz_attn is not installed]" in text


def test_selected_from_env(monkeypatch):
    monkeypatch.setenv("ROCDRAFT_ATTENTION_BACKEND", "TORCH_SDPA")
    selected = backends_report()["selected"]
    assert selected["name"] == "TORCH_SDPA"
    assert "ROCDRAFT_ATTENTION_BACKEND" in selected["reason"]
    assert "TORCH_SDPA" in selected["reason"]
    assert selected["refused"] == {}


def test_unknown_env_backend_is_reported_not_raised(monkeypatch):
    monkeypatch.setenv("ROCDRAFT_ATTENTION_BACKEND", "NO_SUCH")
    report = backends_report()
    assert report["selected"]["name"] is None
    assert "NO_SUCH" in report["selected"]["reason"]
    for name in registry.registered_names():
        assert name in report["selected"]["reason"]
    assert "selected now: none" in format_backends_report(report)


@pytest.mark.skipif(detect_platform().kind != "cpu", reason="CPU-only expectations")
def test_env_backend_that_cannot_run_here(monkeypatch):
    monkeypatch.setenv("ROCDRAFT_ATTENTION_BACKEND", "ROCM_AITER_FA")
    selected = backends_report()["selected"]
    assert selected["name"] is None
    assert "ROCM_AITER_FA" in selected["reason"] and "cpu" in selected["reason"]


def test_format_contains_every_backend():
    report = backends_report()
    text = format_backends_report(report)
    assert text.startswith(f"platform: {report['platform']}")
    for row in report["backends"]:
        assert f"\n{row['name']}  [" in text
        assert f"metadata: {row['metadata_type']}" in text
        if not row["available"]:
            assert row["unavailable_reason"] in text
    sel = report["selected"]
    assert f"selected now: {sel['name']} ({sel['reason']})" in text


def test_format_lists_refused_candidates():
    report = backends_report()
    report["selected"] = {"name": "TORCH_SDPA", "reason": "first usable",
                          "refused": {"ROCM_AITER_FA": "aiter is not installed"}}
    text = format_backends_report(report)
    assert "refused ROCM_AITER_FA: aiter is not installed" in text


def test_head_sizes_show_the_rule_or_the_list():
    rows = {row["name"]: row["capabilities"] for row in backends_report()["backends"]}
    assert rows["TRITON_ATTN"]["head_sizes"] == "a multiple of 16 up to 256"
    assert rows["TORCH_SDPA"]["head_sizes"] == "any"
    for name, caps in rows.items():  # vendor backends with a real list show the list
        declared = registry.get_backend(name).capabilities
        if declared.head_size_multiple is None and declared.max_head_size is None \
                and declared.head_sizes is not None:
            assert caps["head_sizes"] == list(declared.head_sizes), name


def _fake_rocm(monkeypatch, arch="gfx942"):
    """The report as on an MI300 whose aiter imports: TRITON_ATTN and ROCM_AITER_FA usable."""
    monkeypatch.setattr(report_module, "detect_platform", lambda: Platform("rocm", arch, "cuda"))
    for name in ("ROCM_AITER_FA", "TRITON_ATTN"):
        monkeypatch.setattr(registry.get_backend(name), "availability", classmethod(
            lambda cls: None))


def test_fp8_formats_are_the_ones_of_this_arch(monkeypatch):
    _fake_rocm(monkeypatch)
    rows = {row["name"]: row["capabilities"] for row in backends_report()["backends"]}
    assert rows["TRITON_ATTN"]["kv_cache_dtypes"] == ["float8_e4m3fnuz"]
    assert "sm_89+: float8_e4m3fn" in rows["TRITON_ATTN"]["kv_cache_formats"]
    monkeypatch.setattr(report_module, "detect_platform",
                        lambda: Platform("cuda", "sm_90", "cuda"))
    rows = {row["name"]: row["capabilities"] for row in backends_report()["backends"]}
    assert rows["TRITON_ATTN"]["kv_cache_dtypes"] == ["float8_e4m3fn"]


def test_draft_choice_on_rocm_is_triton_with_the_reason(monkeypatch):
    """On an MI300 the target gets ROCM_AITER_FA (UNIFORM_DECODE capture only), so the draft
    loop gets TRITON_ATTN (FULL) and the report says why."""
    _fake_rocm(monkeypatch)
    report = backends_report()
    assert report["selected"]["name"] == "ROCM_AITER_FA"
    draft = report["draft"]
    assert draft["name"] == "TRITON_ATTN"
    assert "ROCM_AITER_FA" in draft["reason"] and "full_graph_capture" in draft["reason"]
    text = format_backends_report(report)
    assert f"draft loop (EAGLE head, k > 1): TRITON_ATTN ({draft['reason']})" in text


def test_draft_choice_from_env(monkeypatch):
    monkeypatch.setenv("ROCDRAFT_DRAFT_ATTENTION_BACKEND", "TORCH_SDPA")
    draft = backends_report()["draft"]
    assert draft["name"] == "TORCH_SDPA"
    assert "ROCDRAFT_DRAFT_ATTENTION_BACKEND" in draft["reason"]
    monkeypatch.setenv("ROCDRAFT_DRAFT_ATTENTION_BACKEND", "NO_SUCH")
    draft = backends_report()["draft"]
    assert draft["name"] is None
    assert "ROCDRAFT_DRAFT_ATTENTION_BACKEND" in draft["reason"] and "NO_SUCH" in draft["reason"]


@pytest.mark.skipif(detect_platform().kind != "cpu", reason="CPU-only expectations")
def test_draft_choice_on_cpu_is_the_targets():
    draft = backends_report()["draft"]
    assert draft["name"] == "CPU_ATTN" and "target's backend" in draft["reason"]
