"""Every Triton kernel of rocdraft with a representative signature, for ahead-of-time compile
checks (``scripts/check_kernels_compile.py``) on GPU targets from a machine without a GPU.

An entry names one launchable ``@triton.jit`` kernel, the argument types and constexprs of one
representative launch, the ``@triton.jit`` helpers it calls and the targets it is compiled for.
``uncatalogued_kernels()`` parses the kernel sources and lists any jit function no entry
covers; a test and the compile script both fail on it, so a new kernel cannot be forgotten.

The dtype matrix comes from TRITON_ATTN's declarations, not from a list kept here: for every
target, every (dtype, KV-cache dtype) pair the backend declares there (each dtype with a cache
of its own dtype, and with every fp8 format declared for that arch) gets a KV-write and an
attention entry, and no other pair does. A few shape variants (spec mask, head_dim 256, the
split-K layout) are compiled once per target on top.

What a compile check proves: the kernel lowers to AMDGCN (an hsaco) for gfx942/gfx90a/gfx950
and to PTX (a cubin) for sm_90 with these types and tile sizes. It does not prove the numbers
are right (the interpreter tests do that) nor that it runs fast or within the hardware's
resources at run time (only a run on the hardware does).
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from rocdraft.backends.kv_cache import FP8_DTYPES
from rocdraft.backends.triton_attn import TritonAttnBackend
from rocdraft.backends.triton_kernels import (draft_step, fused_norm, kv_compact, kv_write,
                                               rope_kv_write, silu_mul, unified_attention)

KERNEL_DIR = Path(__file__).resolve().parent


class CompileTarget(NamedTuple):
    backend: str  # Triton backend: "hip" | "cuda"
    arch: int | str  # GPUTarget arch: "gfx942" or a compute capability (90)
    warp_size: int

    @property
    def name(self) -> str:
        """The arch as rocdraft.platform names it: "gfx942", "sm_90"."""
        return self.arch if self.backend == "hip" else f"sm_{self.arch}"

    @property
    def platform_kind(self) -> str:
        return "rocm" if self.backend == "hip" else "cuda"


# Every compile-check target: MI300 (gfx942), MI200 (gfx90a), MI350 (gfx950), H100/H200 (sm_90).
TARGETS: tuple[CompileTarget, ...] = (
    CompileTarget("hip", "gfx942", 64), CompileTarget("hip", "gfx90a", 64),
    CompileTarget("hip", "gfx950", 64), CompileTarget("cuda", 90, 32))
ALL_TARGETS = tuple(t.name for t in TARGETS)
TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                torch.float8_e4m3fn: "fp8e4nv", torch.float8_e4m3fnuz: "fp8e4b8"}
SHORT_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
               torch.float8_e4m3fn: "fp8e4m3fn", torch.float8_e4m3fnuz: "fp8e4m3fnuz"}


@dataclass(frozen=True)
class KernelSpec:
    name: str  # unique entry name: kernel[variant]
    kernel: object  # the @triton.jit function
    signature: tuple[tuple[str, str], ...]  # (arg, triton type) in argument order
    constexprs: tuple[tuple[str, object], ...]
    helpers: tuple[str, ...] = ()  # @triton.jit helpers the kernel calls
    targets: tuple[str, ...] = ALL_TARGETS  # CompileTarget.name of every target it is built for
    # (dtype, KV-cache dtype) of a declared-pair entry; None for shape variants.
    dtype_pair: tuple[torch.dtype, torch.dtype] | None = None
    # Compile options the wrapper launches with (num_warps, enable_fp_fusion), when not
    # Triton's defaults.
    options: tuple[tuple[str, object], ...] = ()

    @property
    def kernel_name(self) -> str:
        return self.kernel.fn.__name__

    def signature_dict(self) -> dict[str, str]:
        return dict(self.signature)

    def constexpr_dict(self) -> dict[str, object]:
        return dict(self.constexprs)


def _is_constexpr(annotation) -> bool:
    return "constexpr" in (annotation if isinstance(annotation, str) else repr(annotation))


def _spec(name: str, kernel, types: dict[str, str], constexprs: dict[str, object],
          helpers: tuple[str, ...] = (), targets: tuple[str, ...] = ALL_TARGETS,
          dtype_pair: tuple[torch.dtype, torch.dtype] | None = None) -> KernelSpec:
    """Signature in argument order: constexprs typed "constexpr", ``types`` for pointers and
    floats, "i32" for every other (integer) argument. Raises ValueError when ``constexprs`` or
    ``types`` disagree with the kernel's parameters."""
    params = inspect.signature(kernel.fn).parameters
    declared = {n for n, p in params.items() if _is_constexpr(p.annotation)}
    if declared != set(constexprs):
        raise ValueError(f"{name}: constexprs {sorted(constexprs)} != kernel's {sorted(declared)}")
    unknown = set(types) - set(params)
    untyped_ptrs = [n for n in params if n.endswith("_ptr") and n not in types]
    if unknown or untyped_ptrs:
        raise ValueError(f"{name}: unknown args {sorted(unknown)}, untyped pointers {untyped_ptrs}")
    signature = tuple((n, "constexpr" if n in declared else types.get(n, "i32")) for n in params)
    return KernelSpec(name, kernel, signature, tuple(constexprs.items()), helpers, targets,
                      dtype_pair)


def _kv_write(variant: str, dtype: torch.dtype, cache_dtype: torch.dtype,
              layout_splits: tuple[int, int, int, int], targets: tuple[str, ...],
              dtype_pair: tuple[torch.dtype, torch.dtype] | None = None) -> KernelSpec:
    src, cache = TRITON_TYPES[dtype], TRITON_TYPES[cache_dtype]
    kind = kv_write.cache_kind(cache_dtype)
    key_off, key_dim, value_off, value_dim = layout_splits
    types = {"key_ptr": f"*{src}", "value_ptr": f"*{src}", "key_cache_ptr": f"*{cache}",
             "value_cache_ptr": f"*{cache}", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
             "slot_mapping_ptr": "*i64"}
    constexprs = {"KEY_OFF_SPLIT": key_off, "KEY_DIM_SPLIT": key_dim,
                  "VALUE_OFF_SPLIT": value_off, "VALUE_DIM_SPLIT": value_dim,
                  "CACHE_KIND": kind.code, "HAS_K_SCALE": kind.code >= 2,
                  "HAS_V_SCALE": kind.code >= 2, "FP8_MAX": kind.fp8_max,
                  "FP8_MIN_EXP": kind.fp8_min_exp, "BLOCK_T": 4, "BLOCK_H": 8,
                  "BLOCK_D": 128}
    return _spec(f"kv_write[{variant}]", kv_write.kv_write_kernel, types, constexprs,
                 ("_store_rows", "_round_to_bf16_grid", "quantize_fp8_rows",
                  "_round_to_fp8_grid"), targets, dtype_pair)


def _kv_compact(variant: str, bits: str, layout_splits: tuple[int, int, int, int],
                block_h: int = 8, block_d: int = 128) -> KernelSpec:
    """KV compaction on caches viewed as raw ``bits`` (i8 / i16 / i32: fp8, 16-bit, fp32
    caches): no dtype pair, every target."""
    key_off, key_dim, value_off, value_dim = layout_splits
    types = {"key_bits_ptr": f"*{bits}", "value_bits_ptr": f"*{bits}",
             "block_table_ptr": "*i32", "context_lens_ptr": "*i32",
             "accepted_nodes_ptr": "*i64", "num_accepted_ptr": "*i64"}
    constexprs = {"KEY_OFF_SPLIT": key_off, "KEY_DIM_SPLIT": key_dim,
                  "VALUE_OFF_SPLIT": value_off, "VALUE_DIM_SPLIT": value_dim,
                  "BLOCK_H": block_h, "BLOCK_D": block_d}
    return _spec(f"kv_compact[{variant}]", kv_compact.kv_compact_kernel, types, constexprs,
                 ("_move_rows",))


def _attention(variant: str, dtype: torch.dtype, cache_dtype: torch.dtype, group: int,
               block_q: int, block_m: int, spec_mask: bool, targets: tuple[str, ...],
               block_d: int = 128, dtype_pair: tuple[torch.dtype, torch.dtype] | None = None
               ) -> KernelSpec:
    query, cache = TRITON_TYPES[dtype], TRITON_TYPES[cache_dtype]
    fp8 = cache_dtype in FP8_DTYPES
    types = {"query_ptr": f"*{query}", "key_cache_ptr": f"*{cache}",
             "value_cache_ptr": f"*{cache}", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
             "out_ptr": f"*{query}", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
             "block_table_ptr": "*i32", "spec_mask_ptr": "*u8", "sm_scale": "fp32"}
    constexprs = {"GROUP": group, "BLOCK_Q": block_q, "BLOCK_M": block_m, "BLOCK_D": block_d,
                  "TILE": unified_attention.TILE_N, "CAUSAL": True, "HAS_SPEC_MASK": spec_mask,
                  "HAS_K_SCALE": fp8, "HAS_V_SCALE": fp8, "UPCAST_DOT": query == "fp32"}
    return _spec(f"unified_attention[{variant}]", unified_attention.unified_attention_kernel,
                 types, constexprs, ("_find_request",), targets, dtype_pair)


def _rope_kv_write(variant: str, dtype: torch.dtype, cache_dtype: torch.dtype,
                   targets: tuple[str, ...],
                   dtype_pair: tuple[torch.dtype, torch.dtype] | None = None) -> KernelSpec:
    """RoPE + NHD KV write at Llama-3.1-8B's decode tiling (one token: 32 q heads, 8 kv
    heads, head_dim 128)."""
    src, cache = TRITON_TYPES[dtype], TRITON_TYPES[cache_dtype]
    kind = kv_write.cache_kind(cache_dtype if cache_dtype in FP8_DTYPES else torch.float32)
    types = {"qkv_ptr": f"*{src}", "cos_ptr": f"*{src}", "sin_ptr": f"*{src}",
             "q_out_ptr": f"*{src}", "key_cache_ptr": f"*{cache}",
             "value_cache_ptr": f"*{cache}", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
             "slot_mapping_ptr": "*i64"}
    fp8 = kind.code >= 2
    constexprs = {"ROUND": fused_norm.ROUND_CODES[dtype], "CACHE_KIND": kind.code,
                  "HAS_K_SCALE": fp8, "HAS_V_SCALE": fp8, "FP8_MAX": kind.fp8_max,
                  "FP8_MIN_EXP": kind.fp8_min_exp, "BLOCK_T": 1, "BLOCK_HQ": 32,
                  "BLOCK_HK": 8, "BLOCK_D": 128}
    spec = _spec(f"rope_kv_write[{variant}]", rope_kv_write.rope_kv_write_kernel, types,
                 constexprs, ("_rotated_rows", "_store_cache_rows", "quantize_fp8_rows",
                              "_round_to_dtype_grid", "_round_to_bf16_grid",
                              "_round_to_fp8_grid"), targets, dtype_pair)
    return dataclasses.replace(spec, options=(("enable_fp_fusion", False),))


def _dense_entries() -> list[KernelSpec]:
    """Residual add + RMSNorm (hidden 4096, one row per program) and SiLU-and-multiply (1024
    columns per program) for every model dtype TRITON_ATTN declares, on every target: they
    touch no KV cache, so the model dtype is their whole pair."""
    entries = []
    for dtype in TritonAttnBackend.capabilities.dtypes:
        t, code = TRITON_TYPES[dtype], fused_norm.ROUND_CODES[dtype]
        entries.append(dataclasses.replace(_spec(
            f"add_rms_norm[{SHORT_NAMES[dtype]}]", fused_norm.add_rms_norm_kernel,
            {"x_ptr": f"*{t}", "residual_ptr": f"*{t}", "weight_ptr": f"*{t}",
             "out_ptr": f"*{t}", "residual_out_ptr": f"*{t}", "eps": "fp32"},
            {"ROUND": code, "BLOCK_T": 1, "BLOCK_H": 4096},
            ("_round_to_dtype_grid", "_round_to_bf16_grid")),
            options=(("num_warps", fused_norm.num_warps_for(4096)),)))
        entries.append(_spec(
            f"silu_mul[{SHORT_NAMES[dtype]}]", silu_mul.silu_mul_kernel,
            {"gate_up_ptr": f"*{t}", "out_ptr": f"*{t}"},
            {"ROUND": code, "BLOCK_T": 1, "BLOCK_N": silu_mul.GPU_BLOCK_N},
            ("_round_to_dtype_grid", "_round_to_bf16_grid")))
    return entries


def declared_pairs(target: CompileTarget) -> tuple[tuple[torch.dtype, torch.dtype], ...]:
    """(dtype, KV-cache dtype) pairs TRITON_ATTN declares for ``target``: each dtype with a
    cache of its own dtype and with every fp8 format declared for the target's arch."""
    caps = TritonAttnBackend.capabilities
    fp8 = caps.kv_cache_dtypes_for(target.platform_kind, target.name)
    return tuple((dtype, cache) for dtype in caps.dtypes for cache in (dtype, *fp8))


def _declared_pair_entries() -> list[KernelSpec]:
    """One KV-write, one attention and one RoPE + KV-write entry per declared pair, built for
    every target that declares it (decode tiling with GQA 4: the launch every draft step
    makes)."""
    targets_of: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}
    for target in TARGETS:
        for pair in declared_pairs(target):
            targets_of.setdefault(pair, []).append(target.name)
    entries = []
    nhd = (1, 1, 1, 1)  # (key off, key dim, value off, value dim) splits
    for (dtype, cache), targets in targets_of.items():
        label, where = f"{SHORT_NAMES[dtype]}->{SHORT_NAMES[cache]}", tuple(targets)
        entries.append(_kv_write(f"{label},NHD", dtype, cache, nhd, where, (dtype, cache)))
        entries.append(_attention(f"{label},decode,gqa4", dtype, cache, 4, 4, 16, False,
                                  where, dtype_pair=(dtype, cache)))
        entries.append(_rope_kv_write(f"{label},NHD", dtype, cache, where, (dtype, cache)))
    return entries


def kernel_catalog() -> tuple[KernelSpec, ...]:
    """Every kernel entry: the declared (dtype, KV-cache dtype) pairs, then shape variants."""
    split_k_bf16 = (1, 8, 8, 1)  # x = 8 elements of bf16 per 16 bytes
    return (
        *_declared_pair_entries(),
        *_dense_entries(),
        _kv_write("bf16,SPLIT_K", torch.bfloat16, torch.bfloat16, split_k_bf16, ALL_TARGETS),
        _attention("bf16,prefill,gqa4,spec_mask", torch.bfloat16, torch.bfloat16, 4, 16, 64,
                   True, ALL_TARGETS),
        _attention("fp16,prefill,head_dim256", torch.float16, torch.float16, 1, 64, 64, False,
                   ALL_TARGETS, block_d=256),
        _kv_compact("16-bit,NHD", "i16", (1, 1, 1, 1)),
        _kv_compact("fp8,SPLIT_K", "u8", (1, 16, 16, 1)),
        _kv_compact("fp32,NHD", "i32", (1, 1, 1, 1)),
        _spec("advance_draft_step", draft_step.advance_draft_step_kernel,
              {"positions_ptr": "*i64", "seq_lens_ptr": "*i32", "block_table_ptr": "*i32",
               "clamped_positions_ptr": "*i64", "slot_mapping_ptr": "*i64"},
              {"BLOCK": draft_step.BLOCK_ROWS}),
    )


def compile_plan(catalog: tuple[KernelSpec, ...] | None = None,
                 targets: tuple[CompileTarget, ...] = TARGETS
                 ) -> list[tuple[KernelSpec, CompileTarget]]:
    """Every (entry, target) the compile check builds, in catalog order."""
    catalog = kernel_catalog() if catalog is None else catalog
    return [(spec, target) for spec in catalog for target in targets
            if target.name in spec.targets]


def jit_functions_in_sources(directory: Path = KERNEL_DIR) -> dict[str, str]:
    """Name -> file of every function decorated with ``triton.jit`` / ``jit`` in ``directory``."""
    found = {}
    for path in sorted(directory.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
                found[node.name] = path.name
    return found


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
    return name == "jit"


def uncatalogued_kernels(catalog: tuple[KernelSpec, ...] | None = None,
                         directory: Path = KERNEL_DIR) -> list[str]:
    """``file:function`` of every jit function no catalog entry covers (as kernel or helper)."""
    catalog = kernel_catalog() if catalog is None else catalog
    covered = {s.kernel_name for s in catalog} | {h for s in catalog for h in s.helpers}
    return [f"{file}:{name}" for name, file in jit_functions_in_sources(directory).items()
            if name not in covered]
