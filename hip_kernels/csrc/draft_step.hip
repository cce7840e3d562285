// Fused draft-step bookkeeping, in place, one thread per request.
// Reference: drafter/index_math.py advance_draft_step (equal element for element).
//
//   positions[i]         += 1                       (unclamped, kept for the next step)
//   exceeds               = positions[i] >= max_model_len
//   clamped_positions[i]  = exceeds ? 0 : positions[i]
//   slot_mapping[i]       = exceeds ? -1 : block_table[i, min(c / block_size, max_blocks - 1)]
//                                          * block_size + c % block_size   (c = clamped)
//   seq_lens[i]           = exceeds ? 1 : seq_lens[i] + 1
//
// Example, block_size 4, max_model_len 10, block_table [[3, 7, 1], [2, 5, 6]]:
// positions [4, 9], seq_lens [5, 10] -> positions [5, 10], clamped [5, 0], slots [29, -1],
// seq_lens [6, 1]. Graph padding rows carry a position >= max_model_len and stay clamped.
#include "platform.h"
#include "launchers.h"

namespace rocdraft {
namespace draft_step {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) advance_draft_step_kernel(AdvanceDraftStepParams p) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.batch_size) return;
  const int64_t position = p.positions[i] + 1;
  p.positions[i] = position;
  const bool exceeds = position >= p.max_model_len;
  const int64_t clamped = exceeds ? 0 : position;
  int64_t column = clamped / p.block_size;
  column = column > p.max_blocks_per_seq - 1 ? p.max_blocks_per_seq - 1 : column;
  column = column < 0 ? 0 : column;  // memory safety only: positions are >= 0
  const int64_t block_id = p.block_table[i * p.block_table_row_stride + column];
  p.clamped_positions[i] = clamped;
  p.slot_mapping[i] = exceeds ? -1 : block_id * p.block_size + clamped % p.block_size;
  p.seq_lens[i] = exceeds ? 1 : p.seq_lens[i] + 1;
}

}  // namespace draft_step

int launch_advance_draft_step(const AdvanceDraftStepParams& p, void* stream) {
  if (p.batch_size == 0) return 0;
  using draft_step::kThreads;
  const dim3 grid((unsigned int)((p.batch_size + kThreads - 1) / kThreads));
  hipLaunchKernelGGL(draft_step::advance_draft_step_kernel, grid, dim3(kThreads), 0,
                     static_cast<hipStream_t>(stream), p);
  return (int)hipGetLastError();
}

}  // namespace rocdraft
