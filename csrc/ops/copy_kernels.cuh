// The per-thread work of the fused copy kernels (copy_plan_cuda.cu), written against
// explicit thread coordinates instead of threadIdx/blockIdx so that the very same code
// also compiles as plain C++: tests/native/copy_kernels_emulated.cpp runs it over an
// emulated grid on the CPU (under ASan/UBSan in CI, which has no GPU) and checks every
// element against a scalar reference. Threads of these kernels share nothing and never
// read what another thread wrote, so running them one after another is exact.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#define ZL_DEVICE __device__ __forceinline__
#define ZL_UNROLL _Pragma("unroll")
#else
#define ZL_DEVICE inline
#define ZL_UNROLL
#endif

namespace zero_lifetime::ops::kernels {

constexpr int kThreads = 256;
constexpr int kMaxVec = 8;  // elements of the widest vector: 16 B of a 2-byte type
constexpr int64_t kChunk = 8192;  // elements per block work item
constexpr int kVecBytes = 16;

// Elements one thread moves per vector for a dtype pair: 16 B of the wider type (4 if either
// is fp32, else 8). Thread t's vectors start at t * vector within each row of kThreads of
// them, so every access of a warp covers one contiguous span (512 B of 16-byte accesses, 256 B
// of 8-byte ones): whole sectors. With 8 elements for every pair, an fp32 side put the threads
// of a warp 32 B apart and each 16-byte access half-filled 32 sectors (the fp32 kernels' 70-75%
// of the copy roofline on an H200, 2026-11-27, against 103-112% for bf16 -> fp32 whose loads
// were contiguous).
template <typename Src, typename Dst>
constexpr int vec_elems() {
  return kVecBytes / static_cast<int>(sizeof(Src) > sizeof(Dst) ? sizeof(Src) : sizeof(Dst));
}
static_assert(kChunk % (kThreads * kMaxVec) == 0 && kChunk % (kThreads * vec_elems<float, float>()) == 0,
              "a chunk is whole rows of vectors for every dtype pair");

enum DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// One segment, split into ceil(numel / kChunk) work items numbered from first_chunk.
struct SegmentMeta {
  const void* src;
  int64_t dst_offset;
  int64_t numel;
  int64_t first_chunk;
  int32_t src_dtype;
  int32_t padding;
};

// Where one thread runs: its index in the block, the block size, its block, the grid size.
struct ThreadCoord {
  int64_t thread;
  int64_t threads;
  int64_t block;
  int64_t blocks;
};

template <typename T, int N>
struct Pack {
  T v[N];
};

#if defined(__CUDACC__)
// Built-in vector types: their copies are single 8- and 16-byte accesses.
template <int Bytes>
using Word = std::conditional_t<Bytes == 16, uint4, uint2>;
#else
struct alignas(16) Word16Emulated {
  uint32_t lane[4];
};
struct alignas(8) Word8Emulated {
  uint32_t lane[2];
};
template <int Bytes>
using Word = std::conditional_t<Bytes == 16, Word16Emulated, Word8Emulated>;
#endif

// The bit pattern of one element, widened to 32 bits.
template <typename T>
ZL_DEVICE uint32_t bits_of(T x) {
  if constexpr (sizeof(T) == 4) {
    uint32_t b;
    memcpy(&b, &x, 4);
    return b;
  } else {
    uint16_t b;
    memcpy(&b, &x, 2);
    return b;
  }
}

// N elements from `src` (aligned to their size) with one explicit 8- or 16-byte load.
template <typename T, int N>
ZL_DEVICE Pack<T, N> load_pack(const T* src) {
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  static_assert(kBytes == 8 || kBytes == 16, "one 8- or 16-byte access");
  const Word<kBytes> word = *reinterpret_cast<const Word<kBytes>*>(src);
  Pack<T, N> pack;
  memcpy(&pack, &word, kBytes);
  return pack;
}

// Stores `pack` at `dst` (aligned to its size) as one 8- or 16-byte word built from 32-bit
// lanes, with an explicit vector store. Assigning a pack of elements compiled to one store
// per element in these kernels (st.global.f32 / st.global.u16 in the PTX of nvcc 13.0;
// whether nvcc merges them depends on how much code is inlined around them).
template <typename T, int N>
ZL_DEVICE void store_pack(T* dst, const Pack<T, N>& pack) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 2, "fp32, bf16 or fp16");
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  static_assert(kBytes == 8 || kBytes == 16, "one 8- or 16-byte access");
  constexpr int kPerLane = 4 / static_cast<int>(sizeof(T));
  constexpr int kLanes = N / kPerLane;
  uint32_t lanes[kLanes];
ZL_UNROLL
  for (int l = 0; l < kLanes; ++l) {
    lanes[l] = kPerLane == 1 ? bits_of(pack.v[l])
                             : bits_of(pack.v[2 * l]) | (bits_of(pack.v[2 * l + 1]) << 16);
  }
  auto* out = reinterpret_cast<Word<kBytes>*>(dst);
#if defined(__CUDACC__)
  if constexpr (kBytes == 16) {
    __stwb(out, make_uint4(lanes[0], lanes[1], lanes[2], lanes[3]));  // st.global.wb.v4
  } else {
    __stwb(out, make_uint2(lanes[0], lanes[1]));  // st.global.wb.v2
  }
#else
  Word<kBytes> word;
  memcpy(&word, lanes, kBytes);
  *out = word;
#endif
}

template <typename Src, typename Dst>
ZL_DEVICE Dst convert(Src x, float scale, bool raw) {
  if constexpr (std::is_same_v<Src, Dst>) {
    return raw ? x : static_cast<Dst>(static_cast<float>(x) * scale);
  } else {
    return static_cast<Dst>(static_cast<float>(x) * scale);
  }
}

template <typename Src, typename Dst, int N>
ZL_DEVICE void store_converted(Dst* dst, const Pack<Src, N>& in, float scale, bool raw) {
  Pack<Dst, N> out;
ZL_UNROLL
  for (int k = 0; k < N; ++k) out.v[k] = convert<Src, Dst>(in.v[k], scale, raw);
  store_pack(dst, out);
}

// Elements [begin, end) of one segment, by one thread of the block.
template <typename Src, typename Dst>
ZL_DEVICE void copy_range(const Src* src, Dst* dst, int64_t begin, int64_t end, float scale,
                          int64_t thread, int64_t threads) {
  constexpr int kVec = vec_elems<Src, Dst>();
  constexpr int kVectorsPerThread = static_cast<int>(kChunk / (kThreads * kVec));
  const bool raw = std::is_same_v<Src, Dst> && scale == 1.0f;  // bit copy: NaN payloads kept
  const bool aligned = reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  int64_t i = begin;
  if (aligned && threads == kThreads && end - begin == kChunk) {
    // A whole chunk (begin is a multiple of kChunk, so every vector is aligned to its size):
    // each thread issues all its loads before its stores, 128 B in flight per thread for an
    // fp32 side, enough to hide the memory latency with one resident wave of blocks.
    Pack<Src, kVec> in[kVectorsPerThread];
ZL_UNROLL
    for (int u = 0; u < kVectorsPerThread; ++u) {
      in[u] = load_pack<Src, kVec>(src + begin + (u * kThreads + thread) * kVec);
    }
ZL_UNROLL
    for (int u = 0; u < kVectorsPerThread; ++u) {
      store_converted(dst + begin + (u * kThreads + thread) * kVec, in[u], scale, raw);
    }
    return;
  }
  if (aligned) {  // a segment's last, partial chunk: vectors, then single elements
    const int64_t vec_end = begin + (end - begin) / kVec * kVec;
    for (i = begin + thread * kVec; i < vec_end; i += threads * kVec) {
      store_converted(dst + i, load_pack<Src, kVec>(src + i), scale, raw);
    }
    i = vec_end;
  }
  for (i += thread; i < end; i += threads) dst[i] = convert<Src, Dst>(src[i], scale, raw);
}

template <typename Dst>
ZL_DEVICE void copy_segment_range(const SegmentMeta& seg, Dst* dst, int64_t begin, int64_t end,
                                  float scale, int64_t thread, int64_t threads) {
  Dst* out = dst + seg.dst_offset;
  switch (seg.src_dtype) {  // runtime dtype per segment: mixed-dtype lists in one launch
    case kF32:
      return copy_range(static_cast<const float*>(seg.src), out, begin, end, scale, thread, threads);
    case kBF16:
      return copy_range(static_cast<const c10::BFloat16*>(seg.src), out, begin, end, scale, thread,
                        threads);
    default:
      return copy_range(static_cast<const c10::Half*>(seg.src), out, begin, end, scale, thread,
                        threads);
  }
}

// Grid-stride over the chunks. `segments` points to global memory or, for the inline
// kernel, into its __grid_constant__ argument (read through the constant cache; every
// thread of a block looks up the same chunk, so the reads are broadcasts).
template <typename Dst>
ZL_DEVICE void copy_chunks(const SegmentMeta* segments, int64_t num_segments, int64_t num_chunks,
                           Dst* dst, float scale, ThreadCoord at) {
  for (int64_t chunk = at.block; chunk < num_chunks; chunk += at.blocks) {
    // The segment owning this chunk: the last one with first_chunk <= chunk.
    int64_t lo = 0;
    int64_t hi = num_segments - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (segments[mid].first_chunk <= chunk) lo = mid; else hi = mid - 1;
    }
    const SegmentMeta& seg = segments[lo];
    const int64_t begin = (chunk - seg.first_chunk) * kChunk;
    const int64_t end = begin + kChunk < seg.numel ? begin + kChunk : seg.numel;
    copy_segment_range(seg, dst, begin, end, scale, at.thread, at.threads);
  }
}

// The metadata of a plan's segments, numbering their chunks; returns the number of chunks.
template <typename Segment, typename ToDType>
int64_t fill_segment_meta(const Segment* segments, int64_t count, SegmentMeta* meta, ToDType to_dtype) {
  int64_t num_chunks = 0;
  for (int64_t k = 0; k < count; ++k) {
    const Segment& s = segments[k];
    meta[k] = {s.src, s.dst_offset, s.numel, num_chunks, to_dtype(s.src_dtype), 0};
    num_chunks += (s.numel + kChunk - 1) / kChunk;
  }
  return num_chunks;
}

}  // namespace zero_lifetime::ops::kernels
