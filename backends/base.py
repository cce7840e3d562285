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


@dataclass(frozen=True)
class BackendCapabilities:
    multi_token_drafting: bool  # query lengths > 1 per request (verify 1 + k, draft steps)
    tree_drafting: bool  # honours CommonAttentionMetadata.spec_mask
    graph_capture: GraphCapture
    kv_layouts: tuple[str, ...]
    block_size_multiple: int  # supported block sizes are positive multiples of this
    dtypes: tuple[torch.dtype, ...]
    head_sizes: tuple[int, ...] | None  # None: any head size
    platforms: tuple[str, ...]  # subset of ("rocm", "cuda", "cpu")
    kv_cache_dtypes: tuple[torch.dtype, ...] = field(default_factory=tuple)  # fp8 caches

    def has(self, feature: Feature) -> bool:
        if feature is Feature.MULTI_TOKEN_DRAFTING:
            return self.multi_token_drafting
        if feature is Feature.TREE_DRAFTING:
            return self.tree_drafting
        if feature is Feature.FULL_GRAPH_CAPTURE:
            return self.graph_capture is GraphCapture.FULL
        if feature is Feature.FP8_KV_CACHE:
            return bool(self.kv_cache_dtypes)
        raise ValueError(f"unknown feature {feature!r}; valid: {[f.value for f in Feature]}")

    def config_problem(self, block_size: int | None = None, head_dim: int | None = None,
                       dtype: torch.dtype | None = None,
                       kv_cache_dtype: torch.dtype | None = None) -> str | None:
        """Why this backend cannot run a model with this configuration, or None.
        Fields left as None are not checked."""
        if block_size is not None and (block_size <= 0 or block_size % self.block_size_multiple):
            return f"block_size {block_size} is not a multiple of {self.block_size_multiple}"
        if head_dim is not None and self.head_sizes is not None \
                and head_dim not in self.head_sizes:
            return f"head_dim {head_dim} is not one of {list(self.head_sizes)}"
        if dtype is not None and dtype not in self.dtypes:
            return f"dtype {dtype} is not one of {[str(d) for d in self.dtypes]}"
        if kv_cache_dtype is not None and kv_cache_dtype != dtype \
                and kv_cache_dtype not in self.kv_cache_dtypes:
            return f"kv cache dtype {kv_cache_dtype} is not supported"
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
