// nvcc entry point: the HIP-dialect kernels compiled for NVIDIA GPUs. platform.h sees
// __NVCC__ and includes compat/hip_to_cuda.h instead of hip/hip_runtime.h.
#include "kv_write.hip"
#include "kv_compact.hip"
#include "draft_step.hip"
#include "padded_drafting.hip"
#include "fp8_convert.hip"
