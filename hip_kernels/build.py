"""Just-in-time builds of the kernel extensions with ``torch.utils.cpp_extension.load``.

Two extensions, one set of HIP-dialect sources (``csrc/*.hip``):

- the GPU extension (ops in ``torch.ops.rocdraft_hip``), built on first use where torch has a
  GPU: on ROCm torch hipcc compiles the ``.hip`` sources for every visible device's arch (the
  base name of its ``gcnArchName``, e.g. ``gfx90a`` of ``gfx90a:sramecc+:xnack-``) plus the
  archs in ``PYTORCH_ROCM_ARCH`` (see ``rocm_archs``); on CUDA torch nvcc compiles them through
  ``csrc/kernels.cu`` and the compatibility header, for the visible devices (or
  ``TORCH_CUDA_ARCH_LIST``), as torch does. On CPU torch, or with ``ROCDRAFT_HIP_KERNELS=0``,
  nothing is built and the ops use the torch references. A failed build is reported once (a
  warning) and also falls back; so does a launch that finds no binary for the GPU (dispatch.py).
- the CPU shim extension (ops in ``torch.ops.rocdraft_cpu_shim``): the same kernels compiled
  by g++ through the serial launcher ``csrc/shim/hip_cpu_shim.h``; built only when asked for
  (``load_cpu_shim()``, used by tests), then CPU tensors go through it.

Builds live in ``<torch extensions root>/rocdraft/<kind>-<torch version>-<sources digest>``,
GPU builds with ``-<archs>`` appended (e.g. ``-gfx90a_gfx942``): any change to a file in
``csrc/`` or to the arch list gives a new directory, so a stale build, or one made for another
GPU, is never reused.
Force a rebuild with ``python -m rocdraft.hip_kernels.build --rebuild`` (see README.md).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp_extension

from rocdraft import envs

CSRC = Path(__file__).resolve().parent / "csrc"
KERNEL_SOURCES = ("kv_write.hip", "kv_compact.hip", "draft_step.hip", "padded_drafting.hip",
                  "fp8_convert.hip")
CPU_SHIM = "rocdraft_cpu_shim"
GPU_EXT = "rocdraft_hip"
DEFAULT_ROCM_ARCH = "gfx942"  # only when no device is visible and PYTORCH_ROCM_ARCH is unset

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


def rocm_archs(device_properties: Iterable[object], pytorch_rocm_arch: str | None
               ) -> tuple[str, ...]:
    """Offload targets of the ROCm build: the base name (before ':') of each device's
    ``gcnArchName``, then the entries of ``PYTORCH_ROCM_ARCH`` (';' or space separated), in
    that order without repeats; ``(DEFAULT_ROCM_ARCH,)`` when both give none.

    Example: devices ``gfx90a:sramecc+:xnack-`` twice, ``PYTORCH_ROCM_ARCH="gfx942;gfx90a"``
    -> ``("gfx90a", "gfx942")``.
    """
    names = [getattr(props, "gcnArchName", "").split(":", 1)[0].strip()
             for props in device_properties]
    names += (pytorch_rocm_arch or "").replace(";", " ").split()
    archs = tuple(dict.fromkeys(name for name in names if name))
    return archs or (DEFAULT_ROCM_ARCH,)


def cuda_archs(capabilities: Iterable[tuple[int, int]], torch_cuda_arch_list: str | None
               ) -> tuple[str, ...]:
    """What the CUDA build is made for (torch picks the flags): ``TORCH_CUDA_ARCH_LIST``'s
    entries when set (e.g. ``("9.0", "8.0+PTX")``), else ``sm_<major><minor>`` of each device."""
    listed = (torch_cuda_arch_list or "").replace(";", " ").split()
    if listed and listed != ["native"]:
        return tuple(dict.fromkeys(listed))
    return tuple(dict.fromkeys(f"sm_{major}{minor}" for major, minor in capabilities))


def gpu_archs(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The arch list of the GPU extension on this machine (empty without a GPU)."""
    if not torch.cuda.is_available():
        return ()
    devices = range(torch.cuda.device_count())
    if torch.version.hip:
        return rocm_archs([torch.cuda.get_device_properties(i) for i in devices],
                          environ.get("PYTORCH_ROCM_ARCH"))
    return cuda_archs([torch.cuda.get_device_capability(i) for i in devices],
                      environ.get("TORCH_CUDA_ARCH_LIST"))


def build_directory(kind: str, archs: tuple[str, ...] = ()) -> Path:
    """Build folder of extension ``kind`` (``CPU_SHIM`` or ``GPU_EXT``) for these sources and,
    for a GPU build, the target ``archs``."""
    if kind not in (CPU_SHIM, GPU_EXT):
        raise ValueError(f"unknown extension kind {kind!r}; valid: {(CPU_SHIM, GPU_EXT)}")
    torch_version = torch.__version__.replace("+", "_")
    root = Path(cpp_extension.get_default_build_root()) / "rocdraft"
    name = f"{kind}-{torch_version}-{sources_digest()}"
    if archs:
        name += "-" + "_".join(re.sub(r"[^A-Za-z0-9.]", "-", arch) for arch in archs)
    return root / name


def _load(kind: str, sources: list[Path], extra_cflags: list[str],
          extra_cuda_cflags: list[str], verbose: bool, archs: tuple[str, ...] = ()) -> object:
    directory = build_directory(kind, archs)
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
        return f"{envs.describe_source(envs.HIP_KERNELS)}: switched off"
    if not torch.cuda.is_available():
        return "torch sees no GPU (CPU build of torch or no visible device)"
    if not (torch.version.hip or torch.version.cuda):
        return "torch has neither ROCm nor CUDA support"
    failure = _LOADED.get(GPU_EXT + ":error")
    return None if failure is None else str(failure)


def load_gpu_extension(verbose: bool = False) -> object | None:
    """The GPU extension's ops namespace, building it on first use; None when unavailable."""
    if GPU_EXT in _LOADED:
        return _LOADED[GPU_EXT]
    if gpu_unavailable_reason() is not None:
        return None
    archs = gpu_archs()
    if torch.version.hip:
        sources = [CSRC / "gpu_ext.cpp"] + [CSRC / name for name in KERNEL_SOURCES]
        # explicit targets: torch then reads neither PYTORCH_ROCM_ARCH nor the devices itself
        cuda_flags = ["-O3", *(f"--offload-arch={arch}" for arch in archs)]
    else:
        sources = [CSRC / "gpu_ext.cpp", CSRC / "kernels.cu"]
        cuda_flags = ["-O3"]
    try:
        _LOADED[GPU_EXT] = _load(GPU_EXT, sources, ["-O3"], cuda_flags, verbose, archs)
    except Exception as error:  # a toolchain problem must not stop the engine: use torch ops
        _LOADED[GPU_EXT + ":error"] = f"GPU extension build failed: {error}"
        warnings.warn(f"rocdraft: {_LOADED[GPU_EXT + ':error']}; using the torch reference ops",
                      stacklevel=2)
        return None
    return _LOADED[GPU_EXT]


def disable_gpu_extension(reason: str) -> None:
    """Stop using the loaded GPU extension in this process (``gpu_unavailable_reason()`` then
    returns ``reason``), e.g. after a launch found no kernel binary for the GPU."""
    _LOADED.pop(GPU_EXT, None)
    _LOADED[GPU_EXT + ":error"] = reason


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the rocdraft kernel extensions.")
    parser.add_argument("--cpu-shim", action="store_true", help="build the CPU shim extension")
    parser.add_argument("--rebuild", action="store_true", help="delete the build folder first")
    args = parser.parse_args(argv)
    kind = CPU_SHIM if args.cpu_shim else GPU_EXT
    directory = build_directory(kind, () if kind == CPU_SHIM else gpu_archs())
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
