// KV compaction after tree verification: move each request's accepted path to consecutive
// sequence positions, raw bytes, both layouts. Reference and contract: backends/kv_compact.py
// (compact_kv_reference; bit-exact).
//
// For d = 1 .. num_accepted[b]: seq index L + 1 + accepted_nodes[b, d - 1] -> L + d (L =
// context_lens[b]), slot = block_table[b, idx / block_size] * block_size + idx % block_size.
// A move runs only when valid: d <= min(num_accepted, D), L >= 0, accepted_nodes >= d - 1
// (source at or after the destination), block columns < max_blocks, block ids in
// [0, num_blocks), source != destination.
//
// Work split: one block per request, threads stride over (head, chunk of x = 16 / element size
// consecutive head_dim elements); each thread walks the moves in increasing d for its chunks.
// A valid move never reads a slot an earlier move wrote, and a slot read by move d and written
// by a later move is read first by the same thread, so this in-order walk equals "read every
// source, then write" with no shared memory and no barrier (and any serial order of the
// threads, as the CPU shim runs them, gives the same bytes). NHD chunks and split-K key chunks
// are 16 contiguous bytes (one 16-byte load and store on the vector path); split-K value
// elements of one token are x elements apart and are copied one by one.
//
// Bandwidth per accepted token and layer: 2 (K, V) * 2 (read, write) * num_kv_heads * head_dim
// * element size, plus the request's indices.
#include "platform.h"
#include "launchers.h"

namespace rocdraft {
namespace kv_compact {

constexpr int kMaxThreads = 256;

template <typename T, int N>
struct alignas(16) Chunk {
  T v[N];
};

// Elements [d0, d0 + x) of one head: source slot (sb, so) -> destination slot (db, dn).
template <typename T, KvLayout LAYOUT, bool VEC, bool IS_VALUE>
__device__ __forceinline__ void move_chunk(const CompactKvParams& p, T* cache, int64_t sb,
                                           int64_t so, int64_t db, int64_t dn, int64_t head,
                                           int d0) {
  constexpr int X = 16 / (int)sizeof(T);
  const int64_t num_heads = p.num_kv_heads, head_dim = p.head_dim, block_size = p.block_size;
  if constexpr (LAYOUT == kSplitK && IS_VALUE) {
    // value[block, head, offset / x, d, offset % x]; head_dim % x == 0 in this layout
    auto at = [&](int64_t block, int64_t offset) {
      return cache + (((block * num_heads + head) * (block_size / X) + offset / X) * head_dim
                      + d0) * X + offset % X;
    };
    const T* src = at(sb, so);
    T* dst = at(db, dn);
    for (int i = 0; i < X; ++i) dst[(int64_t)i * X] = src[(int64_t)i * X];
  } else {
    auto at = [&](int64_t block, int64_t offset) {
      if constexpr (LAYOUT == kNHD) {  // [block, offset, head, d]
        return cache + ((block * block_size + offset) * num_heads + head) * head_dim + d0;
      } else {  // key[block, head, d / x, offset, d % x]
        return cache + (((block * num_heads + head) * (head_dim / X) + d0 / X) * block_size
                        + offset) * X;
      }
    };
    const T* src = at(sb, so);
    T* dst = at(db, dn);
    if constexpr (VEC) {
      *reinterpret_cast<Chunk<T, X>*>(dst) = *reinterpret_cast<const Chunk<T, X>*>(src);
    } else {
      for (int i = 0; i < X && d0 + i < head_dim; ++i) dst[i] = src[i];
    }
  }
}

// Block id of sequence index idx of the request, or -1 when the column or id is out of range.
__device__ __forceinline__ int64_t block_of(const CompactKvParams& p, const int32_t* table,
                                            int64_t idx) {
  const int64_t column = idx / p.block_size;
  if (column >= p.max_blocks_per_seq) return -1;
  const int64_t block = table[column];
  return block >= 0 && block < p.num_blocks ? block : -1;
}

template <typename T, KvLayout LAYOUT, bool VEC>
__global__ void __launch_bounds__(kMaxThreads) compact_kv_kernel(CompactKvParams p) {
  constexpr int X = 16 / (int)sizeof(T);
  const int64_t req = blockIdx.x;
  const int64_t context = p.context_lens[req];
  if (context < 0) return;
  int64_t count = p.num_accepted[req];
  count = count < p.max_depth ? count : p.max_depth;
  const int32_t* table = p.block_table + req * p.block_table_row_stride;
  const int64_t* nodes = p.accepted_nodes + req * p.accepted_row_stride;
  const int chunks_per_head = (p.head_dim + X - 1) / X;
  const int num_work = p.num_kv_heads * chunks_per_head;
  for (int64_t step = 0; step < count; ++step) {  // step = d - 1, in increasing order
    const int64_t node = nodes[step];
    if (node < step || node == step) continue;  // source before the destination, or a no-op
    const int64_t src = context + 1 + node, dst = context + 1 + step;
    if (src / p.block_size >= p.max_blocks_per_seq) continue;
    const int64_t sb = block_of(p, table, src), db = block_of(p, table, dst);
    if (sb < 0 || db < 0) continue;
    const int64_t so = src % p.block_size, dn = dst % p.block_size;
    for (int work = threadIdx.x; work < num_work; work += blockDim.x) {
      const int64_t head = work / chunks_per_head;
      const int d0 = (work - (int)head * chunks_per_head) * X;
      move_chunk<T, LAYOUT, VEC, false>(p, static_cast<T*>(p.key_cache), sb, so, db, dn, head,
                                        d0);
      move_chunk<T, LAYOUT, VEC, true>(p, static_cast<T*>(p.value_cache), sb, so, db, dn, head,
                                       d0);
    }
  }
}

template <typename T, KvLayout LAYOUT>
int launch_layout(const CompactKvParams& p, bool vec, hipStream_t stream) {
  constexpr int X = 16 / (int)sizeof(T);
  const int num_work = p.num_kv_heads * ((p.head_dim + X - 1) / X);
  int threads = (num_work + 63) / 64 * 64;  // whole 64-wide wavefronts (two 32-wide warps)
  threads = threads > kMaxThreads ? kMaxThreads : threads;
  const dim3 grid((unsigned int)p.batch_size);
  const dim3 block((unsigned int)threads);
  if (vec) {
    hipLaunchKernelGGL((compact_kv_kernel<T, LAYOUT, true>), grid, block, 0, stream, p);
  } else {
    hipLaunchKernelGGL((compact_kv_kernel<T, LAYOUT, false>), grid, block, 0, stream, p);
  }
  return (int)hipGetLastError();
}

template <typename T>
int launch_typed(const CompactKvParams& p, KvLayout layout, bool vec, hipStream_t stream) {
  if (layout == kNHD) return launch_layout<T, kNHD>(p, vec, stream);
  if (layout == kSplitK) return launch_layout<T, kSplitK>(p, vec, stream);
  return kUnsupported;
}

}  // namespace kv_compact

bool compact_kv_vector_ok(const CompactKvParams& p, int elem_bytes) {
  if (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4) return false;
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return p.head_dim % (16 / elem_bytes) == 0 && aligned(p.key_cache) && aligned(p.value_cache);
}

int launch_compact_kv(const CompactKvParams& p, int elem_bytes, KvLayout layout,
                      bool allow_vector, void* stream) {
  if (p.batch_size == 0 || p.max_depth == 0 || p.num_kv_heads == 0 || p.head_dim == 0) return 0;
  const bool vec = allow_vector && compact_kv_vector_ok(p, elem_bytes);
  hipStream_t s = static_cast<hipStream_t>(stream);
  using namespace kv_compact;
  switch (elem_bytes) {
    case 1: return launch_typed<uint8_t>(p, layout, vec, s);
    case 2: return launch_typed<uint16_t>(p, layout, vec, s);
    case 4: return launch_typed<uint32_t>(p, layout, vec, s);
    default: return kUnsupported;
  }
}

}  // namespace rocdraft
