"""Every Triton kernel of rocdraft with a representative signature, for ahead-of-time compile
checks (``scripts/check_kernels_compile.py``) on GPU targets from a machine without a GPU.

An entry names one launchable ``@triton.jit`` kernel, the argument types and constexprs of one
representative launch, and the ``@triton.jit`` helpers it calls. ``uncatalogued_kernels()``
parses the kernel sources and lists any jit function no entry covers; a test and the compile
script both fail on it, so a new kernel cannot be forgotten.

What a compile check proves: the kernel lowers to AMDGCN (an hsaco) for gfx942/gfx90a and to
PTX (a cubin) for sm_90 with these types and tile sizes. It does not prove the numbers are right
(the interpreter tests do that) nor that it runs fast or within the hardware's resources at run
time (only a run on the hardware does).
"""
from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch

from rocdraft.backends.triton_kernels import draft_step, kv_write, unified_attention

KERNEL_DIR = Path(__file__).resolve().parent
# (backend, arch, warp size) of every compile-check target.
TARGETS: tuple[tuple[str, int | str, int], ...] = (
    ("hip", "gfx942", 64), ("hip", "gfx90a", 64), ("cuda", 90, 32))


@dataclass(frozen=True)
class KernelSpec:
    name: str  # unique entry name: kernel[variant]
    kernel: object  # the @triton.jit function
    signature: tuple[tuple[str, str], ...]  # (arg, triton type) in argument order
    constexprs: tuple[tuple[str, object], ...]
    helpers: tuple[str, ...] = ()  # @triton.jit helpers the kernel calls
    backends: tuple[str, ...] = ("hip", "cuda")  # target backends it is compiled for

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
          helpers: tuple[str, ...] = (), backends: tuple[str, ...] = ("hip", "cuda")
          ) -> KernelSpec:
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
    return KernelSpec(name, kernel, signature, tuple(constexprs.items()), helpers, backends)


def _kv_write(variant: str, src: str, cache: str, layout_splits: tuple[int, int, int, int],
              kind: kv_write.CacheKind, backends: tuple[str, ...]) -> KernelSpec:
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
                 ("_store_rows", "_round_to_bf16_grid", "_round_to_fp8_grid"), backends)


def _attention(variant: str, query: str, cache: str, group: int, block_q: int, block_m: int,
               spec_mask: bool, fp8: bool, backends: tuple[str, ...],
               block_d: int = 128) -> KernelSpec:
    types = {"query_ptr": f"*{query}", "key_cache_ptr": f"*{cache}",
             "value_cache_ptr": f"*{cache}", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
             "out_ptr": f"*{query}", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
             "block_table_ptr": "*i32", "spec_mask_ptr": "*u8", "sm_scale": "fp32"}
    constexprs = {"GROUP": group, "BLOCK_Q": block_q, "BLOCK_M": block_m, "BLOCK_D": block_d,
                  "TILE": unified_attention.TILE_N, "CAUSAL": True, "HAS_SPEC_MASK": spec_mask,
                  "HAS_K_SCALE": fp8, "HAS_V_SCALE": fp8, "UPCAST_DOT": query == "fp32"}
    return _spec(f"unified_attention[{variant}]", unified_attention.unified_attention_kernel,
                 types, constexprs, ("_find_request",), backends)


def kernel_catalog() -> tuple[KernelSpec, ...]:
    """Every kernel entry (several variants of a kernel where dtypes change the code)."""
    kind = kv_write.cache_kind
    nhd, split_k_bf16 = (1, 1, 1, 1), (1, 8, 8, 1)  # (key off, key dim, value off, value dim)
    return (
        _kv_write("fp16,NHD", "fp16", "fp16", nhd, kind(torch.float16), ("hip", "cuda")),
        _kv_write("fp32->bf16,SPLIT_K", "fp32", "bf16", split_k_bf16, kind(torch.bfloat16),
                  ("hip", "cuda")),
        _kv_write("bf16->fp8e4m3fnuz,NHD", "bf16", "fp8e4b8", nhd, kind(torch.float8_e4m3fnuz),
                  ("hip",)),
        _kv_write("bf16->fp8e4m3fn,NHD", "bf16", "fp8e4nv", nhd, kind(torch.float8_e4m3fn),
                  ("cuda",)),
        _attention("fp16,decode,gqa4", "fp16", "fp16", 4, 4, 16, False, False, ("hip", "cuda")),
        _attention("bf16,prefill,gqa4,spec_mask", "bf16", "bf16", 4, 16, 64, True, False,
                   ("hip", "cuda")),
        _attention("fp16,prefill,head_dim256", "fp16", "fp16", 1, 64, 64, False, False,
                   ("hip", "cuda"), block_d=256),
        _attention("fp32", "fp32", "fp32", 1, 16, 16, False, False, ("hip", "cuda")),
        _attention("bf16,fp8e4m3fnuz cache", "bf16", "fp8e4b8", 8, 2, 16, False, True, ("hip",)),
        _attention("fp16,fp8e4m3fn cache", "fp16", "fp8e4nv", 8, 2, 16, False, True, ("cuda",)),
        _spec("advance_draft_step", draft_step.advance_draft_step_kernel,
              {"positions_ptr": "*i64", "seq_lens_ptr": "*i32", "block_table_ptr": "*i32",
               "clamped_positions_ptr": "*i64", "slot_mapping_ptr": "*i64"},
              {"BLOCK": draft_step.BLOCK_ROWS}),
    )


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
