"""ROCM_AITER_FA: attention through AMD's aiter kernels (MI300 / gfx942 first).

Which kernel runs is decided on the host from ints the step already carries (never from a
device read), per layer from the cache's shape:

- ``paged_attention_v1`` (aiter's HIP paged decode kernel): only when EVERY request has exactly
  one query token (``max_query_len == 1`` and ``num_actual_tokens == num_reqs``), NHD layout,
  block size 16 or 32. The kernel assumes one query per sequence (``mtp=1``); vLLM's AITER-FA
  backend once sent 1 + k verify tokens to such a kernel and EAGLE-3 accuracy collapsed, so
  multi-token queries never come here (tests/test_aiter_fa.py checks it).
- ``pa_fwd_asm`` (prebuilt asm decode): the same one-token rule, for the split-K layout
  (``ROCDRAFT_AITER_ASM_LAYOUT=1``) with block size 16, head_dim 128, bf16, non-fp8 cache.
- ``flash_attn_varlen_func`` for everything else (prefill chunks, 1 + k verification, draft
  steps with several tokens, mixed batches): causal bottom-right, GQA, int32 cu_seqlens.
  With an NHD cache whose block size is a multiple of 128 it reads the pages directly through
  ``block_table``; otherwise each request's context is first gathered into contiguous K/V
  (``varlen_context.py``; fp8 is dequantised there).

KV writes: ``aiter.reshape_and_cache_flash`` (NHD) or ``aiter.reshape_and_cache(...,
asm_layout=True)`` (split-K); per-head fp8 scales use the project's reference write.
``import aiter`` only happens inside this module's functions: it raises without ROCm.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch

from rocdraft import envs
from rocdraft.backends.base import (AttentionBackend, AttentionImpl, BackendCapabilities,
                                    Feature, GraphCapture, MetadataBuilder)
from rocdraft.backends.kv_cache import NHD, SPLIT_K, LayerKVCache, write_kv_reference
from rocdraft.backends.metadata import CommonAttentionMetadata
from rocdraft.backends.registry import register_backend, require
from rocdraft.backends.varlen_context import (VarlenContext, bounded_kv_rows,
                                              build_varlen_context, exact_kv_rows, gather_kv)
from rocdraft.errors import RocdraftError

NAME = "ROCM_AITER_FA"
HALF_DTYPES = (torch.float16, torch.bfloat16)
FP8_CACHE_DTYPE = torch.float8_e4m3fnuz  # MI300's fp8
PARTITION_SIZE = 256  # paged_attention_v1's partition_size (its default)
DECODE_BLOCK_SIZES = (16, 32)  # block sizes aiter's own paged_attention_v1 tests cover
PAGED_VARLEN_BLOCK_MULTIPLE = 128  # flash_attn_varlen_func(block_table=...) page size rule
ASM_BLOCK_SIZE, ASM_HEAD_DIM = 16, 128  # pa_fwd_asm: block 16; "only supports head_size 128"

# Kernel paths (strings so that tests and logs can name them).
DECODE_V1 = "paged_attention_v1"
DECODE_ASM = "pa_fwd_asm"
VARLEN_PAGED = "flash_attn_varlen_func(block_table)"
VARLEN_GATHERED = "flash_attn_varlen_func(gathered)"


def _on_rocm() -> bool:
    return bool(getattr(torch.version, "hip", None))


def _import_aiter():
    import aiter  # lazy: importing aiter raises on machines without ROCm
    return aiter


@dataclass(frozen=True)
class AiterFAMetadata:
    common: CommonAttentionMetadata
    varlen: VarlenContext
    single_token_queries: bool  # every request has exactly one query token


class AiterFABuilder(MetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> AiterFAMetadata:
        return _build(common, exact_kv_rows(common))

    def build_for_drafting(self, common: CommonAttentionMetadata,
                           draft_index: int) -> AiterFAMetadata:
        # Host ints and the CPU copy of seq_lens only (upper bounds while drafting): no sync.
        return _build(common, exact_kv_rows(common))

    def build_for_graph_capture(self, common: CommonAttentionMetadata) -> AiterFAMetadata:
        # Size the context gather for the longest sequence the captured graph may replay.
        return _build(common, bounded_kv_rows(common))


def _build(common: CommonAttentionMetadata, num_kv_rows: int) -> AiterFAMetadata:
    if common.spec_mask is not None:
        require(NAME, Feature.TREE_DRAFTING, why="the metadata carries a spec_mask")
    # max_query_len bounds every query length, so num_actual_tokens == num_reqs with
    # max_query_len == 1 means each request has exactly one token (none has zero).
    single = common.max_query_len == 1 and common.num_actual_tokens == common.num_reqs
    return AiterFAMetadata(common, build_varlen_context(common, num_kv_rows), single)


def choose_path(single_token_queries: bool, layout: str, block_size: int, head_dim: int,
                dtype: torch.dtype, fp8_cache: bool, per_tensor_scales: bool,
                scale: float) -> str:
    """The kernel one layer runs. Decode kernels only ever see one-token queries."""
    if single_token_queries:
        if layout == NHD and block_size in DECODE_BLOCK_SIZES and per_tensor_scales:
            return DECODE_V1
        if (layout == SPLIT_K and block_size == ASM_BLOCK_SIZE and head_dim == ASM_HEAD_DIM
                and dtype == torch.bfloat16 and not fp8_cache
                and math.isclose(scale, head_dim ** -0.5, rel_tol=1e-6)):
            return DECODE_ASM  # the asm kernel applies 1/sqrt(head_dim) itself
    if layout == NHD and block_size % PAGED_VARLEN_BLOCK_MULTIPLE == 0 and not fp8_cache:
        return VARLEN_PAGED
    return VARLEN_GATHERED


class AiterFAImpl(AttentionImpl):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: LayerKVCache, metadata: AiterFAMetadata) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads,
        head_dim] -> [num_tokens, num_heads, head_dim]; rows of padding tokens are zero."""
        _check_inputs(query, kv_cache)
        aiter = _import_aiter()
        common = metadata.common
        write_kv(aiter, key, value, kv_cache, common.slot_mapping)
        path = choose_path(metadata.single_token_queries, kv_cache.layout, kv_cache.block_size,
                           self.head_dim, query.dtype, kv_cache.is_fp8,
                           _per_tensor_scales(kv_cache), self.scale)
        query = _dense_heads(query)
        if path == DECODE_V1:
            return self._decode_v1(aiter, query, kv_cache, common)
        if path == DECODE_ASM:
            return self._decode_asm(aiter, query, kv_cache, common)
        return self._varlen(aiter, query, kv_cache, metadata, paged=path == VARLEN_PAGED)

    def _decode_v1(self, aiter, query, cache: LayerKVCache, common) -> torch.Tensor:
        num_reqs = common.num_reqs
        out = torch.zeros_like(query)  # [num_tokens, num_heads, head_dim]; padding rows stay 0
        # Workspace of the split-softmax partitions: tmp_out [num_reqs, H, parts, D] in the
        # query dtype, then exp_sums and max_logits [num_reqs, H, parts] in float32.
        parts = math.ceil(max(common.max_seq_len, 1) / PARTITION_SIZE)
        partials = num_reqs * self.num_heads * parts
        workspace = torch.empty(partials * self.head_dim * query.element_size() + 2 * partials * 4,
                                dtype=torch.uint8, device=query.device)
        k_scale, v_scale = _scales(cache, query.device)
        aiter.paged_attention_v1(
            out[:num_reqs], workspace, query[:num_reqs], cache.key, cache.value, self.scale,
            common.block_table[:num_reqs], common.query_start_loc, common.seq_lens,
            common.max_seq_len,
            None, _kv_cache_dtype(cache), "NHD", 0.0, k_scale, v_scale, None, PARTITION_SIZE)
        return out

    def _decode_asm(self, aiter, query, cache: LayerKVCache, common) -> torch.Tensor:
        num_reqs = common.num_reqs
        out = torch.zeros_like(query)
        block_table = common.block_table[:num_reqs]
        out[:num_reqs] = aiter.pa_fwd_asm(query[:num_reqs], cache.key, cache.value, block_table,
                                          common.seq_lens, block_table.stride(0))
        return out

    def _varlen(self, aiter, query, cache: LayerKVCache, metadata: AiterFAMetadata,
                paged: bool) -> torch.Tensor:
        ctx, common = metadata.varlen, metadata.common
        extra = {}
        if paged:  # pages read in place: [num_blocks, block_size, num_kv_heads, head_dim]
            key, value = cache.key, cache.value
            extra["block_table"] = common.block_table[:common.num_reqs]
        else:  # [num_kv_rows, num_kv_heads, head_dim]
            key, value = gather_kv(cache, common.block_table, ctx, query.dtype)
        out = aiter.flash_attn_varlen_func(
            query, key, value, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.max_seqlen_q,
            ctx.max_seqlen_k, softmax_scale=self.scale, causal=common.causal, **extra)
        if isinstance(out, (tuple, list)):  # some aiter versions return (out, ...)
            out = out[0]
        # Rows past query_start_loc[-1] (graph padding) are left unwritten by the kernel.
        return out.masked_fill(ctx.token_is_padding.view(-1, 1, 1), 0.0)


def write_kv(aiter, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value [>= num_tokens, num_kv_heads, head_dim] at slot_mapping [num_tokens]
    (slots < 0 skipped) with aiter's cache kernels; ``aiter`` None -> the reference write."""
    if aiter is None or (cache.is_fp8 and not _per_tensor_scales(cache)):
        write_kv_reference(key, value, cache, slot_mapping)
        return
    num_tokens = slot_mapping.shape[0]  # key/value may carry graph-padding rows past it
    key, value = _dense_heads(key[:num_tokens]), _dense_heads(value[:num_tokens])
    k_scale, v_scale = _scales(cache, key.device)
    if cache.layout == SPLIT_K:
        aiter.reshape_and_cache(key, value, cache.key, cache.value, slot_mapping,
                                _kv_cache_dtype(cache), k_scale=k_scale, v_scale=v_scale,
                                asm_layout=True)
    else:
        aiter.reshape_and_cache_flash(key, value, cache.key, cache.value, slot_mapping,
                                      _kv_cache_dtype(cache), k_scale, v_scale)


def _check_inputs(query: torch.Tensor, cache: LayerKVCache) -> None:
    if query.dtype not in HALF_DTYPES:
        raise RocdraftError(f"{NAME} runs fp16/bf16 only, got query dtype {query.dtype}; "
                            f"use TORCH_SDPA for {query.dtype}")
    if cache.is_fp8 and cache.key.dtype != FP8_CACHE_DTYPE:
        raise RocdraftError(f"{NAME} fp8 KV caches must be {FP8_CACHE_DTYPE}, "
                            f"got {cache.key.dtype}")
    if not cache.is_fp8 and cache.key.dtype != query.dtype:
        raise RocdraftError(f"{NAME} needs the KV cache in the query dtype {query.dtype} "
                            f"(or {FP8_CACHE_DTYPE}), got {cache.key.dtype}")
    if cache.layout not in (NHD, SPLIT_K):
        raise RocdraftError(f"{NAME} KV layout {cache.layout!r} is not one of {[NHD, SPLIT_K]}")


def _dense_heads(x: torch.Tensor) -> torch.Tensor:
    """[rows, heads, head_dim] with heads and head_dim packed (rows may keep any stride, as a
    slice of a fused qkv does): the kernels take only a row stride."""
    if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        return x
    return x.contiguous()


def _per_tensor_scales(cache: LayerKVCache) -> bool:
    return all(s is None or s.numel() == 1 for s in (cache.k_scale, cache.v_scale))


def _scales(cache: LayerKVCache, device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [1] dequantisation scales; the kernels take them as tensors even without fp8."""
    one = torch.ones(1, dtype=torch.float32, device=device)
    return (one if cache.k_scale is None else cache.k_scale.float(),
            one if cache.v_scale is None else cache.v_scale.float())


def _kv_cache_dtype(cache: LayerKVCache) -> str:
    return "fp8" if cache.is_fp8 else "auto"


@register_backend
class AiterFABackend(AttentionBackend):
    name = NAME
    metadata_cls = AiterFAMetadata
    builder_cls = AiterFABuilder
    impl_cls = AiterFAImpl
    capabilities = BackendCapabilities(
        # Only because multi-token queries go through flash_attn_varlen_func, never a decode
        # kernel (see the module docstring).
        multi_token_drafting=True,
        tree_drafting=False,  # aiter's kernels take no custom (query-query) mask
        # One-token batches run paged_attention_v1 / pa_fwd_asm, which read lengths and block
        # tables on the device; their host inputs (max_context_len, workspace size) are bounded
        # by max_seq_len, which capture pins. Other batches pick their kernel from host ints and
        # size the context gather from the step's seq_lens, so they are not captured: no FULL.
        graph_capture=GraphCapture.UNIFORM_DECODE,
        kv_layouts=(NHD, SPLIT_K),
        block_size_multiple=16,  # 16/32 reach the decode kernel, others the varlen path
        dtypes=HALF_DTYPES,
        head_sizes=(64, 128, 256),
        platforms=("rocm",),
        kv_cache_dtypes=(FP8_CACHE_DTYPE,))

    @classmethod
    def availability(cls) -> str | None:
        if not _on_rocm():
            return "needs a ROCm build of torch (torch.version.hip is not set)"
        try:
            found = importlib.util.find_spec("aiter") is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return "the aiter package is not installed (pip install amd-aiter)"
        try:
            _import_aiter()
        except Exception as exc:  # noqa: BLE001 (any failure means: cannot run here)
            return f"import aiter failed: {type(exc).__name__}: {exc}"
        return None

    @staticmethod
    def kv_cache_layout() -> str:
        """The layout to allocate caches in: split-K (for pa_fwd_asm) when
        ROCDRAFT_AITER_ASM_LAYOUT=1, else NHD."""
        return SPLIT_K if envs.aiter_asm_layout() else NHD
