// Paged KV write: scatter each token's K/V rows to its cache slot, quantising to fp8 when the
// cache is fp8. Reference: backends/kv_cache.py write_kv_reference (bit-exact, see fp8.h).
//
// Layouts (x = 16 bytes / cache element size: 8 for fp16/bf16, 4 for fp32, 16 for fp8):
//   NHD      key/value [num_blocks, block_size, num_kv_heads, head_dim]
//   split-K  key   [num_blocks, num_kv_heads, head_dim / x, block_size, x]   (aiter pa_fwd_asm)
//            value [num_blocks, num_kv_heads, block_size / x, head_dim, x]
//
// Work split: one block per token (grid = num_tokens, read from slot_mapping), threads stride
// over (head, chunk of x consecutive head_dim elements). A chunk is exactly 16 cache bytes, so
// NHD rows and split-K key rows are stored with one 16-byte store; split-K value elements of
// one token are x elements apart and are stored one by one (as aiter does). The vector path
// also loads the input chunk with 16-byte loads; it needs 16-byte aligned rows, otherwise the
// scalar path runs. No shared memory, no barriers, no wavefront-size assumption.
//
// Bandwidth per token: 2 * num_kv_heads * head_dim * (input bytes + cache bytes), plus 8 bytes
// of slot; e.g. Llama-3-8B (8 kv heads x 128, bf16 -> fp8): 6 KiB per token and layer.
#include "platform.h"
#include "fp8.h"
#include "launchers.h"

namespace rocdraft {
namespace kv_write {

constexpr int kMaxThreads = 256;

template <ElemKind K> struct Bits;
template <> struct Bits<kF16> { using type = uint16_t; };
template <> struct Bits<kBF16> { using type = uint16_t; };
template <> struct Bits<kF32> { using type = uint32_t; };
template <> struct Bits<kFp8E4M3FN> { using type = uint8_t; };
template <> struct Bits<kFp8E4M3FNUZ> { using type = uint8_t; };

// N elements moved as whole 16-byte words (N * sizeof(T) is a multiple of 16 here).
template <typename T, int N>
struct alignas(16) Chunk {
  T v[N];
};

// One element: a bit copy when IN == CACHE, else x / scale rounded to fp8 (as torch does it).
template <ElemKind IN, ElemKind CACHE>
struct Convert {
  using In = typename Bits<IN>::type;
  using Out = typename Bits<CACHE>::type;
  static constexpr int kChunk = 16 / (int)sizeof(Out);  // x of the split-K layout

  __device__ __forceinline__ static Out apply(In bits, float scale) {
    if constexpr (CACHE != kFp8E4M3FN && CACHE != kFp8E4M3FNUZ) {
      return bits;
    } else {
      float f;
      if constexpr (IN == kF16) f = half_bits_to_float(bits);
      else if constexpr (IN == kBF16) f = bf16_bits_to_float(bits);
      else f = bits_to_float(bits);
      return float_to_fp8_sat<CACHE == kFp8E4M3FNUZ>(f / scale);
    }
  }
};

// Converts and stores elements [d0, d0 + x) of one head of one token.
template <class C, KvLayout LAYOUT, bool VEC, bool IS_VALUE>
__device__ __forceinline__ void write_chunk(const WriteKvParams& p, const typename C::In* src,
                                            typename C::Out* cache, const float* scale,
                                            int64_t scale_head_stride, int64_t block,
                                            int64_t offset, int64_t head, int d0) {
  using In = typename C::In;
  using Out = typename C::Out;
  constexpr int X = C::kChunk;
  const float s = scale == nullptr ? 1.0f : scale[head * scale_head_stride];
  const int64_t num_heads = p.num_kv_heads, head_dim = p.head_dim, block_size = p.block_size;

  Chunk<Out, X> out;
  if constexpr (VEC) {
    const Chunk<In, X> in = *reinterpret_cast<const Chunk<In, X>*>(src + d0);
    for (int i = 0; i < X; ++i) out.v[i] = C::apply(in.v[i], s);
  } else {
    for (int i = 0; i < X && d0 + i < head_dim; ++i) out.v[i] = C::apply(src[d0 + i], s);
  }

  if constexpr (LAYOUT == kSplitK && IS_VALUE) {
    // value[block, head, offset / x, d, offset % x]; head_dim % x == 0 in this layout
    Out* dst = cache + (((block * num_heads + head) * (block_size / X) + offset / X) * head_dim
                        + d0) * X + offset % X;
    for (int i = 0; i < X; ++i) dst[(int64_t)i * X] = out.v[i];
  } else {
    Out* dst;
    if constexpr (LAYOUT == kNHD) {  // [block, offset, head, d]
      dst = cache + ((block * block_size + offset) * num_heads + head) * head_dim + d0;
    } else {  // key[block, head, d / x, offset, d % x]
      dst = cache + (((block * num_heads + head) * (head_dim / X) + d0 / X) * block_size
                     + offset) * X;
    }
    if constexpr (VEC) {
      *reinterpret_cast<Chunk<Out, X>*>(dst) = out;
    } else {
      for (int i = 0; i < X && d0 + i < head_dim; ++i) dst[i] = out.v[i];
    }
  }
}

template <ElemKind IN, ElemKind CACHE, KvLayout LAYOUT, bool VEC>
__global__ void __launch_bounds__(kMaxThreads) write_kv_kernel(WriteKvParams p) {
  using C = Convert<IN, CACHE>;
  using In = typename C::In;
  using Out = typename C::Out;
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;  // PADDING_SLOT_ID: graph padding or a draft past max_model_len
  const int64_t block = slot / p.block_size;
  const int64_t offset = slot % p.block_size;
  const int chunks_per_head = (p.head_dim + C::kChunk - 1) / C::kChunk;
  const int num_work = p.num_kv_heads * chunks_per_head;
  for (int work = threadIdx.x; work < num_work; work += blockDim.x) {
    const int64_t head = work / chunks_per_head;
    const int d0 = (work - (int)head * chunks_per_head) * C::kChunk;
    const In* key = static_cast<const In*>(p.key) + token * p.key_row_stride
                    + head * p.key_head_stride;
    const In* value = static_cast<const In*>(p.value) + token * p.value_row_stride
                      + head * p.value_head_stride;
    write_chunk<C, LAYOUT, VEC, false>(p, key, static_cast<Out*>(p.key_cache), p.k_scale,
                                       p.k_scale_head_stride, block, offset, head, d0);
    write_chunk<C, LAYOUT, VEC, true>(p, value, static_cast<Out*>(p.value_cache), p.v_scale,
                                      p.v_scale_head_stride, block, offset, head, d0);
  }
}

inline int elem_size(ElemKind kind) {
  return kind == kF32 ? 4 : (kind == kF16 || kind == kBF16) ? 2 : 1;
}

template <ElemKind IN, ElemKind CACHE, KvLayout LAYOUT>
int launch_layout(const WriteKvParams& p, bool vec, hipStream_t stream) {
  constexpr int X = Convert<IN, CACHE>::kChunk;
  const int num_work = p.num_kv_heads * ((p.head_dim + X - 1) / X);
  int threads = (num_work + 63) / 64 * 64;  // whole 64-wide wavefronts (two 32-wide warps)
  threads = threads > kMaxThreads ? kMaxThreads : threads;
  const dim3 grid((unsigned int)p.num_tokens);
  const dim3 block((unsigned int)threads);
  if (vec) {
    hipLaunchKernelGGL((write_kv_kernel<IN, CACHE, LAYOUT, true>), grid, block, 0, stream, p);
  } else {
    hipLaunchKernelGGL((write_kv_kernel<IN, CACHE, LAYOUT, false>), grid, block, 0, stream, p);
  }
  return (int)hipGetLastError();
}

template <ElemKind IN, ElemKind CACHE>
int launch_typed(const WriteKvParams& p, KvLayout layout, bool vec, hipStream_t stream) {
  if (layout == kNHD) return launch_layout<IN, CACHE, kNHD>(p, vec, stream);
  if (layout == kSplitK) return launch_layout<IN, CACHE, kSplitK>(p, vec, stream);
  return kUnsupported;
}

template <ElemKind CACHE>
int launch_quantized(const WriteKvParams& p, ElemKind input_kind, KvLayout layout, bool vec,
                     hipStream_t stream) {
  switch (input_kind) {
    case kF16: return launch_typed<kF16, CACHE>(p, layout, vec, stream);
    case kBF16: return launch_typed<kBF16, CACHE>(p, layout, vec, stream);
    case kF32: return launch_typed<kF32, CACHE>(p, layout, vec, stream);
    default: return kUnsupported;
  }
}

}  // namespace kv_write

bool write_kv_vector_ok(const WriteKvParams& p, ElemKind input_kind, ElemKind cache_kind) {
  const int64_t in_size = kv_write::elem_size(input_kind);
  const int64_t x = 16 / kv_write::elem_size(cache_kind);
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  auto stride_ok = [in_size](int64_t stride) { return (stride * in_size) % 16 == 0; };
  return p.head_dim % x == 0 && aligned(p.key) && aligned(p.value) && aligned(p.key_cache)
         && aligned(p.value_cache) && stride_ok(p.key_row_stride) && stride_ok(p.key_head_stride)
         && stride_ok(p.value_row_stride) && stride_ok(p.value_head_stride);
}

int launch_write_kv(const WriteKvParams& p, ElemKind input_kind, ElemKind cache_kind,
                    KvLayout layout, bool allow_vector, void* stream) {
  if (p.num_tokens == 0 || p.num_kv_heads == 0 || p.head_dim == 0) return 0;
  const bool vec = allow_vector && write_kv_vector_ok(p, input_kind, cache_kind);
  hipStream_t s = static_cast<hipStream_t>(stream);
  using namespace kv_write;
  if (cache_kind == kFp8E4M3FN) return launch_quantized<kFp8E4M3FN>(p, input_kind, layout, vec, s);
  if (cache_kind == kFp8E4M3FNUZ) {
    return launch_quantized<kFp8E4M3FNUZ>(p, input_kind, layout, vec, s);
  }
  if (input_kind != cache_kind) return kUnsupported;
  switch (cache_kind) {
    case kF16: return launch_typed<kF16, kF16>(p, layout, vec, s);
    case kBF16: return launch_typed<kBF16, kBF16>(p, layout, vec, s);
    case kF32: return launch_typed<kF32, kF32>(p, layout, vec, s);
    default: return kUnsupported;
  }
}

}  // namespace rocdraft
