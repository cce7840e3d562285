// HIP names used by the project's kernels, mapped to CUDA, so nvcc compiles the same .hip
// sources (included from kernels.cu). Wrap templated kernels in parentheses inside the macro:
// hipLaunchKernelGGL((k<A, B>), grid, block, 0, stream, args...).
#pragma once

#include <cuda_runtime.h>

typedef cudaStream_t hipStream_t;
typedef cudaError_t hipError_t;
#define hipSuccess cudaSuccess
#define hipGetLastError cudaGetLastError
#define hipLaunchKernelGGL(kernel, grid, block, shmem, stream, ...) \
  kernel<<<(grid), (block), (shmem), (stream)>>>(__VA_ARGS__)
