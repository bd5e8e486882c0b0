#include "ops/cpu_buffer_cache.h"

#include <ATen/Functions.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <vector>

namespace zero_lifetime::ops {

namespace {

// Blocks come in multiples of this, so requests a few elements apart share them.
constexpr int64_t kBlockGranularity = 64 * 1024;
// A request takes a cached block at most this much larger (a quarter of the request): a
// small gather must not pin a large block while the large gather allocates anew.
constexpr int64_t kMaxWasteDivisor = 4;
// Most gathers in flight at once are a few modules (ZeRO-3 prefetch); more released blocks
// than this are older than any reuse and only lengthen the search.
constexpr size_t kMaxCachedBlocks = 64;

struct Block {
  void* data;
  int64_t bytes;
  uint64_t released_at;  // cache clock: the oldest block goes first when over the limit
};

class Cache {
 public:
  // Pointer and size of a cached block that fits `bytes`, or {nullptr, 0}.
  Block take(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto best = blocks_.end();
    for (auto it = blocks_.begin(); it != blocks_.end(); ++it) {
      if (it->bytes >= bytes && it->bytes - bytes <= bytes / kMaxWasteDivisor &&
          (best == blocks_.end() || it->bytes < best->bytes)) {
        best = it;
      }
    }
    if (best == blocks_.end()) {
      ++misses_;
      return {nullptr, 0, 0};
    }
    Block block = *best;
    blocks_.erase(best);
    cached_bytes_ -= block.bytes;
    ++hits_;
    return block;
  }

  void give_back(void* data, int64_t bytes) {
    std::vector<void*> to_free;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (bytes > limit_bytes_) {
        to_free.push_back(data);
      } else {
        blocks_.push_back({data, bytes, ++clock_});
        cached_bytes_ += bytes;
        evict_over_limit(to_free);
      }
    }
    for (void* p : to_free) c10::free_cpu(p);  // outside the lock: munmap can take a while
  }

  int64_t set_limit(int64_t bytes) {
    std::vector<void*> to_free;
    int64_t previous;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      previous = limit_bytes_;
      limit_bytes_ = bytes;
      evict_over_limit(to_free);
    }
    for (void* p : to_free) c10::free_cpu(p);
    return previous;
  }

  void empty() {
    std::vector<void*> to_free;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const Block& b : blocks_) to_free.push_back(b.data);
      blocks_.clear();
      cached_bytes_ = 0;
    }
    for (void* p : to_free) c10::free_cpu(p);
  }

  CpuBufferCacheInfo info() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {cached_bytes_, static_cast<int64_t>(blocks_.size()), limit_bytes_, hits_, misses_};
  }

 private:
  void evict_over_limit(std::vector<void*>& to_free) {
    while (!blocks_.empty() &&
           (cached_bytes_ > limit_bytes_ || blocks_.size() > kMaxCachedBlocks)) {
      auto oldest = std::min_element(blocks_.begin(), blocks_.end(), [](const Block& a, const Block& b) {
        return a.released_at < b.released_at;
      });
      to_free.push_back(oldest->data);
      cached_bytes_ -= oldest->bytes;
      blocks_.erase(oldest);
    }
  }

  std::mutex mutex_;
  std::vector<Block> blocks_;
  int64_t cached_bytes_ = 0;
  // A transformer layer of width 1024 gathers ~50 MB in fp32: a few of them fit, or one
  // of width 2048 (~200 MB), while the cache stays a small part of a host's memory.
  int64_t limit_bytes_ = int64_t{256} << 20;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
  uint64_t clock_ = 0;
};

// Never destroyed: a storage can die after static destructors ran (interpreter exit).
Cache& cache() {
  static Cache* instance = new Cache();
  return *instance;
}

int64_t round_up(int64_t bytes) {
  return (bytes + kBlockGranularity - 1) / kBlockGranularity * kBlockGranularity;
}

}  // namespace

at::Tensor cpu_gather_buffer(int64_t numel, c10::ScalarType dtype) {
  TORCH_CHECK(numel >= 0, "cpu_gather_buffer: numel must be >= 0, got ", numel);
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  const int64_t itemsize = static_cast<int64_t>(c10::elementSize(dtype));
  TORCH_CHECK(numel <= (INT64_MAX - kBlockGranularity) / itemsize,
              "cpu_gather_buffer: ", numel, " elements overflow a byte count");
  if (numel == 0) return at::empty({0}, options);
  const int64_t bytes = round_up(numel * itemsize);
  Block block = cache().take(bytes);
  if (block.data == nullptr) block = {c10::alloc_cpu(static_cast<size_t>(bytes)), bytes, 0};
  const int64_t block_bytes = block.bytes;
  return at::from_blob(
      block.data, {numel}, [block_bytes](void* data) { cache().give_back(data, block_bytes); },
      options);
}

CpuBufferCacheInfo cpu_buffer_cache_info() { return cache().info(); }

int64_t set_cpu_buffer_cache_limit(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "cpu buffer cache limit must be >= 0 bytes, got ", bytes);
  return cache().set_limit(bytes);
}

void empty_cpu_buffer_cache() { cache().empty(); }

}  // namespace zero_lifetime::ops
