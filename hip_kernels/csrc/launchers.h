// Host-side interface of the kernels: parameter structs (passed to kernels by value) and the
// launch functions defined next to each kernel in the .hip sources. Plain C++ so that the
// torch binding (torch_ops.h) compiles with the host compiler and never sees device code.
// Every launcher returns 0 on success, or a nonzero hipError_t / kUnsupported.
#pragma once

#include <stdint.h>

namespace rocdraft {

constexpr int kUnsupported = -1;  // no kernel instantiated for this dtype / layout combination

// Element types as bit containers: fp16/bf16 are uint16_t, fp32 uint32_t, fp8 uint8_t.
enum ElemKind : int32_t { kF16 = 0, kBF16 = 1, kF32 = 2, kFp8E4M3FN = 3, kFp8E4M3FNUZ = 4 };
enum KvLayout : int32_t { kNHD = 0, kSplitK = 1 };

// Paged KV write of num_tokens rows (one block per token, threads over heads x 16-byte chunks).
struct WriteKvParams {
  const void* key;          // [>= num_tokens, num_kv_heads, head_dim], last dim contiguous
  const void* value;        // same shape as key
  void* key_cache;          // NHD [num_blocks, block_size, H, D] | split-K [nb, H, D/x, bs, x]
  void* value_cache;        // NHD [num_blocks, block_size, H, D] | split-K [nb, H, bs/x, D, x]
  const int64_t* slot_mapping;  // [num_tokens], slot < 0 is skipped
  const float* k_scale;     // fp8 caches: [1] or [num_kv_heads]; nullptr means 1.0
  const float* v_scale;
  int64_t k_scale_head_stride;  // 0 per tensor, 1 per head
  int64_t v_scale_head_stride;
  int64_t key_row_stride;   // elements between tokens
  int64_t key_head_stride;  // elements between heads
  int64_t value_row_stride;
  int64_t value_head_stride;
  int64_t num_tokens;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t block_size;
};

// input_kind: kF16 | kBF16 | kF32; cache_kind: the same kind (bit copy) or an fp8 kind
// (quantise). allow_vector = false forces the scalar path (tests run both on one input).
int launch_write_kv(const WriteKvParams& params, ElemKind input_kind, ElemKind cache_kind,
                    KvLayout layout, bool allow_vector, void* stream);

// True when the 16-byte vector path may be used for these pointers and strides.
bool write_kv_vector_ok(const WriteKvParams& params, ElemKind input_kind, ElemKind cache_kind);

// KV compaction after tree verification (see kv_compact.hip), one block per request.
struct CompactKvParams {
  void* key_cache;              // NHD [num_blocks, block_size, H, D] | split-K [nb, H, D/x, bs, x]
  void* value_cache;            // NHD [num_blocks, block_size, H, D] | split-K [nb, H, bs/x, D, x]
  const int32_t* block_table;   // [>= batch_size, max_blocks_per_seq]
  int64_t block_table_row_stride;
  int64_t max_blocks_per_seq;
  const int32_t* context_lens;  // [batch_size]: L, tokens cached before the step
  const int64_t* accepted_nodes;  // [batch_size, max_depth], -1 after the path
  int64_t accepted_row_stride;
  int64_t max_depth;
  const int64_t* num_accepted;  // [batch_size]
  int64_t batch_size;
  int64_t num_blocks;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t block_size;
};

// elem_bytes: the cache element size (1, 2 or 4; elements are copied as raw bits).
// allow_vector = false forces the scalar path (tests run both on one input).
int launch_compact_kv(const CompactKvParams& params, int elem_bytes, KvLayout layout,
                      bool allow_vector, void* stream);

// True when the 16-byte vector path may be used for these caches.
bool compact_kv_vector_ok(const CompactKvParams& params, int elem_bytes);

// In-place draft-step bookkeeping, one thread per request (see draft_step.hip).
struct AdvanceDraftStepParams {
  int64_t* positions;          // [batch_size] in: previous position, out: + 1 (unclamped)
  int32_t* seq_lens;           // [batch_size] in/out: + 1, or 1 where clamped
  const int32_t* block_table;  // [batch_size, max_blocks_per_seq]
  int64_t block_table_row_stride;
  int64_t max_blocks_per_seq;
  int64_t* clamped_positions;  // [batch_size] out: 0 where position >= max_model_len
  int64_t* slot_mapping;       // [batch_size] out: -1 where clamped
  int64_t batch_size;
  int64_t block_size;
  int64_t max_model_len;
};
int launch_advance_draft_step(const AdvanceDraftStepParams& params, void* stream);

// Fused prepare_next_token_ids_padded + prepare_inputs_padded, one thread per request.
struct PaddedDraftingParams {
  const int64_t* sampled;            // [batch_size, num_sampled] (k + 1 columns), -1 = rejected
  int64_t sampled_row_stride;
  int64_t num_sampled;
  const uint8_t* discard_request;    // [batch_size] bool
  const int64_t* backup_next_token_ids;  // [batch_size]
  int64_t vocab_size;
  const int32_t* query_start_loc;    // [batch_size + 1]
  const int32_t* num_draft_tokens;   // [batch_size]
  int64_t* next_token_ids;           // [batch_size] out
  int32_t* valid_sampled_count;      // [batch_size] out
  int64_t* token_indices_to_sample;  // [batch_size] out
  int64_t* num_rejected;             // [batch_size] out
  int64_t batch_size;
};
int launch_prepare_padded_drafting(const PaddedDraftingParams& params, void* stream);

// Elementwise float -> fp8 (the conversion of the KV write, exposed for exhaustive tests).
int launch_float_to_fp8(const float* input, uint8_t* output, int64_t numel, ElemKind fp8_kind,
                        void* stream);

}  // namespace rocdraft
