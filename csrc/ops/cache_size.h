// The CPU's last-level cache size, for choosing when CPU fused copies bypass the cache.
#pragma once

#include <cstdint>
#include <string>

namespace zero_lifetime::ops {

// Bytes of the highest-level data or unified cache listed under `cpu_dir` (Linux sysfs, e.g.
// /sys/devices/system/cpu/cpu0: cache/index*/{level,type,size}); 0 when it cannot be read.
int64_t last_level_cache_bytes(const std::string& cpu_dir);

}  // namespace zero_lifetime::ops
