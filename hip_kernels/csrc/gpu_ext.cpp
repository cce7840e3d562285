// GPU extension, host part: torch op registrations (namespace rocdraft_hip). The kernels and
// their launchers come from the .hip sources (ROCm: compiled by hipcc) or from kernels.cu
// (CUDA: the same .hip sources through compat/hip_to_cuda.h). Built by
// rocdraft.hip_kernels.build.load_gpu_extension().
#include "torch_ops.h"

ROCDRAFT_REGISTER_OPS(rocdraft_hip)
