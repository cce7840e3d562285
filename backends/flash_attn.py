"""FLASH_ATTN: attention through the flash-attn package (FA2 on CUDA; CK / Triton on ROCm).

Two kernels, chosen on the host from ints the step already carries (no device read):

- ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=..., block_table=...,
  causal=True)`` reads the paged cache in place. Its q is ``[batch, seqlen_q, heads, dim]``:
  every request must have the same query length, so it runs uniform batches (decode, 1 + k
  verification with the same k, draft steps). Causal is bottom-right aligned, so query j of a
  request with seq_len s sits at position s - seqlen_q + j, as the metadata defines.
- ``flash_attn_varlen_func`` runs everything else (prefill chunks, mixed batches): each
  request's context is gathered from the paged cache into contiguous K/V first
  (``varlen_context.py``), which works on every flash-attn build, paged-varlen or not.

The paged path needs page sizes the build supports: FA2 on CUDA checks "Paged KV cache block
size must be divisible by 256" (csrc/flash_attn/flash_api.cpp), the ROCm CK build "divisible by
128" (csrc/flash_attn_ck/mha_fwd_kvcache.cpp), so the backend declares block_size_multiple=256
on every platform (a static declaration the registry can check). No fp8 KV cache, no custom
masks (chain drafting only). K/V are written with the project's reference write.

Facts are from flash-attn 2.8.3.post2 (the sdist on the package index).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from rocdraft.backends.base import (AttentionBackend, AttentionImpl, BackendCapabilities,
                                    Feature, GraphCapture)
from rocdraft.backends.kv_cache import NHD, LayerKVCache, write_kv_reference
from rocdraft.backends.metadata import CommonAttentionMetadata
from rocdraft.backends.registry import register_backend, require
from rocdraft.backends.varlen_context import (VarlenContext, VarlenContextBuilder,
                                              build_varlen_context, gather_kv)
from rocdraft.errors import RocdraftError

NAME = "FLASH_ATTN"
HALF_DTYPES = (torch.float16, torch.bfloat16)
PAGE_BLOCK_MULTIPLE = 256  # flash_api.cpp: "Paged KV cache block size must be divisible by 256"
# flash_api.cpp / flash_attn_ck/mha_fwd.cpp: "... only supports head dimension at most 256".
MAX_HEAD_DIM = 256

# Kernel paths (strings so that tests and logs can name them).
PAGED = "flash_attn_with_kvcache"
VARLEN_GATHERED = "flash_attn_varlen_func(gathered)"


def _gpu_present() -> bool:
    return torch.cuda.is_available()


def _import_flash_attn():
    import flash_attn  # lazy: a CUDA/ROCm extension, absent on CPU machines
    return flash_attn


@dataclass(frozen=True)
class FlashAttnMetadata:
    common: CommonAttentionMetadata
    varlen: VarlenContext
    uniform_query_len: int | None  # the query length of every request, None when they differ


class FlashAttnBuilder(VarlenContextBuilder):
    def make(self, common: CommonAttentionMetadata, num_kv_rows: int) -> FlashAttnMetadata:
        return _build(common, num_kv_rows)


def _build(common: CommonAttentionMetadata, num_kv_rows: int) -> FlashAttnMetadata:
    if common.spec_mask is not None:
        require(NAME, Feature.TREE_DRAFTING, why="the metadata carries a spec_mask")
    return FlashAttnMetadata(common, build_varlen_context(common, num_kv_rows),
                             uniform_query_len(common))


def uniform_query_len(common: CommonAttentionMetadata) -> int | None:
    """The common query length when all requests share it, from host ints only:
    max_query_len bounds every length, so num_actual_tokens == num_reqs * max_query_len
    means each request has exactly max_query_len tokens."""
    q_len = common.max_query_len
    if common.num_reqs and q_len >= 1 and common.num_actual_tokens == common.num_reqs * q_len:
        return q_len
    return None


class FlashAttnImpl(AttentionImpl):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: LayerKVCache, metadata: FlashAttnMetadata) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads,
        head_dim] -> [num_tokens, num_heads, head_dim]; rows of padding tokens are zero."""
        _check_inputs(query, kv_cache)
        flash_attn = _import_flash_attn()
        write_kv_reference(key, value, kv_cache, metadata.common.slot_mapping)
        if metadata.uniform_query_len is not None:
            return self._paged(flash_attn, query, kv_cache, metadata)
        return self._varlen(flash_attn, query, kv_cache, metadata)

    def _paged(self, flash_attn, query, cache: LayerKVCache,
               metadata: FlashAttnMetadata) -> torch.Tensor:
        common, q_len = metadata.common, metadata.uniform_query_len
        num_reqs = common.num_reqs
        num_actual = num_reqs * q_len
        q = query[:num_actual].reshape(num_reqs, q_len, self.num_heads, self.head_dim)
        out = flash_attn.flash_attn_with_kvcache(  # [num_reqs, q_len, num_heads, head_dim]
            q, cache.key, cache.value, cache_seqlens=common.seq_lens,
            block_table=common.block_table[:num_reqs], softmax_scale=self.scale,
            causal=common.causal)
        result = torch.zeros_like(query)  # padding rows past num_actual stay 0
        result[:num_actual] = out.reshape(num_actual, self.num_heads, self.head_dim)
        return result

    def _varlen(self, flash_attn, query, cache: LayerKVCache,
                metadata: FlashAttnMetadata) -> torch.Tensor:
        ctx, common = metadata.varlen, metadata.common
        # [num_kv_rows, num_kv_heads, head_dim] each
        key, value = gather_kv(cache, common.block_table, ctx, query.dtype)
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = flash_attn.flash_attn_varlen_func(
            query, key, value, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.max_seqlen_q,
            ctx.max_seqlen_k, softmax_scale=self.scale, causal=common.causal)
        # Rows past query_start_loc[-1] (graph padding) are left unwritten by the kernel.
        return out.masked_fill(ctx.token_is_padding.view(-1, 1, 1), 0.0)


def _check_inputs(query: torch.Tensor, cache: LayerKVCache) -> None:
    if query.dtype not in HALF_DTYPES:
        raise RocdraftError(f"{NAME} runs fp16/bf16 only, got query dtype {query.dtype}; "
                            f"use TORCH_SDPA for {query.dtype}")
    if cache.key.dtype != query.dtype:
        raise RocdraftError(f"{NAME} needs the KV cache in the query dtype {query.dtype} "
                            f"(no fp8 caches), got {cache.key.dtype}")
    if query.shape[-1] > MAX_HEAD_DIM:
        raise RocdraftError(f"{NAME} head_dim {query.shape[-1]} is above flash-attn's limit of "
                            f"{MAX_HEAD_DIM}; use TRITON_ATTN or TORCH_SDPA")
    if cache.layout != NHD:
        raise RocdraftError(f"{NAME} KV layout {cache.layout!r} is not supported; valid: {NHD!r}")
    if cache.block_size % PAGE_BLOCK_MULTIPLE:
        raise RocdraftError(f"{NAME} block_size {cache.block_size} is not a multiple of "
                            f"{PAGE_BLOCK_MULTIPLE}")


@register_backend
class FlashAttnBackend(AttentionBackend):
    name = NAME
    metadata_cls = FlashAttnMetadata
    builder_cls = FlashAttnBuilder
    impl_cls = FlashAttnImpl
    capabilities = BackendCapabilities(
        # Only because differing query lengths go through flash_attn_varlen_func and uniform
        # multi-token queries through flash_attn_with_kvcache (seqlen_q >= 1, bottom-right).
        multi_token_drafting=True,
        tree_drafting=False,  # flash-attn takes no custom (query-query) mask
        # Uniform batches run flash_attn_with_kvcache, which reads seq lens and block tables on
        # the device. Mixed batches size the context gather from the step's seq_lens and pick
        # their kernel from host ints, so they are not captured: no FULL.
        graph_capture=GraphCapture.UNIFORM_DECODE,
        kv_layouts=(NHD,),
        block_size_multiple=PAGE_BLOCK_MULTIPLE,  # CUDA 256 / ROCm CK 128: 256 fits both
        # flash_api.cpp: "FlashAttention only support fp16 and bf16 data type".
        dtypes=HALF_DTYPES,
        # flash_api.cpp: head_dim <= 256; other sizes than multiples of 8 are padded by copying
        # q AND the whole paged cache per call (flash_attn_with_kvcache), so only multiples of
        # 8 are declared.
        head_sizes=None, head_size_multiple=8, max_head_size=MAX_HEAD_DIM,
        platforms=("rocm", "cuda"),
        kv_cache_dtypes=())  # flash-attn 2 reads fp16/bf16 caches only

    @classmethod
    def availability(cls) -> str | None:
        if not _gpu_present():
            return "needs a GPU (torch.cuda.is_available() is False)"
        try:
            found = importlib.util.find_spec("flash_attn") is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return "the flash_attn package is not installed (pip install flash-attn)"
        try:
            _import_flash_attn()
        except Exception as exc:  # noqa: BLE001 (any failure means: cannot run here)
            return f"import flash_attn failed: {type(exc).__name__}: {exc}"
        return None
