"""Builds of the HIP kernels without a GPU: device code objects, the serial shim, build folders.

What these tests prove: every .hip source compiles to gfx942 (MI300) and gfx90a (MI200) code
objects with Debian's clang-19 and to sm_90 with nvcc through the compatibility header; the
serial launcher visits every (block, thread) of a 3-D launch exactly once with the right
blockDim/gridDim; build folders change whenever a source or the arch list changes; the arch
list is the visible devices' archs plus PYTORCH_ROCM_ARCH (fake device properties) and the
ROCm build passes each as --offload-arch. What they do not prove:
that the code objects load and run on a GPU, or that the JIT GPU build inside ROCm/CUDA
torch succeeds (only a GPU machine proves those; see hip_kernels/README.md).
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rocdraft.hip_kernels import build

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_hip_kernels.py"


def load_script():
    spec = importlib.util.spec_from_file_location("check_hip_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("clang-19") is None,
                    reason="clang-19 absent (apt-get install clang-19 lld-19 llvm-19 "
                           "libamdhip64-dev rocm-device-libs)")
def test_every_hip_source_compiles_for_gfx942_and_gfx90a():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    sources = sorted(p.name for p in build.CSRC.glob("*.hip"))
    for name in sources:
        for arch in ("gfx942", "gfx90a"):
            assert any(line.startswith("OK") and name in line and arch in line
                       for line in result.stdout.splitlines()), (name, arch, result.stdout)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc absent (CUDA toolkit)")
def test_hip_sources_compile_with_nvcc_through_the_compat_header(tmp_path):
    script = load_script()
    output = tmp_path / "kernels.o"
    assert script.run("kernels.cu sm_90", script.nvcc_command(shutil.which("nvcc"), output),
                      output)


SHIM_PROGRAM = r"""
#include <cstdio>
#include "shim/hip_cpu_shim.h"

__global__ void record(int* visits, unsigned* dims) {
  const unsigned block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const unsigned thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  visits[block * blockDim.x * blockDim.y * blockDim.z + thread] += 1;
  dims[0] = blockDim.x * blockDim.y * blockDim.z;
  dims[1] = gridDim.x * gridDim.y * gridDim.z;
}

template <int N> __global__ void add(int* out, int value) { out[threadIdx.x] += N * value; }

int main() {
  int visits[6 * 8] = {0};
  unsigned dims[2] = {0, 0};
  hipLaunchKernelGGL(record, dim3(2, 3, 1), dim3(4, 1, 2), 0, nullptr, visits, dims);
  for (int v : visits) if (v != 1) return 1;
  if (dims[0] != 8 || dims[1] != 6 || hipGetLastError() != hipSuccess) return 2;
  int out[4] = {0};
  hipLaunchKernelGGL((add<3>), dim3(1), dim3(4), 0, nullptr, out, 2);
  for (int v : out) if (v != 6) return 3;
  hipLaunchKernelGGL((add<1>), dim3(1), dim3(4), 128, nullptr, out, 2);  // shared memory
  if (hipGetLastError() == hipSuccess || out[0] != 6 || hipGetLastError() != hipSuccess) return 4;
  std::puts("ok");
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ absent")
def test_serial_shim_visits_every_thread_once(tmp_path):
    source = tmp_path / "shim_check.cpp"
    source.write_text(SHIM_PROGRAM)
    binary = tmp_path / "shim_check"
    compiled = subprocess.run(["g++", "-std=c++17", f"-I{build.CSRC}", str(source), "-o",
                               str(binary)], capture_output=True, text=True, timeout=120)
    assert compiled.returncode == 0, compiled.stderr
    ran = subprocess.run([str(binary)], capture_output=True, text=True, timeout=30)
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.returncode


def test_build_folder_follows_the_sources(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    monkeypatch.setattr(build, "CSRC", csrc)
    before = build.build_directory(build.CPU_SHIM)
    assert before != build.build_directory(build.GPU_EXT)
    (csrc / "shim" / "hip_cpu_shim.h").write_text("// changed\n", encoding="utf-8")
    assert build.build_directory(build.CPU_SHIM) != before
    with pytest.raises(ValueError, match="unknown extension kind 'sycl'"):
        build.build_directory("sycl")


# ---------------------------------------------------------------------------- GPU arch list

def props(name: str) -> SimpleNamespace:
    """A stand-in for torch.cuda.get_device_properties(i) on ROCm."""
    return SimpleNamespace(gcnArchName=name)


@pytest.mark.parametrize("devices,env,expected", [
    (["gfx90a:sramecc+:xnack-"], None, ("gfx90a",)),
    (["gfx950:sramecc+:xnack-", "gfx950:sramecc+:xnack-"], "", ("gfx950",)),
    (["gfx1100"], "gfx942", ("gfx1100", "gfx942")),
    (["gfx90a:xnack-", "gfx942:sramecc+:xnack-"], "gfx942;gfx90a", ("gfx90a", "gfx942")),
    ([], "gfx90a gfx942; gfx1100", ("gfx90a", "gfx942", "gfx1100")),
    ([], None, ("gfx942",)),
])
def test_rocm_archs_are_the_visible_devices_plus_pytorch_rocm_arch(devices, env, expected):
    assert build.rocm_archs([props(name) for name in devices], env) == expected


def test_rocm_archs_skip_devices_without_an_arch_name():
    assert build.rocm_archs([SimpleNamespace(), props("")], "gfx90a") == ("gfx90a",)


def test_cuda_archs_follow_torch_cuda_arch_list_else_the_devices():
    assert build.cuda_archs([(9, 0), (9, 0), (8, 0)], None) == ("sm_90", "sm_80")
    assert build.cuda_archs([(9, 0)], "native") == ("sm_90",)
    assert build.cuda_archs([(9, 0)], "8.0;9.0+PTX") == ("8.0", "9.0+PTX")


def fake_rocm_torch(monkeypatch, names: list[str]) -> None:
    """Make torch look like ROCm torch with these visible devices."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props(names[i]))
    monkeypatch.setattr(torch.version, "hip", "6.4.0")


def test_gpu_archs_read_the_devices_and_the_environment(monkeypatch):
    if not torch.cuda.is_available():
        assert build.gpu_archs({}) == ()
    fake_rocm_torch(monkeypatch, ["gfx90a:sramecc+:xnack-"])
    assert build.gpu_archs({}) == ("gfx90a",)
    assert build.gpu_archs({"PYTORCH_ROCM_ARCH": "gfx942"}) == ("gfx90a", "gfx942")


def test_gpu_build_directory_is_keyed_on_the_arch_list():
    plain = build.build_directory(build.GPU_EXT)
    mi200 = build.build_directory(build.GPU_EXT, ("gfx90a",))
    both = build.build_directory(build.GPU_EXT, ("gfx90a", "gfx942"))
    assert len({plain, mi200, both, build.build_directory(build.GPU_EXT, ("gfx942",))}) == 4
    assert both.name == plain.name + "-gfx90a_gfx942"
    assert build.build_directory(build.GPU_EXT, ("9.0+PTX",)).name.endswith("-9.0-PTX")


def test_rocm_build_targets_every_visible_arch(monkeypatch):
    """On a gfx90a machine the ROCm build compiles for gfx90a (not only gfx942), into a folder
    of its own."""
    fake_rocm_torch(monkeypatch, ["gfx90a:sramecc+:xnack-", "gfx90a:sramecc+:xnack-"])
    monkeypatch.setenv("PYTORCH_ROCM_ARCH", "gfx942")
    monkeypatch.setenv("ROCDRAFT_HIP_KERNELS", "1")
    monkeypatch.setattr(build, "_LOADED", {})
    calls = []

    def fake_load(kind, sources, cflags, cuda_flags, verbose, archs=()):
        calls.append((kind, cuda_flags, build.build_directory(kind, archs)))
        return SimpleNamespace()

    monkeypatch.setattr(build, "_load", fake_load)
    assert build.load_gpu_extension() is not None
    [(kind, cuda_flags, directory)] = calls
    assert kind == build.GPU_EXT
    assert [f for f in cuda_flags if "offload-arch" in f] == ["--offload-arch=gfx90a",
                                                              "--offload-arch=gfx942"]
    assert directory.name.endswith("-gfx90a_gfx942")
