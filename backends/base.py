"""The contract every attention backend implements.

A backend is a class decorated with ``@register_backend`` (see ``registry.py``) that names:

- ``metadata_cls``: the per-step metadata its attention reads (built once per step);
- ``builder_cls``: turns ``CommonAttentionMetadata`` into ``metadata_cls`` with
  ``build(common)``, ``build_for_drafting(common, draft_index)`` (never syncs the host, safe
  inside a graph) and ``build_for_graph_capture(common)``;
- ``impl_cls``: per-layer attention, ``forward(query, key, value, kv_cache, metadata)``,
  which writes the new K/V into the paged cache and attends over cache + new tokens;
- ``capabilities``: what it can do (``BackendCapabilities``);
- ``availability()``: None when it can run here, else the reason it cannot.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from rocdraft.backends.kv_cache import LayerKVCache
from rocdraft.backends.metadata import CommonAttentionMetadata


class GraphCapture(enum.IntEnum):
    """How much of a step a backend lets a CUDA/HIP graph capture."""

    NONE = 0
    UNIFORM_DECODE = 1  # batches where every request has the same query length
    FULL = 2  # any batch, including the whole multi-step draft loop


class Feature(str, enum.Enum):
    """Capabilities a caller can ask the registry about."""

    MULTI_TOKEN_DRAFTING = "multi_token_drafting"
    TREE_DRAFTING = "tree_drafting"
    FULL_GRAPH_CAPTURE = "full_graph_capture"
    FP8_KV_CACHE = "fp8_kv_cache"


PLATFORM_KINDS = ("rocm", "cuda", "cpu")


def target_matches(target: str, platform_kind: str, arch: str | None) -> bool:
    """Whether a declared ``target`` covers this platform and arch.

    A target is a platform kind (``"cpu"``, ``"cuda"``, ``"rocm"``: every arch of it), one ROCm
    arch (``"gfx942"``), one CUDA arch (``"sm_90"``) or a CUDA arch and every newer one
    (``"sm_89+"``). An unknown arch (None) matches only platform-kind targets.

    Example: ``"sm_89+"`` matches ("cuda", "sm_90") and ("cuda", "sm_100"), not ("cuda",
    "sm_80"); ``"gfx942"`` matches ("rocm", "gfx942") only.
    """
    if target in PLATFORM_KINDS:
        return platform_kind == target
    if target.startswith("gfx"):
        return platform_kind == "rocm" and arch == target
    if platform_kind != "cuda" or arch is None:
        return False
    if target.endswith("+"):
        have, need = _sm_number(arch), _sm_number(target[:-1])
        return have is not None and need is not None and have >= need
    return arch == target


def _sm_number(arch: str) -> int | None:
    """``"sm_90"`` -> 90, ``"sm_100"`` -> 100; None when ``arch`` is not an sm_ arch."""
    digits = arch[3:] if arch.startswith("sm_") else ""
    return int(digits) if digits.isdigit() else None


def _valid_target(target: str) -> bool:
    if target in PLATFORM_KINDS:
        return True
    if target.startswith("gfx"):
        return len(target) > 3 and target[3:].isalnum()
    return _sm_number(target[:-1] if target.endswith("+") else target) is not None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class BackendCapabilities:
    multi_token_drafting: bool  # query lengths > 1 per request (verify 1 + k, draft steps)
    tree_drafting: bool  # honours CommonAttentionMetadata.spec_mask
    graph_capture: GraphCapture
    kv_layouts: tuple[str, ...]
    block_size_multiple: int  # supported block sizes are positive multiples of this
    dtypes: tuple[torch.dtype, ...]
    head_sizes: tuple[int, ...] | None  # an explicit list (vendor kernels); None: by the rule
    platforms: tuple[str, ...]  # subset of ("rocm", "cuda", "cpu")
    # fp8 caches valid on every platform of ``platforms`` (see kv_cache_formats for per-arch).
    kv_cache_dtypes: tuple[torch.dtype, ...] = field(default_factory=tuple)
    # (target, fp8 dtype) pairs: the cache formats valid on one platform or arch only, e.g.
    # ("gfx942", torch.float8_e4m3fnuz), ("sm_89+", torch.float8_e4m3fn); targets as in
    # ``target_matches``.
    kv_cache_formats: tuple[tuple[str, torch.dtype], ...] = field(default_factory=tuple)
    # Head-size rule for kernels that pad head_dim (None: unconstrained): every positive
    # multiple of head_size_multiple up to max_head_size. Checked after ``head_sizes``.
    head_size_multiple: int | None = None
    max_head_size: int | None = None
    # Each forward gathers every request's K/V up to the metadata's max_seq_len into float32
    # work buffers ([batch, max_seq_len, num_kv_heads, head_dim] per layer): a captured
    # graph holds them at its host bound, so graph runners cap that bound by memory.
    gathers_kv: bool = False

    def __post_init__(self) -> None:
        bad = [t for t, _ in self.kv_cache_formats if not _valid_target(t)]
        if bad:
            raise ValueError(f"unknown kv_cache_formats targets {bad}; valid: a platform "
                             f"{list(PLATFORM_KINDS)}, a gfx arch, sm_NN or sm_NN+")
        for name in ("head_size_multiple", "max_head_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")

    def has(self, feature: Feature) -> bool:
        if feature is Feature.MULTI_TOKEN_DRAFTING:
            return self.multi_token_drafting
        if feature is Feature.TREE_DRAFTING:
            return self.tree_drafting
        if feature is Feature.FULL_GRAPH_CAPTURE:
            return self.graph_capture is GraphCapture.FULL
        if feature is Feature.FP8_KV_CACHE:
            return bool(self.kv_cache_dtypes or self.kv_cache_formats)
        raise ValueError(f"unknown feature {feature!r}; valid: {[f.value for f in Feature]}")

    def kv_cache_dtypes_for(self, platform_kind: str | None, arch: str | None = None
                            ) -> tuple[torch.dtype, ...]:
        """The fp8 cache dtypes declared for this platform and arch; ``platform_kind`` None:
        every dtype declared anywhere."""
        found = list(self.kv_cache_dtypes) if platform_kind is None \
            or platform_kind in self.platforms else []
        for target, dtype in self.kv_cache_formats:
            if platform_kind is None or target_matches(target, platform_kind, arch):
                found.append(dtype)
        return tuple(dict.fromkeys(found))

    def kv_cache_formats_text(self) -> list[str]:
        """Every declared fp8 format as ``target: dtype`` (kv_cache_dtypes under the
        backend's platforms, e.g. ``rocm: float8_e4m3fnuz``)."""
        every = "/".join(self.platforms)
        return [f"{every}: {_dtype_name(d)}" for d in self.kv_cache_dtypes] + \
            [f"{t}: {_dtype_name(d)}" for t, d in self.kv_cache_formats]

    def head_size_rule(self) -> str:
        """The declared head sizes in words: ``one of [64, 128]``, ``a multiple of 16 up to
        256`` or ``any``."""
        parts = []
        if self.head_sizes is not None:
            parts.append(f"one of {list(self.head_sizes)}")
        if self.head_size_multiple is not None:
            parts.append(f"a multiple of {self.head_size_multiple}")
        if self.max_head_size is not None:
            parts.append(f"up to {self.max_head_size}")
        return " ".join(parts) or "any"

    def head_size_problem(self, head_dim: int) -> str | None:
        if self.head_sizes is not None and head_dim not in self.head_sizes:
            return f"head_dim {head_dim} is not one of {list(self.head_sizes)}"
        multiple, largest = self.head_size_multiple, self.max_head_size
        if head_dim <= 0 or (multiple is not None and head_dim % multiple) \
                or (largest is not None and head_dim > largest):
            return f"head_dim {head_dim} is not {self.head_size_rule()}"
        return None

    def config_problem(self, block_size: int | None = None, head_dim: int | None = None,
                       dtype: torch.dtype | None = None,
                       kv_cache_dtype: torch.dtype | None = None,
                       platform_kind: str | None = None, arch: str | None = None
                       ) -> str | None:
        """Why this backend cannot run a model with this configuration, or None.
        Fields left as None are not checked; fp8 cache dtypes are checked against the formats
        declared for ``platform_kind`` / ``arch`` (None: against every declared format)."""
        if block_size is not None and (block_size <= 0 or block_size % self.block_size_multiple):
            return f"block_size {block_size} is not a multiple of {self.block_size_multiple}"
        if head_dim is not None:
            problem = self.head_size_problem(head_dim)
            if problem:
                return problem
        if dtype is not None and dtype not in self.dtypes:
            return f"dtype {dtype} is not one of {[str(d) for d in self.dtypes]}"
        if kv_cache_dtype is not None and kv_cache_dtype != dtype \
                and kv_cache_dtype not in self.kv_cache_dtypes_for(platform_kind, arch):
            where = "" if platform_kind is None else \
                f" on {platform_kind}" + (f" {arch}" if arch else " (arch unknown)")
            declared = ", ".join(self.kv_cache_formats_text()) or "none"
            return (f"kv cache dtype {_dtype_name(kv_cache_dtype)} is not supported{where}; "
                    f"declared fp8 formats: {declared}")
        return None


class MetadataBuilder:
    """Default builder: the backend's metadata is the common metadata itself."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = device

    def build(self, common: CommonAttentionMetadata):
        return common

    def build_for_drafting(self, common: CommonAttentionMetadata, draft_index: int):
        # Draft steps reuse everything already on the device: no host reads.
        return self.build(common)

    def build_for_graph_capture(self, common: CommonAttentionMetadata):
        return self.build(common)


class AttentionImpl:
    """Per-layer attention. Subclasses implement ``forward``."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of "
                             f"num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: LayerKVCache, metadata) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads,
        head_dim] -> [num_tokens, num_heads, head_dim]. Writes key/value at
        metadata.slot_mapping first."""
        raise NotImplementedError

    def forward_rotating(self, qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                         kv_cache: LayerKVCache, metadata) -> torch.Tensor | None:
        """qkv [num_tokens, num_heads + 2 * num_kv_heads, head_dim], not yet rotated, and the
        step's RoPE rows cos / sin_signed [num_tokens, 1, head_dim] -> the attention output
        [num_tokens, num_heads, head_dim], RoPE applied to q and k inside the KV write (one
        fused kernel); or None where this backend has no such path (the caller rotates and
        calls ``forward``). Only GPU forwards of the target ask (models/fused_layers.py)."""
        return None


class AttentionBackend:
    """Base of every registered backend (class attributes filled by each subclass)."""

    name: str = ""
    metadata_cls: type = CommonAttentionMetadata
    builder_cls: type = MetadataBuilder
    impl_cls: type = AttentionImpl
    capabilities: BackendCapabilities

    @classmethod
    def availability(cls) -> str | None:
        return None
