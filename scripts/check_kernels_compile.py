"""Compile every catalogued Triton kernel for gfx942, gfx90a, gfx950 and sm_90 without a GPU.

    python scripts/check_kernels_compile.py                       # everything
    python scripts/check_kernels_compile.py --kernel advance_draft_step --target gfx942

Prints one line per (kernel entry, target) and exits non-zero when any compile fails or when
a ``@triton.jit`` function in backends/triton_kernels/ is missing from the catalog.

The (dtype, KV-cache dtype) pairs compiled per target are those TRITON_ATTN declares for that
target (``catalog.declared_pairs``): an fp8 format declared for an arch that Triton cannot
build for it fails here, and an undeclared one is never built.

What it proves: each kernel lowers to an AMDGCN code object (hsaco) / a cubin for the target
with its representative types and tile sizes. What it does not: numerical correctness (the
interpreter tests) or run-time behaviour on the hardware (only a GPU run shows that).

TRITON_INTERPRET must be unset: it turns ``@triton.jit`` into the interpreter at import time.
When it is set, the script re-executes itself with it removed from the environment.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _reexec_without_interpreter() -> None:
    if "TRITON_INTERPRET" in os.environ:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def _parse_args(argv: list[str] | None, target_names: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", action="append", default=[],
                        help="entry name or kernel name prefix to compile (repeatable; "
                             "default: all)")
    parser.add_argument("--target", action="append", default=[], choices=target_names,
                        help="target arch to compile for (repeatable; default: all)")
    parser.add_argument("--list", action="store_true", help="list the catalog and exit")
    return parser.parse_args(argv)


def _artifact(compiled) -> str:
    for key in ("hsaco", "cubin"):
        if key in compiled.asm:
            return f"{key} {len(compiled.asm[key])} bytes"
    return "no binary"


def main(argv: list[str] | None = None) -> int:
    _reexec_without_interpreter()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rocdraft.backends.triton_kernels.catalog import (TARGETS, compile_plan,
                                                          kernel_catalog, uncatalogued_kernels)

    target_names = [t.name for t in TARGETS] + [str(t.arch) for t in TARGETS
                                                if t.backend == "cuda"]
    args = _parse_args(argv, target_names)
    catalog = kernel_catalog()
    if args.list:
        for spec in catalog:
            print(f"{spec.name}  targets={','.join(spec.targets)}")
        return 0
    failures = 0
    missing = uncatalogued_kernels(catalog)
    for name in missing:
        print(f"FAIL  {name}: @triton.jit function missing from the catalog")
        failures += 1
    chosen = [s for s in catalog if not args.kernel
              or any(s.name == k or s.name.startswith(k) for k in args.kernel)]
    if not chosen:
        print(f"no catalog entry matches {args.kernel}; entries: {[s.name for s in catalog]}")
        return 2
    targets = tuple(t for t in TARGETS if not args.target
                    or t.name in args.target or str(t.arch) in args.target)
    plan = compile_plan(tuple(chosen), targets)
    for spec, target in plan:
        label = f"{spec.name:<50} {target.backend}:{target.arch}"
        start = time.perf_counter()
        try:
            source = ASTSource(spec.kernel, signature=spec.signature_dict(),
                               constexprs=spec.constexpr_dict())
            compiled = triton.compile(source, target=GPUTarget(*target),
                                      options=dict(spec.options) or None)
        except Exception as exc:  # report every failure, then exit non-zero
            lines = str(exc).strip().splitlines() or [""]
            print(f"FAIL  {label}  {type(exc).__name__}: {lines[0]} {lines[-1][:300]}")
            failures += 1
            continue
        print(f"OK    {label}  {_artifact(compiled)}  {time.perf_counter() - start:.1f}s")
    print(f"{len(plan)} compile(s), {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
