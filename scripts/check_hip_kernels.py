"""Compile every HIP source of rocdraft.hip_kernels to AMD GPU code objects, without a GPU.

    python scripts/check_hip_kernels.py [--arch gfx942 --arch gfx90a] [--nvcc] [--keep DIR]

Each ``hip_kernels/csrc/*.hip`` is compiled device-only with Debian's clang-19 for gfx942
(MI300) and gfx90a (MI200), linking ROCm's ``ockl.bc``, and host-only (the launchers against
the HIP 5.2 runtime headers); one line per file and target. With
``--nvcc`` the same sources are also compiled for sm_90 through ``csrc/kernels.cu`` and the
CUDA compatibility header. Exit status 0 only when every compile succeeds.

What this proves: the kernels are valid HIP for these targets and the compiler accepts them
(templates instantiate, types and address spaces check, register allocation succeeds). What
it does not prove: that they run correctly or fast on the hardware (index math and bit
patterns are tested on the CPU through the shim; only a GPU run proves wavefront behaviour).
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "hip_kernels" / "csrc"
APT_PACKAGES = "clang-19 lld-19 llvm-19 libamdhip64-dev rocm-device-libs"
OCKL_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/amdgcn/bitcode/ockl.bc",
    "/usr/lib/llvm-19/lib/clang/19/lib/amdgcn/bitcode/ockl.bc",
    "/opt/rocm/amdgcn/bitcode/ockl.bc",
)
DEFAULT_ARCHS = ("gfx942", "gfx90a")


def find_ockl() -> str | None:
    """Path of ROCm's ockl.bc: known locations, else the files of the rocm-device-libs package."""
    for candidate in OCKL_CANDIDATES:
        if Path(candidate).is_file():
            return candidate
    if shutil.which("dpkg"):
        listing = subprocess.run(["dpkg", "-L", "rocm-device-libs"], capture_output=True,
                                 text=True).stdout
        for line in listing.splitlines():
            if line.endswith("/ockl.bc") and Path(line).is_file():
                return line
    return None


def clang_command(clang: str, ockl: str, arch: str, source: Path, output: Path) -> list[str]:
    return [clang, "-x", "hip", f"--offload-arch={arch}", "-O3", "--rocm-path=/usr",
            "-nogpulib", "-Xclang", "-mlink-builtin-bitcode", "-Xclang", ockl,
            "--cuda-device-only", "--no-gpu-bundle-output", "-o", str(output), str(source)]


def host_command(clang: str, source: Path, output: Path) -> list[str]:
    """Host side (launchers, hipLaunchKernelGGL, kernel stubs) against the HIP headers."""
    return [clang, "-x", "hip", f"--offload-arch={DEFAULT_ARCHS[0]}", "-O2", "--rocm-path=/usr",
            "-nogpulib", "--cuda-host-only", "-c", "-o", str(output), str(source)]


def nvcc_command(nvcc: str, output: Path) -> list[str]:
    """All .hip sources for sm_90 through csrc/kernels.cu and compat/hip_to_cuda.h."""
    return [nvcc, "-x", "cu", "-std=c++17", "-arch=sm_90", "-O3", f"-I{CSRC}", "-c",
            str(CSRC / "kernels.cu"), "-o", str(output)]


def count_kernels(code_object: Path) -> int:
    """Kernel descriptors in an AMDGPU code object (symbols named ``<kernel>.kd``)."""
    names = re.findall(rb"([A-Za-z0-9_$.]+)\.kd\x00", code_object.read_bytes())
    return len(set(names))  # each name is in both the static and the dynamic symbol table


def run(label: str, command: list[str], output: Path) -> bool:
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if result.returncode != 0 or not output.is_file():
        print(f"FAIL {label}  ({seconds:.1f} s)")
        print("\n".join("     " + line for line in result.stderr.splitlines()[-30:]))
        return False
    size_kib = output.stat().st_size / 1024
    detail = f"{count_kernels(output)} kernels, " if output.suffix == ".co" else ""
    print(f"OK   {label}  {detail}{size_kib:.0f} KiB  ({seconds:.1f} s)")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", help=f"AMD target (default {DEFAULT_ARCHS})")
    parser.add_argument("--nvcc", action="store_true", help="also compile for sm_90 with nvcc")
    parser.add_argument("--keep", type=Path, help="write code objects here instead of a tmp dir")
    args = parser.parse_args(argv)
    archs = tuple(args.arch or DEFAULT_ARCHS)

    clang = shutil.which("clang-19")
    if clang is None:
        print(f"clang-19 not found; install: apt-get install {APT_PACKAGES}")
        return 2
    ockl = find_ockl()
    if ockl is None:
        print(f"ockl.bc not found (package rocm-device-libs); install: apt-get install "
              f"{APT_PACKAGES}")
        return 2
    sources = sorted(CSRC.glob("*.hip"))
    if not sources:
        print(f"no .hip sources in {CSRC}")
        return 1

    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.keep or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        ok = True
        for source in sources:
            for arch in archs:
                output = out_dir / f"{source.stem}.{arch}.co"
                ok &= run(f"{source.name:22s} {arch}",
                          clang_command(clang, ockl, arch, source, output), output)
            output = out_dir / f"{source.stem}.host.o"
            ok &= run(f"{source.name:22s} host  ", host_command(clang, source, output), output)
        if args.nvcc:
            nvcc = shutil.which("nvcc")
            if nvcc is None:
                print("FAIL kernels.cu sm_90: nvcc not found")
                ok = False
            else:
                output = out_dir / "kernels.sm_90.o"
                ok &= run(f"{'kernels.cu':22s} sm_90 ", nvcc_command(nvcc, output), output)
    print("all kernels compiled" if ok else "some kernels failed to compile")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
