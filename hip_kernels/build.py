"""Just-in-time builds of the kernel extensions with ``torch.utils.cpp_extension.load``.

Two extensions, one set of HIP-dialect sources (``csrc/*.hip``):

- the GPU extension (ops in ``torch.ops.rocdraft_hip``), built on first use where torch has a
  GPU: on ROCm torch hipcc compiles the ``.hip`` sources for ``PYTORCH_ROCM_ARCH`` (default
  gfx942); on CUDA torch nvcc compiles them through ``csrc/kernels.cu`` and the compatibility
  header. On CPU torch, or with ``ROCDRAFT_HIP_KERNELS=0``, nothing is built and the ops use
  the torch references. A failed build is reported once (a warning) and also falls back.
- the CPU shim extension (ops in ``torch.ops.rocdraft_cpu_shim``): the same kernels compiled
  by g++ through the serial launcher ``csrc/shim/hip_cpu_shim.h``; built only when asked for
  (``load_cpu_shim()``, used by tests), then CPU tensors go through it.

Builds live in ``<torch extensions root>/rocdraft/<kind>-<torch version>-<sources digest>``:
any change to a file in ``csrc/`` gives a new directory, so a stale build is never reused.
Force a rebuild with ``python -m rocdraft.hip_kernels.build --rebuild`` (see README.md).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp_extension

from rocdraft import envs

CSRC = Path(__file__).resolve().parent / "csrc"
KERNEL_SOURCES = ("kv_write.hip", "draft_step.hip", "padded_drafting.hip", "fp8_convert.hip")
CPU_SHIM = "rocdraft_cpu_shim"
GPU_EXT = "rocdraft_hip"
DEFAULT_ROCM_ARCH = "gfx942"

# The only module state: loaded extension handles (torch.ops namespaces) by kind, and the
# reason the GPU extension could not be loaded, so a failed build is tried once per process.
_LOADED: dict[str, object] = {}


def sources_digest() -> str:
    """Short hash of every file under csrc/ (names and contents)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in CSRC.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(CSRC)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def build_directory(kind: str) -> Path:
    """Build folder of extension ``kind`` (``CPU_SHIM`` or ``GPU_EXT``) for these sources."""
    if kind not in (CPU_SHIM, GPU_EXT):
        raise ValueError(f"unknown extension kind {kind!r}; valid: {(CPU_SHIM, GPU_EXT)}")
    torch_version = torch.__version__.replace("+", "_")
    root = Path(cpp_extension.get_default_build_root()) / "rocdraft"
    return root / f"{kind}-{torch_version}-{sources_digest()}"


def _load(kind: str, sources: list[Path], extra_cflags: list[str],
          extra_cuda_cflags: list[str], verbose: bool) -> object:
    directory = build_directory(kind)
    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name=kind, sources=[str(s) for s in sources],
                       extra_cflags=extra_cflags, extra_cuda_cflags=extra_cuda_cflags,
                       extra_include_paths=[str(CSRC)], build_directory=str(directory),
                       is_python_module=False, verbose=verbose)
    return getattr(torch.ops, kind)


def load_cpu_shim(verbose: bool = False) -> object:
    """Build (once, cached on disk) and load the CPU shim extension; returns its ops namespace.

    After this call the ``rocdraft::*`` ops run CPU tensors through the shim kernels.
    """
    if CPU_SHIM not in _LOADED:
        _LOADED[CPU_SHIM] = _load(CPU_SHIM, [CSRC / "cpu_shim_ext.cpp"],
                                  ["-O2", "-fno-strict-aliasing"], [], verbose)
    return _LOADED[CPU_SHIM]


def loaded_cpu_shim() -> object | None:
    """The CPU shim ops namespace if ``load_cpu_shim()`` was called, else None (never builds)."""
    return _LOADED.get(CPU_SHIM)


def gpu_unavailable_reason() -> str | None:
    """Why the GPU extension cannot be used in this process, or None when it can (or may)."""
    if not envs.hip_kernels_enabled():
        return "ROCDRAFT_HIP_KERNELS=0"
    if not torch.cuda.is_available():
        return "torch sees no GPU (CPU build of torch or no visible device)"
    if not (torch.version.hip or torch.version.cuda):
        return "torch has neither ROCm nor CUDA support"
    failure = _LOADED.get(GPU_EXT + ":error")
    return None if failure is None else str(failure)


def _rocm_arch_flags() -> list[str]:
    # PYTORCH_ROCM_ARCH is torch's own variable: torch reads it when no arch flag is given.
    if os.environ.get("PYTORCH_ROCM_ARCH"):
        return []
    return [f"--offload-arch={DEFAULT_ROCM_ARCH}"]


def load_gpu_extension(verbose: bool = False) -> object | None:
    """The GPU extension's ops namespace, building it on first use; None when unavailable."""
    if GPU_EXT in _LOADED:
        return _LOADED[GPU_EXT]
    if gpu_unavailable_reason() is not None:
        return None
    if torch.version.hip:
        sources = [CSRC / "gpu_ext.cpp"] + [CSRC / name for name in KERNEL_SOURCES]
        cuda_flags = ["-O3", *_rocm_arch_flags()]
    else:
        sources = [CSRC / "gpu_ext.cpp", CSRC / "kernels.cu"]
        cuda_flags = ["-O3"]
    try:
        _LOADED[GPU_EXT] = _load(GPU_EXT, sources, ["-O3"], cuda_flags, verbose)
    except Exception as error:  # a toolchain problem must not stop the engine: use torch ops
        _LOADED[GPU_EXT + ":error"] = f"GPU extension build failed: {error}"
        warnings.warn(f"rocdraft: {_LOADED[GPU_EXT + ':error']}; using the torch reference ops",
                      stacklevel=2)
        return None
    return _LOADED[GPU_EXT]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the rocdraft kernel extensions.")
    parser.add_argument("--cpu-shim", action="store_true", help="build the CPU shim extension")
    parser.add_argument("--rebuild", action="store_true", help="delete the build folder first")
    args = parser.parse_args(argv)
    kind = CPU_SHIM if args.cpu_shim else GPU_EXT
    directory = build_directory(kind)
    if args.rebuild and directory.exists():
        shutil.rmtree(directory)
        print(f"removed {directory}")
    if kind == CPU_SHIM:
        load_cpu_shim(verbose=True)
    elif load_gpu_extension(verbose=True) is None:
        print(f"GPU extension not built: {gpu_unavailable_reason()}")
        return 1
    print(f"{kind} ready in {directory}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
