// CPU execution of a CopyPlan: one parallel_for over the plan's total element range, so
// chunks cross segment boundaries and many small tensors cost no more than one big one.
#include "ops/copy_plan.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
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

ZL_AVX2 inline void store8(ScalarType t, void* p, __m256 v) {
  switch (t) {
    case ScalarType::Float: _mm256_storeu_ps(static_cast<float*>(p), v); return;
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
      _mm_storeu_si128(static_cast<__m128i*>(p), packed);
      return;
    }
    default:
      _mm_storeu_si128(static_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
}

template <ScalarType Src, ScalarType Dst>
ZL_AVX2 void convert_avx2_typed(const char* src, char* dst, int64_t n, float scale) {
  constexpr int64_t src_size = Src == ScalarType::Float ? 4 : 2;
  constexpr int64_t dst_size = Dst == ScalarType::Float ? 4 : 2;
  const __m256 factor = _mm256_set1_ps(scale);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    store8(Dst, dst + k * dst_size, _mm256_mul_ps(load8(Src, src + k * src_size), factor));
  }
  if (k < n) {  // tail through an 8-element staging area: same rounding as the body
    alignas(32) char in[32] = {};
    alignas(32) char out[32];
    std::memcpy(in, src + k * src_size, (n - k) * src_size);
    store8(Dst, out, _mm256_mul_ps(load8(Src, in), factor));
    std::memcpy(dst + k * dst_size, out, (n - k) * dst_size);
  }
}

using ConvertFn = void (*)(const char*, char*, int64_t, float);

template <ScalarType Src>
ConvertFn pick_avx2(ScalarType dst) {
  switch (dst) {
    case ScalarType::Float: return convert_avx2_typed<Src, ScalarType::Float>;
    case ScalarType::BFloat16: return convert_avx2_typed<Src, ScalarType::BFloat16>;
    default: return convert_avx2_typed<Src, ScalarType::Half>;
  }
}

ConvertFn pick_avx2(ScalarType src, ScalarType dst) {
  switch (src) {
    case ScalarType::Float: return pick_avx2<ScalarType::Float>(dst);
    case ScalarType::BFloat16: return pick_avx2<ScalarType::BFloat16>(dst);
    default: return pick_avx2<ScalarType::Half>(dst);
  }
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}
#endif  // ZL_HAVE_AVX2_PATH

void copy_run(const CopySegment& seg, int64_t begin, int64_t end, const CopyPlan& plan) {
  const int64_t src_size = c10::elementSize(seg.src_dtype);
  const int64_t dst_size = c10::elementSize(plan.dst_dtype);
  const char* src = static_cast<const char*>(seg.src) + begin * src_size;
  char* dst = static_cast<char*>(plan.dst) + (seg.dst_offset + begin) * dst_size;
  const int64_t n = end - begin;
  if (seg.src_dtype == plan.dst_dtype && plan.scale == 1.0f) {
    if (src == dst) return;
    // glibc switches to non-temporal stores for large copies (measured here: a 4 MiB
    // memcpy per thread ran ~1.5x slower than the same bytes in 256 KiB pieces).
    for (int64_t done = 0, bytes = n * src_size; done < bytes; done += kMemcpyPieceBytes) {
      std::memcpy(dst + done, src + done, std::min(kMemcpyPieceBytes, bytes - done));
    }
    return;
  }
#ifdef ZL_HAVE_AVX2_PATH
  if (cpu_has_avx2()) return pick_avx2(seg.src_dtype, plan.dst_dtype)(src, dst, n, plan.scale);
#endif
  convert_generic(seg.src_dtype, plan.dst_dtype, src, dst, n, plan.scale);
}

}  // namespace

void run_plan_cpu(const CopyPlan& plan) {
  if (plan.total_numel == 0) return;
  // starts[k]: position of segment k in the plan's concatenated element range.
  std::vector<int64_t> starts(plan.segments.size());
  int64_t position = 0;
  for (size_t k = 0; k < plan.segments.size(); ++k) {
    starts[k] = position;
    position += plan.segments[k].numel;
  }
  at::parallel_for(0, plan.total_numel, kGrainSize, [&](int64_t begin, int64_t end) {
    size_t k = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (; begin < end; ++k) {
      const CopySegment& seg = plan.segments[k];
      const int64_t local_begin = begin - starts[k];
      const int64_t local_end = std::min(seg.numel, end - starts[k]);
      copy_run(seg, local_begin, local_end, plan);
      begin = starts[k] + local_end;
    }
  });
}

}  // namespace zero_lifetime::ops
