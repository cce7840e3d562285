"""What ``rocdraft backends`` shows: every registered backend, its capabilities, whether it
can run here (and why not), and which one would be selected now and why."""
from __future__ import annotations

from rocdraft import envs
from rocdraft.backends import registry
from rocdraft.errors import RocdraftError
from rocdraft.platform import detect_platform


def backends_report() -> dict:
    platform = detect_platform()
    rows = []
    for name in registry.registered_names():
        cls = registry.get_backend(name)
        caps = cls.capabilities
        rows.append({
            "name": name, "metadata_type": cls.metadata_cls.__name__,
            "available": registry.refusal_reason(cls, platform.kind) is None,
            "unavailable_reason": registry.refusal_reason(cls, platform.kind),
            "capabilities": {
                "multi_token_drafting": caps.multi_token_drafting,
                "tree_drafting": caps.tree_drafting,
                "graph_capture": caps.graph_capture.name,
                "kv_layouts": list(caps.kv_layouts),
                "block_size_multiple": caps.block_size_multiple,
                "dtypes": [str(d).replace("torch.", "") for d in caps.dtypes],
                "head_sizes": list(caps.head_sizes) if caps.head_sizes else "any",
                "kv_cache_dtypes": [str(d).replace("torch.", "") for d in caps.kv_cache_dtypes],
                "platforms": list(caps.platforms)}})
    explicit = envs.attention_backend()
    try:
        selection = registry.select_backend(platform.kind, explicit)
        selected = {"name": selection.backend.name,
                    "reason": ("ROCDRAFT_ATTENTION_BACKEND=" + explicit) if explicit
                    else selection.reason, "refused": selection.refused}
    except RocdraftError as exc:
        selected = {"name": None, "reason": str(exc), "refused": {}}
    return {"platform": platform.kind, "arch": platform.arch, "backends": rows,
            "selected": selected}


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
        lines.append(f"  dtypes: {', '.join(caps['dtypes'])}; fp8 kv cache: "
                     f"{', '.join(caps['kv_cache_dtypes']) or 'no'}; platforms: "
                     f"{', '.join(caps['platforms'])}")
    sel = report["selected"]
    lines.append(f"\nselected now: {sel['name'] or 'none'} ({sel['reason']})")
    for name, reason in sel["refused"].items():
        lines.append(f"  refused {name}: {reason}")
    return "\n".join(lines)
