"""backends_report / format_backends_report: every registered backend with its capabilities
and availability, and which backend would be selected now and why."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rocdraft.backends import registry
from rocdraft.backends_report import backends_report, format_backends_report
from rocdraft.platform import detect_platform

CAPABILITY_KEYS = {"multi_token_drafting", "tree_drafting", "graph_capture", "kv_layouts",
                   "block_size_multiple", "dtypes", "head_sizes", "kv_cache_dtypes",
                   "platforms"}


@pytest.fixture(autouse=True)
def _no_env_choice(monkeypatch):
    monkeypatch.delenv("ROCDRAFT_ATTENTION_BACKEND", raising=False)


def test_structure():
    report = backends_report()
    platform = detect_platform()
    assert set(report) == {"platform", "arch", "backends", "selected"}
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
        assert caps["head_sizes"] == "any" or all(isinstance(h, int) for h in caps["head_sizes"])
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
    assert report["selected"]["name"] == "TORCH_SDPA"
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
