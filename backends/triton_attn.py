"""TRITON_ATTN: portable attention backend built on rocdraft's own Triton kernels.

``forward`` writes the new K/V with the Triton paged KV write, then runs the unified paged
attention kernel over the NHD cache: any mix of prefill chunks, decodes and multi-token
queries in one launch, GQA, fp8 caches, and the ``spec_mask`` of tree drafting (shared or
per request; the row rule of backends/metadata.py). The launch is sized from host ints of
the metadata only (no device reads), so a whole step or the multi-step draft loop can be
captured in one CUDA/HIP graph.

Runs wherever Triton does: ROCm and CUDA GPUs, and the CPU under ``TRITON_INTERPRET=1``
(slow; for tests). The kernel modules import triton and decorate the kernels, which fixes
interpreter mode, so they are imported on first use, never by ``import rocdraft.backends``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from rocdraft.backends.base import (AttentionBackend, AttentionImpl, BackendCapabilities,
                                    GraphCapture, MetadataBuilder)
from rocdraft.backends.kv_cache import NHD, LayerKVCache
from rocdraft.backends.kv_write import write_kv
from rocdraft.backends.metadata import CommonAttentionMetadata
from rocdraft.backends.registry import register_backend

CPU_REASON = "on the CPU TRITON_ATTN needs TRITON_INTERPRET=1 (the Triton interpreter)"
# Both kernels pad head_dim to a power of two (tl.arange needs one; attention pads to >= 16
# for tl.dot) and mask the padding, so no head size is special below the largest tile. The
# rule declared is the one compiled and tested: multiples of 16 (rows of 32 bytes in 16-bit
# dtypes) up to 256 (BLOCK_D 256, the largest tile the compile check builds).
HEAD_SIZE_MULTIPLE = 16
MAX_HEAD_SIZE = 256
# fp8 caches per target. Triton's NVIDIA backend has no fp8e4b8 (e4m3fnuz) and fp8e4nv
# (e4m3fn) only from sm_89; its AMD backend converts every fp8 type on every arch (natively:
# fnuz on gfx942, OCP on gfx950; in software on gfx90a, which has no fp8 of its own). Declared:
# the format torch uses on each arch; on the CPU (interpreter) both.
FP8_FORMATS = (("gfx942", torch.float8_e4m3fnuz), ("gfx90a", torch.float8_e4m3fnuz),
               ("gfx950", torch.float8_e4m3fn), ("sm_89+", torch.float8_e4m3fn),
               ("cpu", torch.float8_e4m3fn), ("cpu", torch.float8_e4m3fnuz))


@dataclass(frozen=True)
class TritonAttnMetadata:
    """The step's common metadata; the kernel finds each program's request on the device
    from ``query_start_loc``, so nothing else needs precomputing."""

    common: CommonAttentionMetadata


class TritonAttnBuilder(MetadataBuilder):
    """``build`` / ``build_for_drafting`` / ``build_for_graph_capture`` only wrap the common
    metadata: no device reads, no allocations, safe inside a graph."""

    def build(self, common: CommonAttentionMetadata) -> TritonAttnMetadata:
        return TritonAttnMetadata(common)

    def build_for_drafting(self, common: CommonAttentionMetadata,
                           draft_index: int) -> TritonAttnMetadata:
        return TritonAttnMetadata(common)

    def build_for_graph_capture(self, common: CommonAttentionMetadata) -> TritonAttnMetadata:
        return TritonAttnMetadata(common)


class TritonAttnImpl(AttentionImpl):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: LayerKVCache, metadata: TritonAttnMetadata) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads,
        head_dim] -> [num_tokens, num_heads, head_dim] in the query dtype."""
        from rocdraft.backends.triton_kernels.unified_attention import unified_attention

        if kv_cache.layout != NHD:
            raise ValueError(f"TRITON_ATTN reads the NHD KV layout, got {kv_cache.layout!r}")
        if query.shape[1] != self.num_heads or query.shape[2] != self.head_dim:
            raise ValueError(f"query shape {list(query.shape)} does not match num_heads "
                             f"{self.num_heads}, head_dim {self.head_dim}")
        common = metadata.common
        write_kv(key, value, kv_cache, common.slot_mapping)  # HIP when built, else Triton
        return unified_attention(query, kv_cache, common, self.scale)

    def forward_rotating(self, qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                         kv_cache: LayerKVCache, metadata: TritonAttnMetadata) -> torch.Tensor:
        """qkv [num_tokens, Hq + 2 * Hk, head_dim] un-rotated -> [num_tokens, Hq, head_dim]:
        RoPE on q and k fused with the NHD KV write (one Triton kernel), then attention."""
        from rocdraft.backends.triton_kernels.rope_kv_write import rope_kv_write_triton
        from rocdraft.backends.triton_kernels.unified_attention import unified_attention

        common = metadata.common
        query = rope_kv_write_triton(qkv, cos, sin_signed, self.num_heads, kv_cache,
                                     common.slot_mapping)
        return unified_attention(query, kv_cache, common, self.scale)


def _triton_problem() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton cannot be imported ({exc})"
    return None


@register_backend
class TritonAttnBackend(AttentionBackend):
    name = "TRITON_ATTN"
    metadata_cls = TritonAttnMetadata
    builder_cls = TritonAttnBuilder
    impl_cls = TritonAttnImpl
    capabilities = BackendCapabilities(
        multi_token_drafting=True, tree_drafting=True, graph_capture=GraphCapture.FULL,
        kv_layouts=(NHD,), block_size_multiple=1,
        dtypes=(torch.float32, torch.float16, torch.bfloat16), head_sizes=None,
        head_size_multiple=HEAD_SIZE_MULTIPLE, max_head_size=MAX_HEAD_SIZE,
        platforms=("rocm", "cuda", "cpu"), kv_cache_formats=FP8_FORMATS)

    @classmethod
    def availability(cls) -> str | None:
        problem = _triton_problem()
        if problem:
            return problem
        if torch.cuda.is_available():
            return None
        return None if os.environ.get("TRITON_INTERPRET") == "1" else CPU_REASON
