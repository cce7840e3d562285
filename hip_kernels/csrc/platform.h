// One include for every .hip source: picks the HIP runtime (hipcc / clang -x hip), the CUDA
// compatibility header (nvcc) or the serial CPU shim (g++ inside a torch CPU extension, with
// -DROCDRAFT_CPU_SHIM). Kernels written against it must not use __syncthreads, shared memory
// or warp intrinsics (the shim runs threads one after another) and must not assume a warp or
// wavefront size (MI300 runs 64-wide wavefronts, NVIDIA 32-wide warps).
#pragma once

#if defined(ROCDRAFT_CPU_SHIM)
#include "shim/hip_cpu_shim.h"
#elif defined(__NVCC__)
#include "compat/hip_to_cuda.h"
#else
#include <hip/hip_runtime.h>
#endif

#include <stdint.h>
