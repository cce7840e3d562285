// Serial CPU launcher: just enough of the HIP kernel dialect for g++ to compile and run the
// project's kernels on the CPU (tests of their index math and bit patterns, no GPU needed).
//
// hipLaunchKernelGGL(kernel, grid, block, shmem, stream, args...) becomes nested loops over
// blocks and threads that call the kernel as a plain function with threadIdx/blockIdx set.
// Sound only for kernels whose threads never wait on or read each other (no __syncthreads,
// shared memory, warp intrinsics or atomics-based hand-offs): then any serial order equals
// the parallel result. It proves nothing about wavefront behaviour, vector loads or speed.
#pragma once

#include <stddef.h>
#include <stdint.h>

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
};

typedef void* hipStream_t;
typedef int hipError_t;
#define hipSuccess 0
#define hipErrorInvalidValue 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

namespace rocdraft_shim {

// The launch coordinates of the kernel call in progress (per host thread, so concurrent
// launches from different host threads do not see each other's indices).
inline thread_local dim3 thread_idx{0, 0, 0};
inline thread_local dim3 block_idx{0, 0, 0};
inline thread_local dim3 block_dim{1, 1, 1};
inline thread_local dim3 grid_dim{1, 1, 1};
inline thread_local hipError_t last_error = hipSuccess;

template <typename... Params, typename... Args>
inline void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_mem_bytes,
                   hipStream_t /*stream: everything is synchronous*/, Args&&... args) {
  if (shared_mem_bytes != 0) {  // dynamic shared memory cannot be emulated serially
    last_error = hipErrorInvalidValue;
    return;
  }
  grid_dim = grid;
  block_dim = block;
  for (unsigned int bz = 0; bz < grid.z; ++bz)
    for (unsigned int by = 0; by < grid.y; ++by)
      for (unsigned int bx = 0; bx < grid.x; ++bx) {
        block_idx = dim3(bx, by, bz);
        for (unsigned int tz = 0; tz < block.z; ++tz)
          for (unsigned int ty = 0; ty < block.y; ++ty)
            for (unsigned int tx = 0; tx < block.x; ++tx) {
              thread_idx = dim3(tx, ty, tz);
              kernel(args...);
            }
      }
}

inline hipError_t get_last_error() {
  const hipError_t error = last_error;
  last_error = hipSuccess;
  return error;
}

}  // namespace rocdraft_shim

#define threadIdx (::rocdraft_shim::thread_idx)
#define blockIdx (::rocdraft_shim::block_idx)
#define blockDim (::rocdraft_shim::block_dim)
#define gridDim (::rocdraft_shim::grid_dim)
#define hipGetLastError ::rocdraft_shim::get_last_error
// Wrap a templated kernel in parentheses: hipLaunchKernelGGL((k<A, B>), grid, block, 0, s, ...)
#define hipLaunchKernelGGL(kernel, grid, block, shmem, stream, ...) \
  ::rocdraft_shim::launch(kernel, dim3(grid), dim3(block), (shmem), (stream), __VA_ARGS__)
