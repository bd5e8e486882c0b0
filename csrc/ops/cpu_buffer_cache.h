// CPU buffers for fused ZeRO-3 gathers, recycled when their storage dies.
//
// Each fused gather writes a module's params into one new buffer, often tens of MB. glibc
// serves a request of 32 MiB or more with a fresh mmap every time, and below that the freed
// hole often does not fit the next aligned request of the same size (posix_memalign asks
// for more), so the heap grows instead: either way every gather faults in all its pages
// again. On the CPU of docs/benchmarks.md that made the fused wait of 16 x 1M fp32 take
// 22 ms vs 4.7 ms for DeepSpeed's per-param torch.cat. A buffer released here is handed to
// the next gather of about its size with its pages still mapped.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace zero_lifetime::ops {

struct CpuBufferCacheInfo {
  int64_t cached_bytes;  // released blocks held now
  int64_t cached_blocks;
  int64_t limit_bytes;
  int64_t hits;          // requests served by a cached block
  int64_t misses;        // requests that allocated
};

// An uninitialized 1-D contiguous CPU tensor of `numel` elements. Its memory returns to the
// cache when its storage dies (kept while the cache stays within its limit, else freed).
at::Tensor cpu_gather_buffer(int64_t numel, c10::ScalarType dtype);

CpuBufferCacheInfo cpu_buffer_cache_info();
// Bytes of released blocks the cache may hold; 0 disables it and frees what it holds.
// Returns the previous limit.
int64_t set_cpu_buffer_cache_limit(int64_t bytes);
void empty_cpu_buffer_cache();

}  // namespace zero_lifetime::ops
