// Elementwise float -> fp8 e4m3 (fn or fnuz), saturating, round-to-nearest-even: the
// conversion the KV write applies after dividing by the scale, exposed on its own so tests can
// compare it bit-for-bit with torch over many float32 patterns. Grid-stride loop.
#include "platform.h"
#include "fp8.h"
#include "launchers.h"

namespace rocdraft {
namespace fp8_convert {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;

template <bool FNUZ>
__global__ void __launch_bounds__(kThreads) float_to_fp8_kernel(const float* input,
                                                                 uint8_t* output, int64_t numel) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += stride) {
    output[i] = float_to_fp8_sat<FNUZ>(input[i]);
  }
}

}  // namespace fp8_convert

int launch_float_to_fp8(const float* input, uint8_t* output, int64_t numel, ElemKind fp8_kind,
                        void* stream) {
  if (numel == 0) return 0;
  using namespace fp8_convert;
  int64_t blocks = (numel + kThreads - 1) / kThreads;
  blocks = blocks > kMaxBlocks ? kMaxBlocks : blocks;
  const dim3 grid((unsigned int)blocks);
  hipStream_t s = static_cast<hipStream_t>(stream);
  if (fp8_kind == kFp8E4M3FN) {
    hipLaunchKernelGGL((float_to_fp8_kernel<false>), grid, dim3(kThreads), 0, s, input, output,
                       numel);
  } else if (fp8_kind == kFp8E4M3FNUZ) {
    hipLaunchKernelGGL((float_to_fp8_kernel<true>), grid, dim3(kThreads), 0, s, input, output,
                       numel);
  } else {
    return kUnsupported;
  }
  return (int)hipGetLastError();
}

}  // namespace rocdraft
