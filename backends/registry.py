"""The attention-backend registry: who exists, what each can do, which runs here.

Backends register themselves with ``@register_backend``; nothing else keeps a list of them.
The registry answers three questions:

1. ``backend_for_metadata(obj_or_type)``: which backend owns this metadata type;
2. ``supports(name, feature)`` / ``backends_supporting(feature)`` / ``require(name, feature)``;
3. ``select_backend(...)``: the explicit choice (argument or env var) first, else the
   platform's priority list, keeping the reason every refused candidate was refused;
   ``select_draft_backend(...)`` the same for the EAGLE head, by what the draft loop needs.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from rocdraft import envs
from rocdraft.backends.base import AttentionBackend, Feature
from rocdraft.errors import BackendUnavailableError, RocdraftError, UnsupportedFeatureError

DRAFT_ENV_VAR = envs.DRAFT_ATTENTION_BACKEND
PRIORITY = {
    "rocm": ("ROCM_AITER_FA", "TRITON_ATTN", "TORCH_SDPA"),
    "cuda": ("FLASH_ATTN", "TRITON_ATTN", "TORCH_SDPA"),
    "cpu": ("CPU_ATTN", "TORCH_SDPA", "TRITON_ATTN"),
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
                   req: ModelRequirements = ModelRequirements(),
                   arch: str | None = None) -> str | None:
    """Why ``cls`` cannot run here (``platform_kind``, ``arch`` as in rocdraft.platform) with
    ``req``, or None when it can."""
    caps = cls.capabilities
    if platform_kind not in caps.platforms:
        return f"platform {platform_kind} is not one of {list(caps.platforms)}"
    reason = cls.availability()
    if reason:
        return reason
    reason = caps.config_problem(req.block_size, req.head_dim, req.dtype, req.kv_cache_dtype,
                                 platform_kind, arch)
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
                   req: ModelRequirements = ModelRequirements(),
                   arch: str | None = None) -> Selection:
    """Pick the backend to run: ``explicit`` (from an argument or the env var) first, else the
    first candidate of the platform's priority list that can run here."""
    if explicit:
        cls = get_backend(explicit)
        reason = refusal_reason(cls, platform_kind, req, arch)
        if reason:
            raise BackendUnavailableError(f"attention backend {explicit} cannot run here: {reason}")
        return Selection(cls, "chosen explicitly")
    selection, refused = _first_in_priority(platform_kind, req, arch)
    if selection is None:
        details = "; ".join(f"{n}: {r}" for n, r in refused.items())
        raise BackendUnavailableError(f"no attention backend can run here ({details})")
    return selection


def _first_in_priority(platform_kind: str, req: ModelRequirements, arch: str | None
                       ) -> tuple[Selection | None, dict[str, str]]:
    """(the first usable backend of the platform's priority list or None, refusal reasons)."""
    if platform_kind not in PRIORITY:
        raise RocdraftError(f"unknown platform {platform_kind!r}; valid: {sorted(PRIORITY)}")
    refused: dict[str, str] = {}
    for name in PRIORITY[platform_kind]:
        if name not in _BACKENDS:
            refused[name] = "not registered"
            continue
        reason = refusal_reason(_BACKENDS[name], platform_kind, req, arch)
        if reason is None:
            return Selection(_BACKENDS[name], f"first usable in the {platform_kind} priority "
                                              f"list {list(PRIORITY[platform_kind])}", refused), \
                refused
        refused[name] = reason
    return None, refused


def draft_loop_features(num_speculative_tokens: int, need_graphs: bool) -> tuple[Feature, ...]:
    """What the draft loop asks of the head's backend: several tokens per request when k > 1
    (the first draft forward runs over the verified tokens), FULL capture when the loop is to
    be captured in a graph (k > 1 on a GPU without enforce_eager)."""
    features = []
    if num_speculative_tokens > 1:
        features.append(Feature.MULTI_TOKEN_DRAFTING)
        if need_graphs:
            features.append(Feature.FULL_GRAPH_CAPTURE)
    return tuple(features)


def select_draft_backend(platform_kind: str, target_backend: str, explicit: str | None = None,
                         req: ModelRequirements = ModelRequirements(),
                         num_speculative_tokens: int = 1, need_graphs: bool = False,
                         arch: str | None = None) -> Selection:
    """The EAGLE head's backend; ``req`` is the head's (block size, head_dim, dtype),
    ``need_graphs``: the draft loop is to be captured (a GPU, enforce_eager off).

    1. ``explicit`` (the ``draft_attention_backend`` argument), else
       ``ROCDRAFT_DRAFT_ATTENTION_BACKEND``: that backend or an error (an unknown name names
       where it came from and the registered names);
    2. else the target's backend when it declares what the draft loop needs
       (``draft_loop_features``), so one backend serves both;
    3. else the first backend of the platform's priority list that does (on ROCm:
       ROCM_AITER_FA captures UNIFORM_DECODE only, so a GPU draft loop gets TRITON_ATTN);
    4. else, when only FULL capture was missing, the target's backend again (the loop runs
       eagerly), else the first usable one.
    The Selection's reason says which rule chose it and why the others did not.
    """
    source = "draft_attention_backend"
    if not explicit:
        explicit, source = envs.draft_attention_backend(), DRAFT_ENV_VAR
    if explicit:
        if explicit not in _BACKENDS:
            raise RocdraftError(f"{source}={explicit!r} is not a registered attention backend; "
                                f"registered: {', '.join(registered_names())}")
        cls = _BACKENDS[explicit]
        # Missing features are the caller's to report (require() names who has them).
        reason = refusal_reason(cls, platform_kind, replace(req, features=()), arch)
        if reason:
            raise BackendUnavailableError(f"draft attention backend {explicit} ({source}) "
                                          f"cannot run here: {reason}")
        return Selection(cls, f"{source}={explicit}")
    target = get_backend(target_backend)
    features = req.features + draft_loop_features(num_speculative_tokens, need_graphs)
    req = replace(req, features=tuple(dict.fromkeys(features)))
    wanted = ", ".join(f.value for f in req.features) or "nothing more"
    target_reason = refusal_reason(target, platform_kind, req, arch)
    if target_reason is None:
        return Selection(target, f"the target's backend {target.name} declares what the draft "
                                 f"loop needs ({wanted})")
    selection, refused = _first_in_priority(platform_kind, req, arch)
    if selection is not None:
        return Selection(selection.backend, f"the target's backend {target.name} cannot run "
                                            f"the draft loop ({target_reason}); "
                                            f"{selection.backend.name} is the first in the "
                                            f"{platform_kind} priority list that declares "
                                            f"{wanted}", refused)
    without_graphs = replace(req, features=tuple(f for f in req.features
                                                 if f is not Feature.FULL_GRAPH_CAPTURE))
    if without_graphs != req:
        if refusal_reason(target, platform_kind, without_graphs, arch) is None:
            return Selection(target, f"no usable backend declares {wanted}; the target's "
                                     f"backend {target.name} runs the draft loop eagerly",
                             refused)
        selection, refused = _first_in_priority(platform_kind, without_graphs, arch)
        if selection is not None:
            return Selection(selection.backend, f"no usable backend declares {wanted}; "
                                                f"{selection.backend.name} runs the draft loop "
                                                f"eagerly", refused)
    details = "; ".join(f"{n}: {r}" for n, r in refused.items())
    raise BackendUnavailableError(f"no attention backend can run the draft loop here "
                                  f"({target.name}: {target_reason}; {details})")
