// Fused prepare_next_token_ids_padded + prepare_inputs_padded, one thread per request, no
// host sync. Reference: drafter/index_math.py (the two functions chained; equal per element).
//
//   valid_sampled_count[i]     = discard[i] ? 0 : #{j : 0 <= sampled[i, j] < vocab_size}
//   next_token_ids[i]          = count > 0 ? sampled[i, count - 1] : backup_next_token_ids[i]
//   num_rejected[i]            = min(num_draft_tokens[i] + 1 - count, num_draft_tokens[i])
//   token_indices_to_sample[i] = query_start_loc[i + 1] - 1 - num_rejected[i]
// (count is in [1, d + 1] for a request that verified d > 0 drafts and 0 or 1 for one that
// verified none, so the min is the rejected count in both cases; a discarded request, count 0,
// gets d.)
//
// Example: sampled [[5, 7, -1], [-1, -1, -1], [4, 2, 9]], discard [F, F, T], backup [1, 2, 3],
// query_start_loc [0, 3, 4, 8], num_draft_tokens [2, 0, 3]
// -> next [7, 2, 3], count [2, 0, 0], rejected [1, 0, 3], indices [1, 3, 4].
#include "platform.h"
#include "launchers.h"

namespace rocdraft {
namespace padded_drafting {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) prepare_padded_drafting_kernel(PaddedDraftingParams p) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.batch_size) return;
  const int64_t* row = p.sampled + i * p.sampled_row_stride;
  int32_t count = 0;
  for (int64_t j = 0; j < p.num_sampled; ++j) {
    const int64_t token = row[j];
    count += (token >= 0 && token < p.vocab_size) ? 1 : 0;
  }
  if (p.discard_request[i]) count = 0;
  // Accepted tokens form a prefix, so the last one sits at count - 1.
  p.next_token_ids[i] = count > 0 ? row[count - 1] : p.backup_next_token_ids[i];
  p.valid_sampled_count[i] = count;
  const int64_t drafts = p.num_draft_tokens[i];
  const int64_t rejected_if_verified = drafts + 1 - count;
  const int64_t rejected = rejected_if_verified < drafts ? rejected_if_verified : drafts;
  p.num_rejected[i] = rejected;
  p.token_indices_to_sample[i] = (int64_t)p.query_start_loc[i + 1] - 1 - rejected;
}

}  // namespace padded_drafting

int launch_prepare_padded_drafting(const PaddedDraftingParams& p, void* stream) {
  if (p.batch_size == 0) return 0;
  using padded_drafting::kThreads;
  const dim3 grid((unsigned int)((p.batch_size + kThreads - 1) / kThreads));
  hipLaunchKernelGGL(padded_drafting::prepare_padded_drafting_kernel, grid, dim3(kThreads), 0,
                     static_cast<hipStream_t>(stream), p);
  return (int)hipGetLastError();
}

}  // namespace rocdraft
