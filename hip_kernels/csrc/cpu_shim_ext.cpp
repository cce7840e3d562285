// CPU shim extension: the project's .hip kernels compiled by g++ through the serial launcher
// (shim/hip_cpu_shim.h) and registered as torch ops in namespace rocdraft_cpu_shim. Built by
// rocdraft.hip_kernels.build.load_cpu_shim() for tests of index math and bit patterns.
// Torch headers come first so the shim's macros (threadIdx, __global__, ...) cannot touch them.
#include "torch_ops.h"

#define ROCDRAFT_CPU_SHIM 1
#include "kv_write.hip"
#include "kv_compact.hip"
#include "draft_step.hip"
#include "padded_drafting.hip"
#include "fp8_convert.hip"

ROCDRAFT_REGISTER_OPS(rocdraft_cpu_shim)
