"""The attention-backend registry: who exists, what each can do, which runs here.

Backends register themselves with ``@register_backend``; nothing else keeps a list of them.
The registry answers three questions:

1. ``backend_for_metadata(obj_or_type)``: which backend owns this metadata type;
2. ``supports(name, feature)`` / ``backends_supporting(feature)`` / ``require(name, feature)``;
3. ``select_backend(...)``: the explicit choice (argument or env var) first, else the
   platform's priority list, keeping the reason every refused candidate was refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rocdraft.backends.base import AttentionBackend, Feature
from rocdraft.errors import BackendUnavailableError, RocdraftError, UnsupportedFeatureError

PRIORITY = {
    "rocm": ("ROCM_AITER_FA", "TRITON_ATTN", "TORCH_SDPA"),
    "cuda": ("FLASH_ATTN", "TRITON_ATTN", "TORCH_SDPA"),
    "cpu": ("TORCH_SDPA", "TRITON_ATTN"),
}

_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: add ``cls`` under ``cls.name``; metadata types must be unique."""
    if not cls.name:
        raise ValueError(f"backend class {cls.__name__} has no name")
    for other in _BACKENDS.values():
        if other.name != cls.name and other.metadata_cls is cls.metadata_cls:
            raise ValueError(f"metadata type {cls.metadata_cls.__name__} is already owned by "
                             f"{other.name}; each backend needs its own")
    _BACKENDS[cls.name] = cls
    return cls


def registered_names() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str) -> type[AttentionBackend]:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise RocdraftError(f"unknown attention backend {name!r}; registered: "
                            f"{', '.join(registered_names())}") from None


def backend_for_metadata(metadata) -> type[AttentionBackend]:
    """The backend whose metadata type is ``metadata`` (an instance or a type)."""
    mtype = metadata if isinstance(metadata, type) else type(metadata)
    for cls in _BACKENDS.values():
        if cls.metadata_cls is mtype:
            return cls
    raise RocdraftError(f"no registered backend owns metadata type {mtype.__name__}")


def supports(name: str, feature: Feature) -> bool:
    return get_backend(name).capabilities.has(feature)


def backends_supporting(feature: Feature) -> list[str]:
    return [n for n in registered_names() if _BACKENDS[n].capabilities.has(feature)]


def require(name: str, feature: Feature, why: str = "") -> None:
    """Raise ``UnsupportedFeatureError`` naming the backends that do support ``feature``."""
    if not supports(name, feature):
        others = backends_supporting(feature)
        purpose = f" ({why})" if why else ""
        raise UnsupportedFeatureError(
            f"attention backend {name} does not support {feature.value}{purpose}; "
            f"backends that do: {', '.join(others) or 'none'}")


@dataclass(frozen=True)
class ModelRequirements:
    """What a model asks of its attention backend; None fields are not checked."""

    block_size: int | None = None
    head_dim: int | None = None
    dtype: torch.dtype | None = None
    kv_cache_dtype: torch.dtype | None = None
    features: tuple[Feature, ...] = ()


def refusal_reason(cls: type[AttentionBackend], platform_kind: str,
                   req: ModelRequirements = ModelRequirements()) -> str | None:
    """Why ``cls`` cannot run here with ``req``, or None when it can."""
    caps = cls.capabilities
    if platform_kind not in caps.platforms:
        return f"platform {platform_kind} is not one of {list(caps.platforms)}"
    reason = cls.availability()
    if reason:
        return reason
    reason = caps.config_problem(req.block_size, req.head_dim, req.dtype, req.kv_cache_dtype)
    if reason:
        return reason
    missing = [f.value for f in req.features if not caps.has(f)]
    if missing:
        return f"does not support {', '.join(missing)}"
    return None


@dataclass(frozen=True)
class Selection:
    backend: type[AttentionBackend]
    reason: str  # why this one was chosen
    refused: dict[str, str] = field(default_factory=dict)  # name -> reason refused


def select_backend(platform_kind: str, explicit: str | None = None,
                   req: ModelRequirements = ModelRequirements()) -> Selection:
    """Pick the backend to run: ``explicit`` (from an argument or the env var) first, else the
    first candidate of the platform's priority list that can run here."""
    if explicit:
        cls = get_backend(explicit)
        reason = refusal_reason(cls, platform_kind, req)
        if reason:
            raise BackendUnavailableError(f"attention backend {explicit} cannot run here: {reason}")
        return Selection(cls, "chosen explicitly")
    if platform_kind not in PRIORITY:
        raise RocdraftError(f"unknown platform {platform_kind!r}; valid: {sorted(PRIORITY)}")
    refused: dict[str, str] = {}
    for name in PRIORITY[platform_kind]:
        if name not in _BACKENDS:
            refused[name] = "not registered"
            continue
        reason = refusal_reason(_BACKENDS[name], platform_kind, req)
        if reason is None:
            return Selection(_BACKENDS[name], f"first usable in the {platform_kind} priority "
                                              f"list {list(PRIORITY[platform_kind])}", refused)
        refused[name] = reason
    details = "; ".join(f"{n}: {r}" for n, r in refused.items())
    raise BackendUnavailableError(f"no attention backend can run here ({details})")
