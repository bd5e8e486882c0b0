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
constexpr int kVec = 8;     // elements per vector: 16 B of 2-byte types, 32 B of fp32
constexpr int kUnroll = 4;  // vectors per thread per chunk, all loaded before any store
constexpr int64_t kChunk = kThreads * kVec * kUnroll;  // elements per block work item

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

template <typename T>
struct alignas(16) Pack8 {
  T v[kVec];
};

#if defined(__CUDACC__)
using Word16 = uint4;  // a built-in vector type: its copies are single 16-byte accesses
#else
struct alignas(16) Word16 {
  uint32_t x, y, z, w;
};
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

// Stores `pack` at `dst` (16-byte aligned) as 16-byte words built from 32-bit lanes, with
// an explicit vector store. Assigning the Pack8 itself compiled to per-element stores in
// these kernels (st.global.f32 / st.global.u16 in the PTX of nvcc 13.0; whether nvcc merges
// them depends on how much code is inlined around them: the same loop alone was merged).
// With the threads of a warp 16-32 B apart, each per-element instruction writes 2-4 bytes
// into each of 16-32 sectors: 4-8 times the store instructions of 16-byte stores.
template <typename T>
ZL_DEVICE void store_pack(T* dst, const Pack8<T>& pack) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 2, "fp32, bf16 or fp16");
  constexpr int kPerLane = 4 / static_cast<int>(sizeof(T));
  constexpr int kLanes = kVec / kPerLane;
  uint32_t lanes[kLanes];
ZL_UNROLL
  for (int l = 0; l < kLanes; ++l) {
    lanes[l] = kPerLane == 1 ? bits_of(pack.v[l])
                             : bits_of(pack.v[2 * l]) | (bits_of(pack.v[2 * l + 1]) << 16);
  }
  Word16* out = reinterpret_cast<Word16*>(dst);
ZL_UNROLL
  for (int w = 0; w < kLanes / 4; ++w) {
    const Word16 word{lanes[4 * w], lanes[4 * w + 1], lanes[4 * w + 2], lanes[4 * w + 3]};
#if defined(__CUDACC__)
    __stwb(out + w, word);  // st.global.wb.v4: a plain assignment may still be split
#else
    out[w] = word;
#endif
  }
}

template <typename Src, typename Dst>
ZL_DEVICE Dst convert(Src x, float scale, bool raw) {
  if constexpr (std::is_same_v<Src, Dst>) {
    return raw ? x : static_cast<Dst>(static_cast<float>(x) * scale);
  } else {
    return static_cast<Dst>(static_cast<float>(x) * scale);
  }
}

// Elements [begin, end) of one segment, by one thread of the block.
template <typename Src, typename Dst>
ZL_DEVICE void copy_range(const Src* src, Dst* dst, int64_t begin, int64_t end, float scale,
                          int64_t thread, int64_t threads) {
  const bool raw = std::is_same_v<Src, Dst> && scale == 1.0f;  // bit copy: NaN payloads kept
  const bool aligned = reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  int64_t i = begin;
  if (aligned && threads == kThreads && end - begin == kChunk) {
    // A whole chunk (begin is a multiple of kChunk, so every vector is 16 B aligned): each
    // thread issues its kUnroll loads before its stores, enough bytes in flight to hide
    // the memory latency with one resident wave of blocks.
    Pack8<Src> in[kUnroll];
ZL_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      in[u] = *reinterpret_cast<const Pack8<Src>*>(src + begin + (u * kThreads + thread) * kVec);
    }
ZL_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      Pack8<Dst> out;
ZL_UNROLL
      for (int k = 0; k < kVec; ++k) out.v[k] = convert<Src, Dst>(in[u].v[k], scale, raw);
      store_pack(dst + begin + (u * kThreads + thread) * kVec, out);
    }
    return;
  }
  if (aligned) {  // a segment's last, partial chunk: vectors, then single elements
    const int64_t vec_end = begin + (end - begin) / kVec * kVec;
    for (i = begin + thread * kVec; i < vec_end; i += threads * kVec) {
      const Pack8<Src> in = *reinterpret_cast<const Pack8<Src>*>(src + i);
      Pack8<Dst> out;
ZL_UNROLL
      for (int k = 0; k < kVec; ++k) out.v[k] = convert<Src, Dst>(in.v[k], scale, raw);
      store_pack(dst + i, out);
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
