#include "ops/cache_size.h"

#include <fstream>
#include <limits>

namespace zero_lifetime::ops {

namespace {

bool read_line(const std::string& path, std::string& line) {
  std::ifstream in(path);
  return static_cast<bool>(std::getline(in, line));
}

// sysfs sizes read "32768K"; a bare number is bytes. 0 for anything else.
int64_t parse_size(const std::string& text) {
  size_t digits = 0;
  int64_t value = 0;
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max() >> 30;  // room for the unit
  for (; digits < text.size() && text[digits] >= '0' && text[digits] <= '9'; ++digits) {
    value = value * 10 + (text[digits] - '0');
    if (value > kMax) return 0;
  }
  if (digits == 0) return 0;
  const std::string unit = text.substr(digits);
  if (unit.empty()) return value;
  if (unit == "K") return value << 10;
  if (unit == "M") return value << 20;
  if (unit == "G") return value << 30;
  return 0;
}

}  // namespace

int64_t last_level_cache_bytes(const std::string& cpu_dir) {
  int best_level = 0;
  int64_t best_bytes = 0;
  for (int index = 0; index < 16; ++index) {  // sysfs numbers them densely from 0
    const std::string dir = cpu_dir + "/cache/index" + std::to_string(index) + "/";
    std::string level_text, type, size_text;
    if (!read_line(dir + "level", level_text)) break;
    if (!read_line(dir + "type", type) || !read_line(dir + "size", size_text)) continue;
    if (type != "Data" && type != "Unified") continue;  // an instruction cache holds no copy
    int level = 0;
    try {
      level = std::stoi(level_text);
    } catch (const std::exception&) {
      continue;
    }
    const int64_t bytes = parse_size(size_text);
    if (bytes > 0 && level > best_level) {
      best_level = level;
      best_bytes = bytes;
    }
  }
  return best_bytes;
}

}  // namespace zero_lifetime::ops
