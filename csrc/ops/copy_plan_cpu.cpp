// CPU execution of a CopyPlan: one parallel_for over the plan's total element range, so
// chunks cross segment boundaries and many small tensors cost no more than one big one.
#include "ops/copy_plan.h"
#include "ops/cache_size.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ZL_HAVE_AVX2_PATH 1
#endif

namespace zero_lifetime::ops {

namespace {

using c10::ScalarType;

// Elements per parallel chunk at least: torch's own grain (at::internal::GRAIN_SIZE), big
// enough to amortise waking a thread. Chunks are cut at any element, across segments.
constexpr int64_t kGrainSize = 32768;
constexpr int64_t kMemcpyPieceBytes = 256 * 1024;

// Many small sources are separate tensors scattered over the heap: the first touch of each of
// their pages misses the TLB, and the hardware prefetchers restart at every page and source.
// Touching each page of the segment kPrefetchAhead segments ahead starts those walks and reads
// early. Measured on an AMD EPYC (2000 x 8 KiB bf16 sources into fp32): the copy 1.38x -> 1.19x
// of one contiguous copy_ (4-16 segments ahead alike, 1-2 less); the next segment's first lines
// alone gave nothing (docs/benchmarks.md). Larger segments stream well: only their first pages.
constexpr size_t kPrefetchAhead = 8;
constexpr int64_t kPageBytes = 4096;
constexpr int64_t kPrefetchMaxBytes = 16 * kPageBytes;

// Destinations of at least this many bytes are written with non-temporal (streaming) stores:
// they skip reading every destination line into the cache before overwriting it, but leave
// nothing in the cache for the next reader. On an AMD EPYC with a 32 MiB L3 they lost up to
// 16 MiB (1.1-2.1x the time of cached stores) and won from 32 MiB (0.8-0.9x; with a read of
// the whole destination after it, 0.9-1.1x at 32 MiB and 0.9x at 64 MiB):
// benchmarks/streaming_threshold.py. So the default is the last-level cache's size, as
// glibc's memcpy also derives its non-temporal threshold from it; 32 MiB where unknown.
// But sysfs may list a cache the process only gets a slice of: an Intel Xeon VM listed the
// socket's 480 MiB L3, and there streaming stores won from 96 MiB in every case, whether the
// destination was still cached (cached stores won up to 32 MiB, 64 MiB was a wash) or not
// (streaming won from 4 MiB). So a listed cache counts up to 96 MiB (docs/benchmarks.md).
constexpr int64_t kFallbackStreamingThreshold = int64_t{32} << 20;
constexpr int64_t kLargestTrustedCache = int64_t{96} << 20;
constexpr int64_t kSmallestCredibleCache = int64_t{1} << 20;  // below: a misread, not a cache

std::atomic<int64_t> streaming_threshold_bytes{
    default_streaming_store_threshold("/sys/devices/system/cpu/cpu0")};

// Scalar conversion, same rounding as the vector paths and as torch's copy_ (nearest even).
template <typename Src, typename Dst>
void convert_scalar(const void* src, void* dst, int64_t n, float scale) {
  const auto* s = static_cast<const Src*>(src);
  auto* d = static_cast<Dst*>(dst);
  for (int64_t k = 0; k < n; ++k) d[k] = static_cast<Dst>(static_cast<float>(s[k]) * scale);
}

template <typename Src>
void convert_scalar_to(ScalarType dst_dtype, const void* src, void* dst, int64_t n,
                       float scale) {
  switch (dst_dtype) {
    case ScalarType::Float: return convert_scalar<Src, float>(src, dst, n, scale);
    case ScalarType::BFloat16: return convert_scalar<Src, c10::BFloat16>(src, dst, n, scale);
    default: return convert_scalar<Src, c10::Half>(src, dst, n, scale);
  }
}

void convert_generic(ScalarType src_dtype, ScalarType dst_dtype, const void* src, void* dst,
                     int64_t n, float scale) {
  switch (src_dtype) {
    case ScalarType::Float: return convert_scalar_to<float>(dst_dtype, src, dst, n, scale);
    case ScalarType::BFloat16:
      return convert_scalar_to<c10::BFloat16>(dst_dtype, src, dst, n, scale);
    default: return convert_scalar_to<c10::Half>(dst_dtype, src, dst, n, scale);
  }
}

#ifdef ZL_HAVE_AVX2_PATH
// 8 elements at a time in AVX2 registers; compiled for AVX2+F16C only in these functions
// and picked at run time, so the extension still loads on CPUs without them.
#define ZL_AVX2 __attribute__((target("avx2,f16c")))

ZL_AVX2 inline __m256 load8(ScalarType t, const void* p) {
  switch (t) {
    case ScalarType::Float: return _mm256_loadu_ps(static_cast<const float*>(p));
    case ScalarType::BFloat16: {
      __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
      return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
    default: return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
}

template <bool Streaming>
ZL_AVX2 inline void store16_bytes(void* p, __m128i v) {
  if constexpr (Streaming) {
    _mm_stream_si128(static_cast<__m128i*>(p), v);  // p 16-byte aligned (see convert_avx2_typed)
  } else {
    _mm_storeu_si128(static_cast<__m128i*>(p), v);
  }
}

template <bool Streaming>
ZL_AVX2 inline void store8(ScalarType t, void* p, __m256 v) {
  switch (t) {
    case ScalarType::Float:
      if constexpr (Streaming) {
        _mm256_stream_ps(static_cast<float*>(p), v);  // p 32-byte aligned (see convert_avx2_typed)
      } else {
        _mm256_storeu_ps(static_cast<float*>(p), v);
      }
      return;
    case ScalarType::BFloat16: {
      // Round to nearest even; NaN becomes 0x7FC0 as in c10::BFloat16.
      const __m256i bits = _mm256_castps_si256(v);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
      __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
      const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), nan);
      rounded = _mm256_srli_epi32(rounded, 16);
      const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded),
                                              _mm256_extracti128_si256(rounded, 1));
      store16_bytes<Streaming>(p, packed);
      return;
    }
    default:
      store16_bytes<Streaming>(p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
}

// Fewer than 8 elements through an 8-element staging area: same rounding as the body.
template <ScalarType Src, ScalarType Dst>
ZL_AVX2 void convert_staged(const char* src, char* dst, int64_t n, __m256 factor) {
  constexpr int64_t src_size = Src == ScalarType::Float ? 4 : 2;
  constexpr int64_t dst_size = Dst == ScalarType::Float ? 4 : 2;
  alignas(32) char in[32] = {};
  alignas(32) char out[32];
  std::memcpy(in, src, n * src_size);
  store8<false>(Dst, out, _mm256_mul_ps(load8(Src, in), factor));
  std::memcpy(dst, out, n * dst_size);
}

template <ScalarType Src, ScalarType Dst, bool Streaming>
ZL_AVX2 void convert_avx2_typed(const char* src, char* dst, int64_t n, float scale) {
  constexpr int64_t src_size = Src == ScalarType::Float ? 4 : 2;
  constexpr int64_t dst_size = Dst == ScalarType::Float ? 4 : 2;
  constexpr int64_t step_bytes = 8 * dst_size;  // one store8; streaming stores need it aligned
  const __m256 factor = _mm256_set1_ps(scale);
  int64_t k = 0;
  if constexpr (Streaming) {
    const auto misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) % step_bytes);
    if (misaligned % dst_size != 0) {  // never for tensor storage; plain stores then
      return convert_avx2_typed<Src, Dst, false>(src, dst, n, scale);
    }
    k = std::min(n, misaligned ? (step_bytes - misaligned) / dst_size : 0);
    if (k > 0) convert_staged<Src, Dst>(src, dst, k, factor);
  }
  for (; k + 8 <= n; k += 8) {
    const __m256 scaled = _mm256_mul_ps(load8(Src, src + k * src_size), factor);
    store8<Streaming>(Dst, dst + k * dst_size, scaled);
  }
  if (k < n) convert_staged<Src, Dst>(src + k * src_size, dst + k * dst_size, n - k, factor);
}

using ConvertFn = void (*)(const char*, char*, int64_t, float);

template <ScalarType Src, bool Streaming>
ConvertFn pick_avx2(ScalarType dst) {
  switch (dst) {
    case ScalarType::Float: return convert_avx2_typed<Src, ScalarType::Float, Streaming>;
    case ScalarType::BFloat16: return convert_avx2_typed<Src, ScalarType::BFloat16, Streaming>;
    default: return convert_avx2_typed<Src, ScalarType::Half, Streaming>;
  }
}

template <bool Streaming>
ConvertFn pick_avx2(ScalarType src, ScalarType dst) {
  switch (src) {
    case ScalarType::Float: return pick_avx2<ScalarType::Float, Streaming>(dst);
    case ScalarType::BFloat16: return pick_avx2<ScalarType::BFloat16, Streaming>(dst);
    default: return pick_avx2<ScalarType::Half, Streaming>(dst);
  }
}

// A plain byte copy with streaming stores (SSE2: every x86-64 CPU has it).
void stream_copy(char* dst, const char* src, int64_t bytes) {
  const auto misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) % 16);
  int64_t k = std::min(bytes, misaligned ? 16 - misaligned : int64_t{0});
  std::memcpy(dst, src, k);
  for (; k + 64 <= bytes; k += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 48), d);
  }
  for (; k + 16 <= bytes; k += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k)));
  }
  std::memcpy(dst + k, src + k, bytes - k);
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}
#endif  // ZL_HAVE_AVX2_PATH

void copy_run(const CopySegment& seg, int64_t begin, int64_t end, const CopyPlan& plan,
              bool streaming) {
  const int64_t src_size = c10::elementSize(seg.src_dtype);
  const int64_t dst_size = c10::elementSize(plan.dst_dtype);
  const char* src = static_cast<const char*>(seg.src) + begin * src_size;
  char* dst = static_cast<char*>(plan.dst) + (seg.dst_offset + begin) * dst_size;
  const int64_t n = end - begin;
  if (seg.src_dtype == plan.dst_dtype && plan.scale == 1.0f) {
    if (src == dst) return;
#ifdef ZL_HAVE_AVX2_PATH
    if (streaming) return stream_copy(dst, src, n * src_size);
#endif
    // glibc switches to non-temporal stores for large copies (measured here: a 4 MiB
    // memcpy per thread ran ~1.5x slower than the same bytes in 256 KiB pieces).
    for (int64_t done = 0, bytes = n * src_size; done < bytes; done += kMemcpyPieceBytes) {
      std::memcpy(dst + done, src + done, std::min(kMemcpyPieceBytes, bytes - done));
    }
    return;
  }
#ifdef ZL_HAVE_AVX2_PATH
  if (cpu_has_avx2()) {
    const ConvertFn convert = streaming ? pick_avx2<true>(seg.src_dtype, plan.dst_dtype)
                                        : pick_avx2<false>(seg.src_dtype, plan.dst_dtype);
    return convert(src, dst, n, plan.scale);
  }
#endif
  convert_generic(seg.src_dtype, plan.dst_dtype, src, dst, n, plan.scale);
}

void prefetch_pages(const CopySegment& seg) {
  const char* src = static_cast<const char*>(seg.src);
  const int64_t bytes = std::min(seg.numel * static_cast<int64_t>(c10::elementSize(seg.src_dtype)),
                                 kPrefetchMaxBytes);
  if (bytes <= 0) return;
  for (int64_t offset = 0; offset < bytes; offset += kPageBytes) __builtin_prefetch(src + offset);
  __builtin_prefetch(src + bytes - 1);  // the last page, when the source does not start on one
}

}  // namespace

int64_t default_streaming_store_threshold(const std::string& cpu_dir) {
  const int64_t cache = last_level_cache_bytes(cpu_dir);
  if (cache < kSmallestCredibleCache) return kFallbackStreamingThreshold;
  return std::min(cache, kLargestTrustedCache);
}

void run_plan_cpu(const CopyPlan& plan) {
  if (plan.total_numel == 0) return;
  // starts[k]: position of segment k in the plan's concatenated element range.
  std::vector<int64_t> starts(plan.segments.size());
  int64_t position = 0;
  for (size_t k = 0; k < plan.segments.size(); ++k) {
    starts[k] = position;
    position += plan.segments[k].numel;
  }
  bool streaming = false;
#ifdef ZL_HAVE_AVX2_PATH
  streaming = plan.total_numel * static_cast<int64_t>(c10::elementSize(plan.dst_dtype)) >=
              streaming_threshold_bytes.load(std::memory_order_relaxed);
#endif
  at::parallel_for(0, plan.total_numel, kGrainSize, [&](int64_t begin, int64_t end) {
    size_t k = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (; begin < end; ++k) {
      const CopySegment& seg = plan.segments[k];
      if (k + kPrefetchAhead < plan.segments.size()) prefetch_pages(plan.segments[k + kPrefetchAhead]);
      const int64_t local_begin = begin - starts[k];
      const int64_t local_end = std::min(seg.numel, end - starts[k]);
      copy_run(seg, local_begin, local_end, plan, streaming);
      begin = starts[k] + local_end;
    }
#ifdef ZL_HAVE_AVX2_PATH
    // Streaming stores are weakly ordered: drain them before the caller (or another thread
    // after the join) reads the destination.
    if (streaming) _mm_sfence();
#endif
  });
}

int64_t streaming_store_threshold() {
  return streaming_threshold_bytes.load(std::memory_order_relaxed);
}

int64_t set_streaming_store_threshold(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "streaming store threshold must be >= 0 bytes, got ", bytes);
  return streaming_threshold_bytes.exchange(bytes, std::memory_order_relaxed);
}

}  // namespace zero_lifetime::ops
