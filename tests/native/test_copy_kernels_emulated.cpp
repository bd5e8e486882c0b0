// The CUDA copy kernels' device code (csrc/ops/copy_kernels.cuh) run on the CPU over an
// emulated grid, every element checked against a scalar reference. CI has no GPU: this is
// what checks there that the kernels' chunking, segment lookup, vector paths and grid-stride
// loop write each destination element exactly once, from the right source element, and
// touch nothing else. Each source and the destination are separate heap allocations of
// exactly their size, so under ASan a read or write past any of them is reported.
//
// Not covered here (needs a GPU): the launch itself, the kernel-argument and device-table
// transport of the metadata, streams. tests/test_ops.py and tests/test_ops_fuzz.py run
// those on CUDA against the pure-torch reference.
#include "ops/copy_kernels.cuh"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <random>
#include <vector>

namespace k = zero_lifetime::ops::kernels;

namespace {

int g_failures = 0;

#define EXPECT(cond, ...)                                  \
  do {                                                     \
    if (!(cond)) {                                         \
      if (++g_failures <= 20) {                            \
        std::fprintf(stderr, "FAILED %s:%d: ", __FILE__, __LINE__); \
        std::fprintf(stderr, __VA_ARGS__);                 \
        std::fprintf(stderr, "\n");                        \
      }                                                    \
    }                                                      \
  } while (0)

size_t itemsize(k::DType t) { return t == k::kF32 ? 4 : 2; }

// A heap allocation of exactly misalign + n bytes, 16-byte aligned as CUDA allocations
// are; the data starts `misalign` bytes in, so its end is the allocation's end and ASan
// reports any access past it.
struct Block {
  unsigned char* storage;
  unsigned char* data;
  size_t bytes;
  Block(size_t n, size_t misalign)
      : storage(static_cast<unsigned char*>(::operator new[](misalign + n, std::align_val_t(16)))),
        data(storage + misalign),
        bytes(n) {}
  ~Block() { ::operator delete[](storage, std::align_val_t(16)); }
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
};

template <typename T>
T random_value(std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  return static_cast<T>(dist(rng));
}

template <typename T>
void fill_random(void* p, int64_t n, std::mt19937_64& rng) {
  T* t = static_cast<T*>(p);
  for (int64_t i = 0; i < n; ++i) t[i] = random_value<T>(rng);
}

void fill_random(k::DType t, void* p, int64_t n, std::mt19937_64& rng) {
  if (t == k::kF32) return fill_random<float>(p, n, rng);
  if (t == k::kBF16) return fill_random<c10::BFloat16>(p, n, rng);
  fill_random<c10::Half>(p, n, rng);
}

float load_as_float(k::DType t, const void* p, int64_t i) {
  if (t == k::kF32) return static_cast<const float*>(p)[i];
  if (t == k::kBF16) return static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]);
  return static_cast<float>(static_cast<const c10::Half*>(p)[i]);
}

// The reference of one element: a bit copy for same dtype and scale 1, else convert(x * s).
void expected_bytes(k::DType src_t, const void* src, int64_t i, k::DType dst_t, float scale,
                    unsigned char* out) {
  if (src_t == dst_t && scale == 1.0f) {
    std::memcpy(out, static_cast<const unsigned char*>(src) + i * itemsize(src_t), itemsize(src_t));
    return;
  }
  const float v = load_as_float(src_t, src, i) * scale;
  if (dst_t == k::kF32) {
    std::memcpy(out, &v, 4);
  } else if (dst_t == k::kBF16) {
    const c10::BFloat16 b(v);
    std::memcpy(out, &b, 2);
  } else {
    const c10::Half h(v);
    std::memcpy(out, &h, 2);
  }
}

struct Segment {  // what a CopyPlan holds, as fill_segment_meta reads it
  const void* src;
  int64_t dst_offset;
  int64_t numel;
  k::DType src_dtype;
};

template <typename Dst>
void run_grid(const std::vector<k::SegmentMeta>& meta, int64_t num_chunks, void* dst, float scale,
              int64_t blocks) {
  for (int64_t block = 0; block < blocks; ++block) {
    for (int64_t thread = 0; thread < k::kThreads; ++thread) {
      k::copy_chunks(meta.data(), static_cast<int64_t>(meta.size()), num_chunks,
                     static_cast<Dst*>(dst), scale, k::ThreadCoord{thread, k::kThreads, block, blocks});
    }
  }
}

int64_t pick_numel(std::mt19937_64& rng) {
  static const int64_t interesting[] = {
      1, 2, 7, k::kMaxVec - 1, k::kMaxVec, k::kMaxVec + 1, 1000, k::kChunk - 1, k::kChunk, k::kChunk + 1,
      2 * k::kChunk, 3 * k::kChunk + 5, k::kThreads * k::kMaxVec + 3, k::kThreads * 4 + 3};
  if (rng() % 4 == 0) return 1 + static_cast<int64_t>(rng() % 40000);
  return interesting[rng() % (sizeof(interesting) / sizeof(interesting[0]))];
}

struct Totals {
  int64_t cases = 0, segments = 0, elements = 0, inline_sized = 0, table_sized = 0;
};

void run_case(std::mt19937_64& rng, Totals& totals) {
  const auto dst_t = static_cast<k::DType>(rng() % 3);
  const int64_t count = rng() % 5 == 0 ? 65 + static_cast<int64_t>(rng() % 100)
                                       : 1 + static_cast<int64_t>(rng() % 64);
  // A case is aligned (vector paths) or, one time in four, has misaligned sources and a
  // misaligned destination base (the scalar path).
  const bool misaligned = rng() % 4 == 0;
  const float scale = rng() % 3 == 0 ? 1.0f : 0.37f;
  std::vector<Segment> segments;
  std::vector<std::unique_ptr<Block>> sources;
  std::vector<k::DType> src_types;
  int64_t position = 0;
  for (int64_t s = 0; s < count; ++s) {
    const auto src_t = rng() % 2 == 0 ? dst_t : static_cast<k::DType>(rng() % 3);
    const int64_t n = pick_numel(rng);
    const size_t misalign = misaligned ? itemsize(src_t) * (1 + rng() % 7) : 0;
    sources.push_back(std::make_unique<Block>(static_cast<size_t>(n) * itemsize(src_t), misalign));
    fill_random(src_t, sources.back()->data, n, rng);
    // Gaps between destinations (kept multiples of 8 elements when aligned, as DeepSpeed's
    // 16-byte aligned partitions give).
    const int64_t gap = misaligned ? static_cast<int64_t>(rng() % 5) : k::kMaxVec * static_cast<int64_t>(rng() % 3);
    position += gap;
    segments.push_back({sources.back()->data, position, n, src_t});
    src_types.push_back(src_t);
    position += misaligned ? n : (n + k::kMaxVec - 1) / k::kMaxVec * k::kMaxVec;
  }
  const int64_t dst_numel = position + (rng() % 3);
  const size_t dst_misalign = misaligned ? itemsize(dst_t) : 0;
  Block dst(static_cast<size_t>(dst_numel) * itemsize(dst_t), dst_misalign);
  std::memset(dst.data, 0x5C, dst.bytes);  // the gaps must keep this pattern

  std::vector<k::SegmentMeta> meta(segments.size());
  const int64_t num_chunks = k::fill_segment_meta(segments.data(), count, meta.data(),
                                                  [](k::DType t) { return t; });
  static const int64_t grid_sizes[] = {1, 3, 7, 1056};
  const int64_t blocks = std::min<int64_t>(num_chunks, grid_sizes[rng() % 4]);
  if (dst_t == k::kF32) run_grid<float>(meta, num_chunks, dst.data, scale, blocks);
  else if (dst_t == k::kBF16) run_grid<c10::BFloat16>(meta, num_chunks, dst.data, scale, blocks);
  else run_grid<c10::Half>(meta, num_chunks, dst.data, scale, blocks);

  // Every written element equals the reference; every other byte keeps its pattern.
  const size_t w = itemsize(dst_t);
  std::vector<bool> written(static_cast<size_t>(dst_numel), false);
  unsigned char want[4];
  for (size_t s = 0; s < segments.size(); ++s) {
    const Segment& seg = segments[s];
    for (int64_t i = 0; i < seg.numel; ++i) {
      written[static_cast<size_t>(seg.dst_offset + i)] = true;
      expected_bytes(seg.src_dtype, seg.src, i, dst_t, scale, want);
      const unsigned char* got = dst.data + (seg.dst_offset + i) * static_cast<int64_t>(w);
      if (std::memcmp(got, want, w) != 0) {
        EXPECT(false, "case %lld segment %zu element %lld: dst dtype %d src dtype %d numel %lld misaligned %d",
               static_cast<long long>(totals.cases), s, static_cast<long long>(i), dst_t, seg.src_dtype,
               static_cast<long long>(seg.numel), misaligned);
        break;
      }
    }
    totals.elements += seg.numel;
  }
  for (int64_t e = 0; e < dst_numel; ++e) {
    if (written[static_cast<size_t>(e)]) continue;
    for (size_t b = 0; b < w; ++b) {
      EXPECT(dst.data[e * static_cast<int64_t>(w) + static_cast<int64_t>(b)] == 0x5C,
             "case %lld: gap element %lld was written", static_cast<long long>(totals.cases),
             static_cast<long long>(e));
    }
  }
  totals.cases += 1;
  totals.segments += count;
  (count > 64 ? totals.table_sized : totals.inline_sized) += 1;
}

void test_chunk_numbering() {
  const Segment segs[] = {{nullptr, 0, 1, k::kF32}, {nullptr, 1, k::kChunk, k::kF32},
                          {nullptr, 1 + k::kChunk, k::kChunk + 1, k::kBF16}};
  k::SegmentMeta meta[3];
  const int64_t chunks = k::fill_segment_meta(segs, 3, meta, [](k::DType t) { return t; });
  EXPECT(chunks == 4, "4 chunks expected, got %lld", static_cast<long long>(chunks));
  EXPECT(meta[0].first_chunk == 0 && meta[1].first_chunk == 1 && meta[2].first_chunk == 2,
         "first_chunk numbering");
  EXPECT(meta[2].src_dtype == k::kBF16, "dtype carried");
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t cases = argc > 1 ? std::atoll(argv[1]) : 400;
  test_chunk_numbering();
  std::mt19937_64 rng(20261123);
  Totals totals;
  for (int64_t c = 0; c < cases && g_failures == 0; ++c) run_case(rng, totals);
  std::printf("copy kernels emulated on the CPU: %lld cases (%lld of up to 64 segments, %lld of 65-164), "
              "%lld segments, %lld elements, %d failures\n",
              static_cast<long long>(totals.cases), static_cast<long long>(totals.inline_sized),
              static_cast<long long>(totals.table_sized), static_cast<long long>(totals.segments),
              static_cast<long long>(totals.elements), g_failures);
  return g_failures == 0 ? 0 : 1;
}
