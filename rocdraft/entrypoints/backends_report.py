"""What ``rocdraft backends`` shows: every registered backend, its capabilities, whether it
can run here (and why not), which one would be selected now and why, and which one the EAGLE
head's draft loop would get (k > 1; FULL graph capture wanted on a GPU) and why."""
from __future__ import annotations

from rocdraft import envs
from rocdraft.backends import registry
from rocdraft.errors import RocdraftError
from rocdraft.platform import detect_platform


def _dtype_names(dtypes) -> list[str]:
    return [str(d).replace("torch.", "") for d in dtypes]


def _head_sizes(caps) -> list[int] | str:
    """An explicit list as ints; a rule in words ("a multiple of 16 up to 256", "any")."""
    only_a_list = caps.head_size_multiple is None and caps.max_head_size is None
    return list(caps.head_sizes) if caps.head_sizes is not None and only_a_list \
        else caps.head_size_rule()


def backends_report() -> dict:
    platform = detect_platform()
    rows = []
    for name in registry.registered_names():
        cls = registry.get_backend(name)
        caps = cls.capabilities
        reason = registry.refusal_reason(cls, platform.kind, arch=platform.arch)
        rows.append({
            "name": name, "metadata_type": cls.metadata_cls.__name__,
            "available": reason is None, "unavailable_reason": reason,
            "capabilities": {
                "multi_token_drafting": caps.multi_token_drafting,
                "tree_drafting": caps.tree_drafting,
                "graph_capture": caps.graph_capture.name,
                "kv_layouts": list(caps.kv_layouts),
                "block_size_multiple": caps.block_size_multiple,
                "dtypes": _dtype_names(caps.dtypes),
                "head_sizes": _head_sizes(caps),
                # fp8 caches valid here, and every declared format (target: dtype).
                "kv_cache_dtypes": _dtype_names(caps.kv_cache_dtypes_for(platform.kind,
                                                                         platform.arch)),
                "kv_cache_formats": caps.kv_cache_formats_text(),
                "platforms": list(caps.platforms)}})
    draft = {"name": None, "reason": "no target backend can run here", "refused": {}}
    try:
        explicit = envs.checked_backend(envs.ATTENTION_BACKEND, registry.registered_names())
        selection = registry.select_backend(platform.kind, explicit, arch=platform.arch)
        selected = {"name": selection.backend.name,
                    "reason": ("ROCDRAFT_ATTENTION_BACKEND=" + explicit) if explicit
                    else selection.reason, "refused": selection.refused}
        draft = _draft_choice(platform, selection.backend.name)
    except RocdraftError as exc:
        selected = {"name": None, "reason": str(exc), "refused": {}}
    return {"platform": platform.kind, "arch": platform.arch, "backends": rows,
            "selected": selected, "draft": draft}


def _draft_choice(platform, target_backend: str) -> dict:
    """The draft backend LLM would pick for an EAGLE head with k > 1 (graphs on a GPU)."""
    try:
        selection = registry.select_draft_backend(
            platform.kind, target_backend, num_speculative_tokens=2,
            need_graphs=platform.is_gpu, arch=platform.arch)
    except RocdraftError as exc:
        return {"name": None, "reason": str(exc), "refused": {}}
    return {"name": selection.backend.name, "reason": selection.reason,
            "refused": selection.refused}


def format_backends_report(report: dict) -> str:
    lines = [f"platform: {report['platform']}" + (f" ({report['arch']})" if report['arch'] else "")]
    for row in report["backends"]:
        caps = row["capabilities"]
        status = "available" if row["available"] else f"unavailable: {row['unavailable_reason']}"
        lines.append(f"\n{row['name']}  [{status}]")
        lines.append(f"  metadata: {row['metadata_type']}")
        lines.append(f"  multi-token drafting: {caps['multi_token_drafting']}, tree drafting: "
                     f"{caps['tree_drafting']}, graph capture: {caps['graph_capture']}")
        lines.append(f"  kv layouts: {', '.join(caps['kv_layouts'])}; block size: multiple of "
                     f"{caps['block_size_multiple']}; head sizes: {caps['head_sizes']}")
        lines.append(f"  dtypes: {', '.join(caps['dtypes'])}; fp8 kv cache here: "
                     f"{', '.join(caps['kv_cache_dtypes']) or 'no'} (declared: "
                     f"{', '.join(caps['kv_cache_formats']) or 'none'}); platforms: "
                     f"{', '.join(caps['platforms'])}")
    sel = report["selected"]
    lines.append(f"\nselected now: {sel['name'] or 'none'} ({sel['reason']})")
    for name, reason in sel["refused"].items():
        lines.append(f"  refused {name}: {reason}")
    draft = report.get("draft")
    if draft is not None:
        lines.append(f"draft loop (EAGLE head, k > 1): {draft['name'] or 'none'} "
                     f"({draft['reason']})")
        for name, reason in draft["refused"].items():
            lines.append(f"  refused {name}: {reason}")
    return "\n".join(lines)
