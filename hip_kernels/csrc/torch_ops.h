// Torch bindings of the kernel launchers, shared by the GPU extension (gpu_ext.cpp) and the
// CPU shim extension (cpu_shim_ext.cpp). Host code only: it sees launchers.h, never a kernel.
//
// The Python layer (rocdraft.hip_kernels.ops) validates every argument and raises ValueError;
// the TORCH_CHECKs here only guard memory safety. Outputs are passed in (out arguments) so no
// allocation happens here, and the stream is passed as an integer (torch.cuda.current_stream()
// .cuda_stream; 0 on the CPU) so this file needs no CUDA/HIP headers.
//
// ROCDRAFT_REGISTER_OPS(ns) defines, in namespace ns:
//   write_kv(key, value, key_cache!, value_cache!, slot_mapping, k_scale?, v_scale?,
//            int layout, bool allow_vector, int stream)
//   advance_draft_step(positions!, seq_lens!, block_table, clamped_positions!, slot_mapping!,
//                      int block_size, int max_model_len, int stream)
//   prepare_padded_drafting(sampled, discard_request, backup_next_token_ids, int vocab_size,
//                           query_start_loc, num_draft_tokens, next_token_ids!,
//                           valid_sampled_count!, token_indices_to_sample!, num_rejected!,
//                           int stream)
//   write_kv_vector_ok(key, value, key_cache, value_cache, slot_mapping, int layout) -> bool
//   float_to_fp8(input, output!, int fp8_kind, int stream)
//   compact_kv(key_cache!, value_cache!, block_table, context_lens, accepted_nodes,
//              num_accepted, int layout, bool allow_vector, int stream)
//   compact_kv_vector_ok(key_cache, value_cache, int layout) -> bool
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>

#include "launchers.h"

namespace rocdraft {
namespace binding {

inline ElemKind elem_kind(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    case at::kFloat: return kF32;
    case at::kFloat8_e4m3fn: return kFp8E4M3FN;
    case at::kFloat8_e4m3fnuz: return kFp8E4M3FNUZ;
    default: TORCH_CHECK(false, "rocdraft kernels: unsupported dtype ", t.scalar_type());
  }
}

// hipErrorInvalidDeviceFunction / hipErrorNoBinaryForGpu (the same numbers as CUDA's
// cudaErrorInvalidDeviceFunction / cudaErrorNoKernelImageForDevice): the extension holds no code
// object for this GPU's arch. rocdraft.hip_kernels.dispatch matches this message and falls back.
constexpr int kInvalidDeviceFunction = 98;
constexpr int kNoBinaryForGpu = 209;

inline void check_launch(int code, const char* op) {
  TORCH_CHECK(code != kUnsupported, op, ": no kernel for this dtype/layout combination");
  TORCH_CHECK(code != kInvalidDeviceFunction && code != kNoBinaryForGpu, op,
              ": no kernel image for this GPU (error ", code,
              ": invalid device function / no kernel image); the extension was built for "
              "other archs");
  TORCH_CHECK(code == 0, op, ": kernel launch failed with error ", code);
}

// Innermost stride 1, or empty: an empty tensor's strides carry no meaning (torch.where gives
// a [0, 1] tensor strides (1, 0)), and no kernel reads it.
inline bool rows_contiguous(const at::Tensor& t) {
  return t.numel() == 0 || t.stride(t.dim() - 1) == 1;
}

inline void check_1d(const at::Tensor& t, at::ScalarType dtype, int64_t size, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == size && t.scalar_type() == dtype && t.is_contiguous(),
              name, ": expected contiguous [", size, "] ", dtype, ", got ", t.sizes(), " ",
              t.scalar_type());
}

inline const float* scale_ptr(const std::optional<at::Tensor>& scale, int64_t num_kv_heads,
                              int64_t* head_stride) {
  *head_stride = 0;
  if (!scale.has_value()) return nullptr;
  const at::Tensor& s = *scale;
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous()
                  && (s.numel() == 1 || s.numel() == num_kv_heads),
              "write_kv: scale must be contiguous float32 [1] or [num_kv_heads]");
  *head_stride = s.numel() == 1 ? 0 : 1;
  return static_cast<const float*>(s.data_ptr());
}

inline WriteKvParams make_write_kv_params(const at::Tensor& key, const at::Tensor& value,
                                          const at::Tensor& key_cache,
                                          const at::Tensor& value_cache,
                                          const at::Tensor& slot_mapping,
                                          const std::optional<at::Tensor>& k_scale,
                                          const std::optional<at::Tensor>& v_scale,
                                          int64_t layout) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "write_kv: key/value shapes");
  TORCH_CHECK(rows_contiguous(key) && rows_contiguous(value), "write_kv: head_dim not contiguous");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "write_kv: key/value dtypes differ");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "write_kv: caches must be contiguous");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "write_kv: cache dtypes");
  check_1d(slot_mapping, at::kLong, slot_mapping.numel(), "write_kv: slot_mapping");
  TORCH_CHECK(key.size(0) >= slot_mapping.numel(), "write_kv: fewer rows than slots");
  const bool nhd = layout == kNHD;
  TORCH_CHECK(nhd || layout == kSplitK, "write_kv: unknown layout ", layout);
  TORCH_CHECK(key_cache.dim() == (nhd ? 4 : 5), "write_kv: cache rank does not match layout");
  WriteKvParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.slot_mapping = static_cast<const int64_t*>(slot_mapping.data_ptr());
  p.num_kv_heads = static_cast<int32_t>(key.size(1));
  p.head_dim = static_cast<int32_t>(key.size(2));
  p.block_size = static_cast<int32_t>(nhd ? key_cache.size(1) : key_cache.size(3));
  p.k_scale = scale_ptr(k_scale, p.num_kv_heads, &p.k_scale_head_stride);
  p.v_scale = scale_ptr(v_scale, p.num_kv_heads, &p.v_scale_head_stride);
  p.key_row_stride = key.stride(0);
  p.key_head_stride = key.stride(1);
  p.value_row_stride = value.stride(0);
  p.value_head_stride = value.stride(1);
  p.num_tokens = slot_mapping.numel();
  return p;
}

inline void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                     const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale, int64_t layout, bool allow_vector,
                     int64_t stream) {
  const WriteKvParams p = make_write_kv_params(key, value, key_cache, value_cache, slot_mapping,
                                               k_scale, v_scale, layout);
  check_launch(launch_write_kv(p, elem_kind(key), elem_kind(key_cache),
                               static_cast<KvLayout>(layout), allow_vector,
                               reinterpret_cast<void*>(stream)),
               "write_kv");
}

// Whether write_kv would take the 16-byte vector path for these tensors (for tests).
inline bool write_kv_vector_ok_op(const at::Tensor& key, const at::Tensor& value,
                                  const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& slot_mapping, int64_t layout) {
  const WriteKvParams p = make_write_kv_params(key, value, key_cache, value_cache, slot_mapping,
                                               std::nullopt, std::nullopt, layout);
  return write_kv_vector_ok(p, elem_kind(key), elem_kind(key_cache));
}

inline void advance_draft_step(const at::Tensor& positions, const at::Tensor& seq_lens,
                               const at::Tensor& block_table, const at::Tensor& clamped_positions,
                               const at::Tensor& slot_mapping, int64_t block_size,
                               int64_t max_model_len, int64_t stream) {
  const int64_t batch_size = positions.numel();
  check_1d(positions, at::kLong, batch_size, "advance_draft_step: positions");
  check_1d(seq_lens, at::kInt, batch_size, "advance_draft_step: seq_lens");
  check_1d(clamped_positions, at::kLong, batch_size, "advance_draft_step: clamped_positions");
  check_1d(slot_mapping, at::kLong, batch_size, "advance_draft_step: slot_mapping");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) >= batch_size
                  && block_table.size(1) > 0 && rows_contiguous(block_table)
                  && block_table.scalar_type() == at::kInt,
              "advance_draft_step: block_table must be int32 [>= batch_size, > 0]");
  TORCH_CHECK(block_size > 0, "advance_draft_step: block_size must be positive");
  AdvanceDraftStepParams p{};
  p.positions = static_cast<int64_t*>(positions.data_ptr());
  p.seq_lens = static_cast<int32_t*>(seq_lens.data_ptr());
  p.block_table = static_cast<const int32_t*>(block_table.data_ptr());
  p.block_table_row_stride = block_table.stride(0);
  p.max_blocks_per_seq = block_table.size(1);
  p.clamped_positions = static_cast<int64_t*>(clamped_positions.data_ptr());
  p.slot_mapping = static_cast<int64_t*>(slot_mapping.data_ptr());
  p.batch_size = batch_size;
  p.block_size = block_size;
  p.max_model_len = max_model_len;
  check_launch(launch_advance_draft_step(p, reinterpret_cast<void*>(stream)),
               "advance_draft_step");
}

inline void prepare_padded_drafting(const at::Tensor& sampled, const at::Tensor& discard_request,
                                    const at::Tensor& backup_next_token_ids, int64_t vocab_size,
                                    const at::Tensor& query_start_loc,
                                    const at::Tensor& num_draft_tokens,
                                    const at::Tensor& next_token_ids,
                                    const at::Tensor& valid_sampled_count,
                                    const at::Tensor& token_indices_to_sample,
                                    const at::Tensor& num_rejected, int64_t stream) {
  TORCH_CHECK(sampled.dim() == 2 && rows_contiguous(sampled) && sampled.scalar_type() == at::kLong,
              "prepare_padded_drafting: sampled must be int64 [batch_size, k + 1]");
  const int64_t batch_size = sampled.size(0);
  check_1d(discard_request, at::kBool, batch_size, "prepare_padded_drafting: discard_request");
  check_1d(backup_next_token_ids, at::kLong, batch_size, "prepare_padded_drafting: backup");
  check_1d(query_start_loc, at::kInt, batch_size + 1, "prepare_padded_drafting: query_start_loc");
  check_1d(num_draft_tokens, at::kInt, batch_size, "prepare_padded_drafting: num_draft_tokens");
  check_1d(next_token_ids, at::kLong, batch_size, "prepare_padded_drafting: next_token_ids");
  check_1d(valid_sampled_count, at::kInt, batch_size, "prepare_padded_drafting: valid count");
  check_1d(token_indices_to_sample, at::kLong, batch_size, "prepare_padded_drafting: indices");
  check_1d(num_rejected, at::kLong, batch_size, "prepare_padded_drafting: num_rejected");
  PaddedDraftingParams p{};
  p.sampled = static_cast<const int64_t*>(sampled.data_ptr());
  p.sampled_row_stride = sampled.stride(0);
  p.num_sampled = sampled.size(1);
  p.discard_request = static_cast<const uint8_t*>(discard_request.data_ptr());
  p.backup_next_token_ids = static_cast<const int64_t*>(backup_next_token_ids.data_ptr());
  p.vocab_size = vocab_size;
  p.query_start_loc = static_cast<const int32_t*>(query_start_loc.data_ptr());
  p.num_draft_tokens = static_cast<const int32_t*>(num_draft_tokens.data_ptr());
  p.next_token_ids = static_cast<int64_t*>(next_token_ids.data_ptr());
  p.valid_sampled_count = static_cast<int32_t*>(valid_sampled_count.data_ptr());
  p.token_indices_to_sample = static_cast<int64_t*>(token_indices_to_sample.data_ptr());
  p.num_rejected = static_cast<int64_t*>(num_rejected.data_ptr());
  p.batch_size = batch_size;
  check_launch(launch_prepare_padded_drafting(p, reinterpret_cast<void*>(stream)),
               "prepare_padded_drafting");
}

inline void float_to_fp8(const at::Tensor& input, const at::Tensor& output, int64_t fp8_kind,
                         int64_t stream) {
  check_1d(input, at::kFloat, input.numel(), "float_to_fp8: input");
  check_1d(output, at::kByte, input.numel(), "float_to_fp8: output");
  check_launch(launch_float_to_fp8(static_cast<const float*>(input.data_ptr()),
                                   static_cast<uint8_t*>(output.data_ptr()), input.numel(),
                                   static_cast<ElemKind>(fp8_kind),
                                   reinterpret_cast<void*>(stream)),
               "float_to_fp8");
}

inline CompactKvParams make_compact_kv_params(const at::Tensor& key_cache,
                                              const at::Tensor& value_cache,
                                              const at::Tensor& block_table,
                                              const at::Tensor& context_lens,
                                              const at::Tensor& accepted_nodes,
                                              const at::Tensor& num_accepted, int64_t layout) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "compact_kv: caches must be contiguous");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "compact_kv: cache dtypes");
  const bool nhd = layout == kNHD;
  TORCH_CHECK(nhd || layout == kSplitK, "compact_kv: unknown layout ", layout);
  TORCH_CHECK(key_cache.dim() == (nhd ? 4 : 5) && value_cache.dim() == key_cache.dim(),
              "compact_kv: cache rank does not match layout");
  if (nhd) {
    TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "compact_kv: cache shapes differ");
  } else {  // key [nb, H, D/x, bs, x], value [nb, H, bs/x, D, x], x = 16 bytes
    const int64_t x = 16 / key_cache.element_size();
    TORCH_CHECK(key_cache.size(4) == x && value_cache.size(4) == x
                    && key_cache.size(0) == value_cache.size(0)
                    && key_cache.size(1) == value_cache.size(1)
                    && key_cache.size(2) * x == value_cache.size(3)
                    && value_cache.size(2) * x == key_cache.size(3),
                "compact_kv: split-K cache shapes do not match");
  }
  TORCH_CHECK(accepted_nodes.dim() == 2 && rows_contiguous(accepted_nodes)
                  && accepted_nodes.scalar_type() == at::kLong,
              "compact_kv: accepted_nodes must be int64 [batch_size, max_depth]");
  const int64_t batch_size = accepted_nodes.size(0);
  check_1d(context_lens, at::kInt, batch_size, "compact_kv: context_lens");
  check_1d(num_accepted, at::kLong, batch_size, "compact_kv: num_accepted");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) >= batch_size
                  && block_table.size(1) > 0 && rows_contiguous(block_table)
                  && block_table.scalar_type() == at::kInt,
              "compact_kv: block_table must be int32 [>= batch_size, > 0]");
  CompactKvParams p{};
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.block_table = static_cast<const int32_t*>(block_table.data_ptr());
  p.block_table_row_stride = block_table.stride(0);
  p.max_blocks_per_seq = block_table.size(1);
  p.context_lens = static_cast<const int32_t*>(context_lens.data_ptr());
  p.accepted_nodes = static_cast<const int64_t*>(accepted_nodes.data_ptr());
  p.accepted_row_stride = accepted_nodes.stride(0);
  p.max_depth = accepted_nodes.size(1);
  p.num_accepted = static_cast<const int64_t*>(num_accepted.data_ptr());
  p.batch_size = batch_size;
  p.num_blocks = key_cache.size(0);
  p.num_kv_heads = static_cast<int32_t>(nhd ? key_cache.size(2) : key_cache.size(1));
  p.head_dim = static_cast<int32_t>(nhd ? key_cache.size(3) : value_cache.size(3));
  p.block_size = static_cast<int32_t>(nhd ? key_cache.size(1) : key_cache.size(3));
  return p;
}

inline void compact_kv(const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& block_table, const at::Tensor& context_lens,
                       const at::Tensor& accepted_nodes, const at::Tensor& num_accepted,
                       int64_t layout, bool allow_vector, int64_t stream) {
  const CompactKvParams p = make_compact_kv_params(key_cache, value_cache, block_table,
                                                   context_lens, accepted_nodes, num_accepted,
                                                   layout);
  check_launch(launch_compact_kv(p, static_cast<int>(key_cache.element_size()),
                                 static_cast<KvLayout>(layout), allow_vector,
                                 reinterpret_cast<void*>(stream)),
               "compact_kv");
}

// Whether compact_kv would take the 16-byte vector path for these caches (for tests).
inline bool compact_kv_vector_ok_op(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                    int64_t layout) {
  const bool nhd = layout == kNHD;
  TORCH_CHECK(key_cache.dim() == (nhd ? 4 : 5) && value_cache.dim() == key_cache.dim(),
              "compact_kv_vector_ok: cache rank does not match layout");
  CompactKvParams p{};
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.head_dim = static_cast<int32_t>(nhd ? key_cache.size(3) : value_cache.size(3));
  return compact_kv_vector_ok(p, static_cast<int>(key_cache.element_size()));
}

}  // namespace binding
}  // namespace rocdraft

#define ROCDRAFT_REGISTER_OPS(ns)                                                              \
  TORCH_LIBRARY(ns, m) {                                                                       \
    m.def("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "  \
          "Tensor slot_mapping, Tensor? k_scale, Tensor? v_scale, int layout, "                \
          "bool allow_vector, int stream) -> ()",                                              \
          &rocdraft::binding::write_kv);                                                       \
    m.def("write_kv_vector_ok(Tensor key, Tensor value, Tensor key_cache, Tensor value_cache, " \
          "Tensor slot_mapping, int layout) -> bool",                                          \
          &rocdraft::binding::write_kv_vector_ok_op);                                          \
    m.def("advance_draft_step(Tensor(a!) positions, Tensor(b!) seq_lens, Tensor block_table, " \
          "Tensor(c!) clamped_positions, Tensor(d!) slot_mapping, int block_size, "            \
          "int max_model_len, int stream) -> ()",                                              \
          &rocdraft::binding::advance_draft_step);                                             \
    m.def("prepare_padded_drafting(Tensor sampled, Tensor discard_request, "                  \
          "Tensor backup_next_token_ids, int vocab_size, Tensor query_start_loc, "            \
          "Tensor num_draft_tokens, Tensor(a!) next_token_ids, "                               \
          "Tensor(b!) valid_sampled_count, Tensor(c!) token_indices_to_sample, "               \
          "Tensor(d!) num_rejected, int stream) -> ()",                                        \
          &rocdraft::binding::prepare_padded_drafting);                                        \
    m.def("float_to_fp8(Tensor input, Tensor(a!) output, int fp8_kind, int stream) -> ()",     \
          &rocdraft::binding::float_to_fp8);                                                   \
    m.def("compact_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor block_table, "    \
          "Tensor context_lens, Tensor accepted_nodes, Tensor num_accepted, int layout, "      \
          "bool allow_vector, int stream) -> ()",                                              \
          &rocdraft::binding::compact_kv);                                                     \
    m.def("compact_kv_vector_ok(Tensor key_cache, Tensor value_cache, int layout) -> bool",    \
          &rocdraft::binding::compact_kv_vector_ok_op);                                        \
  }
