"""ROCM_AITER_FA: attention through AMD's aiter kernels (MI300 / gfx942 first).

Which kernel runs is decided on the host from ints the step already carries (never from a
device read), per layer from the cache's shape:

- ``paged_attention_v1`` (aiter's HIP paged decode kernel): only when EVERY request has exactly
  one query token (``max_query_len == 1`` and ``num_actual_tokens == num_reqs``), NHD layout,
  and a shape the kernel compiles correctly (``V1_BLOCK_SIZES``, ``V1_HEAD_SIZES``,
  ``v1_supports_gqa``). The kernel assumes one query per sequence (``mtp=1``); vLLM's AITER-FA
  backend once sent 1 + k verify tokens to such a kernel and EAGLE-3 accuracy collapsed, so
  multi-token queries never come here (tests/test_aiter_fa.py checks it).
- ``pa_fwd_asm`` (prebuilt asm decode): the same one-token rule, for the split-K layout
  (``ROCDRAFT_AITER_ASM_LAYOUT=1``) with head_dim 128, a non-fp8 cache and a (dtype, GQA
  ratio, block size) that aiter ships a kernel for (``PA_ASM_KERNELS``, from pa_asm.csv).
- ``flash_attn_varlen_func`` for everything else (prefill chunks, 1 + k verification, draft
  steps with several tokens, mixed batches): causal bottom-right, GQA, int32 cu_seqlens. Each
  request's context is first gathered from the pages into contiguous K/V
  (``varlen_context.py``; fp8 is dequantised there). Never with ``block_table``: in aiter
  0.1.7 bf16 with head_dim 128 goes to ``fmha_v3_varlen_fwd``, which ignores the table
  (``FMHA_V3_IGNORES_BLOCK_TABLE``: wrong attention or a memory fault), and every other call
  goes to the CK ``mha_varlen_fwd``, whose build-name function raises with a table
  (``CK_PAGED_VARLEN_RAISES``).

``choose_path`` makes the choice from host values and says why (``PathChoice.reason``, logged
at DEBUG on every call of ``forward``).

Facts are from amd-aiter 0.1.7.post2.dev18 (the wheel on the package index); files are named
where each one is used.

KV writes: ``aiter.reshape_and_cache_flash`` (NHD) or ``aiter.reshape_and_cache(...,
asm_layout=True)`` (split-K); per-head fp8 scales use the project's reference write.
``import aiter`` only happens inside this module's functions: it raises without ROCm.
"""
from __future__ import annotations

import importlib.util
import logging
import math
from dataclasses import dataclass

import torch

from rocdraft import envs
from rocdraft.backends.base import (AttentionBackend, AttentionImpl, BackendCapabilities,
                                    Feature, GraphCapture)
from rocdraft.backends.kv_cache import NHD, SPLIT_K, LayerKVCache, write_kv_reference
from rocdraft.backends.metadata import CommonAttentionMetadata
from rocdraft.backends.registry import register_backend, require
from rocdraft.backends.varlen_context import (VarlenContext, VarlenContextBuilder,
                                              build_varlen_context, gather_kv)
from rocdraft.errors import RocdraftError
from rocdraft.platform import detect_platform

log = logging.getLogger(__name__)

NAME = "ROCM_AITER_FA"
HALF_DTYPES = (torch.float16, torch.bfloat16)
# aiter/utility/dtypes.py: dtypes.fp8 is float8_e4m3fnuz on gfx942, float8_e4m3fn on gfx950;
# the cache kernels are built for that type only. Unknown archs (and the CPU) take gfx942's.
FP8_BY_ARCH = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
FP8_CACHE_DTYPE = FP8_BY_ARCH["gfx942"]  # MI300's fp8
PARTITION_SIZE = 256  # paged_attention_v1's partition_size (its default)
# csrc/cpp_itfs/pa/pa_kernels.cuh: static_assert(BLOCK_SIZE <= k_thread_per_block) (32) and
# "assumes minimum block size is 16".
V1_BLOCK_SIZES = (16, 32)
# pa_kernels.cuh: VHELOOP = HEAD_SIZE / 16 / NWARPS (NWARPS 4) drops dims unless HEAD_SIZE is a
# multiple of 64; QKHELOOP = HEAD_SIZE_PER_LOOP / QKHE_PER_FETCH (64 for an fp8 cache) with
# HEAD_SIZE_PER_LOOP = ceil(HEAD_SIZE / ceil(HEAD_SIZE / 128)) excludes 192 for fp8.
V1_HEAD_SIZES = (64, 128, 256)
ASM_HEAD_DIM = 128  # pa_fwd_asm's kernels are built for head_size 128
# hsa/gfx942/pa/pa_asm.csv (gfx950's has the same rows for these): the unquantised
# (kvType == qType), single-token (Mtp 0, Msk 0) kernels as (dtype, Gqa, blkSz).
PA_ASM_KERNELS = frozenset({(torch.bfloat16, 8, 16), (torch.bfloat16, 16, 16),
                            (torch.float16, 8, 16), (torch.float16, 16, 16)})
CK_MAX_HEAD_DIM = 256  # asm_mha_varlen_fwd.cu / CK: "CK only supports head dimension at most 256"

# Kernel paths (strings so that tests and logs can name them).
DECODE_V1 = "paged_attention_v1"
DECODE_ASM = "pa_fwd_asm"
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


class AiterFABuilder(VarlenContextBuilder):
    def make(self, common: CommonAttentionMetadata, num_kv_rows: int) -> AiterFAMetadata:
        return _build(common, num_kv_rows)


def _build(common: CommonAttentionMetadata, num_kv_rows: int) -> AiterFAMetadata:
    if common.spec_mask is not None:
        require(NAME, Feature.TREE_DRAFTING, why="the metadata carries a spec_mask")
    # max_query_len bounds every query length, so num_actual_tokens == num_reqs with
    # max_query_len == 1 means each request has exactly one token (none has zero).
    single = common.max_query_len == 1 and common.num_actual_tokens == common.num_reqs
    return AiterFAMetadata(common, build_varlen_context(common, num_kv_rows), single)


@dataclass(frozen=True)
class PathChoice:
    path: str  # one of DECODE_V1, DECODE_ASM, VARLEN_GATHERED
    reason: str  # why, in one line (logged)


def pa_asm_kernel_exists(dtype: torch.dtype, gqa_ratio: int, block_size: int) -> bool:
    """Whether ``pa_fwd_asm`` finds a kernel: ``get_heuristic_kernel`` (asm_pa.cu) tries the
    GQA ratio itself, then rounded up to a multiple of 8; else "cannot get heuristic kernel!"."""
    return any((dtype, gqa, block_size) in PA_ASM_KERNELS
               for gqa in (gqa_ratio, (gqa_ratio + 7) // 8 * 8))


def v1_supports_gqa(gqa_ratio: int) -> bool:
    """pa_kernels.cuh: GQA_RATIO_PER_LOOP = GQA_RATIO / ceil(GQA_RATIO / 16) must cover every
    query head (it silently drops the rest)."""
    return gqa_ratio % math.ceil(gqa_ratio / 16) == 0


def fmha_v3_ignores_block_table(dtype: torch.dtype, head_dim: int) -> bool:
    """``_flash_attn_varlen_forward`` (aiter/ops/mha.py) sends bf16 q with head_dim 128 (q and
    v; no alibi, bias, dropout or window, which rocdraft never passes) to
    ``fmha_v3_varlen_fwd``, whose argument builder (csrc/py_itfs_cu/asm_mha_varlen_fwd.cu)
    validates ``block_table`` but never passes it on: the kernel reads a paged cache as packed
    rows through ``cu_seqlens_k``. (gfx950 also sends head_dim 192 q with 128 v there; rocdraft
    has equal q/v head dims.)"""
    return dtype == torch.bfloat16 and head_dim == 128


FMHA_V3_IGNORES_BLOCK_TABLE = ("pages are gathered: aiter's fmha_v3_varlen_fwd (bf16, head_dim "
                               "128) ignores block_table")
# aiter/ops/mha.py cmdGenFunc_mha_varlen_fwd (run by compile_ops on every call) assigns
# filter_fwd only when block_table is None, then does ``filter_fwd += ...`` in the paged branch.
CK_PAGED_VARLEN_RAISES = ("pages are gathered: aiter's CK mha_varlen_fwd raises "
                          "UnboundLocalError (filter_fwd) with a block_table")


def choose_path(single_token_queries: bool, layout: str, block_size: int, head_dim: int,
                gqa_ratio: int, dtype: torch.dtype, fp8_cache: bool, per_tensor_scales: bool,
                scale: float) -> PathChoice:
    """The kernel one layer runs, and why (host values only). Decode kernels only ever see
    one-token queries."""
    declined = []
    if single_token_queries:
        if layout == NHD:
            v1_problem = _v1_problem(block_size, head_dim, gqa_ratio, per_tensor_scales)
            if v1_problem is None:
                return PathChoice(DECODE_V1, "one-token queries on an NHD cache")
            declined.append(f"{DECODE_V1}: {v1_problem}")
        else:
            asm_problem = _asm_problem(block_size, head_dim, gqa_ratio, dtype, fp8_cache, scale)
            if asm_problem is None:
                return PathChoice(DECODE_ASM, "one-token queries on a split-K cache")
            declined.append(f"{DECODE_ASM}: {asm_problem}; {DECODE_V1} cannot read the "
                            f"split-K layout")
    else:
        declined.append("multi-token queries never reach a decode kernel")
    declined.append(FMHA_V3_IGNORES_BLOCK_TABLE if fmha_v3_ignores_block_table(dtype, head_dim)
                    else CK_PAGED_VARLEN_RAISES)
    return PathChoice(VARLEN_GATHERED, "; ".join(declined))


def _v1_problem(block_size: int, head_dim: int, gqa_ratio: int,
                per_tensor_scales: bool) -> str | None:
    if block_size not in V1_BLOCK_SIZES:
        return f"block_size {block_size} is not one of {list(V1_BLOCK_SIZES)}"
    if head_dim not in V1_HEAD_SIZES:
        return f"head_dim {head_dim} is not one of {list(V1_HEAD_SIZES)}"
    if not v1_supports_gqa(gqa_ratio):
        return f"GQA ratio {gqa_ratio} is not a multiple of ceil(ratio / 16)"
    if not per_tensor_scales:
        return "per-head fp8 scales"
    return None


def _asm_problem(block_size: int, head_dim: int, gqa_ratio: int, dtype: torch.dtype,
                 fp8_cache: bool, scale: float) -> str | None:
    if fp8_cache:
        return "fp8 cache (per-token scales only)"
    if head_dim != ASM_HEAD_DIM:
        return f"head_dim {head_dim} is not {ASM_HEAD_DIM}"
    if not math.isclose(scale, head_dim ** -0.5, rel_tol=1e-6):
        return f"scale {scale} is not 1/sqrt(head_dim) (the kernel applies that itself)"
    if not pa_asm_kernel_exists(dtype, gqa_ratio, block_size):
        ratios = sorted(g for d, g, b in PA_ASM_KERNELS if d == dtype and b == block_size)
        return (f"pa_asm.csv has no {dtype} kernel for GQA ratio {gqa_ratio} with block_size "
                f"{block_size} (ratios {ratios}, rounded up to a multiple of 8)")
    return None


class AiterFAImpl(AttentionImpl):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: LayerKVCache, metadata: AiterFAMetadata) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads,
        head_dim] -> [num_tokens, num_heads, head_dim]; rows of padding tokens are zero."""
        _check_inputs(query, kv_cache)
        aiter = _import_aiter()
        common = metadata.common
        write_kv(aiter, key, value, kv_cache, common.slot_mapping)
        choice = choose_path(metadata.single_token_queries, kv_cache.layout,
                             kv_cache.block_size, self.head_dim,
                             self.num_heads // self.num_kv_heads, query.dtype, kv_cache.is_fp8,
                             _per_tensor_scales(kv_cache), self.scale)
        log.debug("%s runs %s: %s", NAME, choice.path, choice.reason)
        path = choice.path
        query = _dense_heads(query)
        if path == DECODE_V1:
            return self._decode_v1(aiter, query, kv_cache, common)
        if path == DECODE_ASM:
            return self._decode_asm(aiter, query, kv_cache, common)
        return self._varlen(aiter, query, kv_cache, metadata)

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
            None, _kv_cache_dtype(cache), "NHD", 0.0, k_scale, v_scale,
            fp8_out_scale=None, partition_size=PARTITION_SIZE)
        return out

    def _decode_asm(self, aiter, query, cache: LayerKVCache, common) -> torch.Tensor:
        num_reqs = common.num_reqs
        out = torch.zeros_like(query)
        block_table = common.block_table[:num_reqs]
        out[:num_reqs] = aiter.pa_fwd_asm(query[:num_reqs], cache.key, cache.value, block_table,
                                          common.seq_lens, block_table.stride(0))
        return out

    def _varlen(self, aiter, query, cache: LayerKVCache,
                metadata: AiterFAMetadata) -> torch.Tensor:
        ctx, common = metadata.varlen, metadata.common
        # [num_kv_rows, num_kv_heads, head_dim] each; never block_table (see the docstring).
        key, value = gather_kv(cache, common.block_table, ctx, query.dtype)
        out = aiter.flash_attn_varlen_func(
            query, key, value, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.max_seqlen_q,
            ctx.max_seqlen_k, softmax_scale=self.scale, causal=common.causal)
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
    if cache.is_fp8:
        arch = detect_platform().arch
        fp8 = fp8_cache_dtype(arch)
        if cache.key.dtype != fp8:
            raise RocdraftError(f"{NAME} fp8 KV caches must be {fp8} on {arch or 'this GPU'} "
                                f"(aiter's dtypes.fp8; by arch: {FP8_BY_ARCH}), got "
                                f"{cache.key.dtype}")
    elif cache.key.dtype != query.dtype:
        raise RocdraftError(f"{NAME} needs the KV cache in the query dtype {query.dtype} "
                            f"(or fp8), got {cache.key.dtype}")
    if query.shape[-1] > CK_MAX_HEAD_DIM:
        raise RocdraftError(f"{NAME} head_dim {query.shape[-1]} is above aiter's limit of "
                            f"{CK_MAX_HEAD_DIM}; use TRITON_ATTN or TORCH_SDPA")
    if cache.layout not in (NHD, SPLIT_K):
        raise RocdraftError(f"{NAME} KV layout {cache.layout!r} is not one of {[NHD, SPLIT_K]}")


def fp8_cache_dtype(arch: str | None) -> torch.dtype:
    """The fp8 dtype aiter's kernels take on ``arch`` (gfx942's for unknown archs)."""
    return FP8_BY_ARCH.get(arch, FP8_CACHE_DTYPE)


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
        # 16/32 reach the decode kernels (V1_BLOCK_SIZES; pa_asm.csv blkSz 16), any other
        # block size the (gathered) varlen path; 16 because the split-K value layout
        # [num_blocks, Hk, block_size / x, D, x] needs block_size % x == 0 with x = 16 bytes /
        # element (csrc/kernels/cache_kernels.cu), 16 for fp8.
        block_size_multiple=16,
        # aiter/ops/mha.py dispatches fp16/bf16 only; asm_mha_varlen_fwd.cu: "FlashAttention
        # only support fp16 and bf16 data type".
        dtypes=HALF_DTYPES,
        # The varlen path runs every head size: CK "only supports head dimension at most 256"
        # and "a head_size that is a multiple of 8" (asm_mha_varlen_fwd.cu; aiter/ops/mha.py
        # pads others to 8, declared here as multiples of 8 only). Decode kernels take subsets
        # (V1_HEAD_SIZES, ASM_HEAD_DIM); choose_path sends other sizes to the varlen path.
        head_sizes=None, head_size_multiple=8, max_head_size=CK_MAX_HEAD_DIM,
        platforms=("rocm",),
        # aiter/utility/dtypes.py: e4m3fnuz on gfx942, e4m3fn on gfx950; no fp8 elsewhere
        # (forward checks the running arch against FP8_BY_ARCH too).
        kv_cache_formats=tuple(FP8_BY_ARCH.items()))

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
