#include "lifetime_core.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace zero_lifetime {

namespace {
[[noreturn]] void throw_unknown(int64_t id) {
  throw std::invalid_argument("zero_lifetime: param id " + std::to_string(id) +
                              " is not registered");
}
}  // namespace

const char* policy_name(Policy policy) {
  return policy == Policy::Pin ? "pin" : "regather";
}

LifetimeCore::LifetimeCore(Policy policy, int64_t max_pinned_bytes)
    : policy_(policy), max_pinned_bytes_(max_pinned_bytes) {}

LifetimeCore::ParamState& LifetimeCore::state_locked(int64_t id) {
  auto it = params_.find(id);
  if (it == params_.end()) throw_unknown(id);
  return it->second;
}

const LifetimeCore::ParamState& LifetimeCore::state_locked(int64_t id) const {
  auto it = params_.find(id);
  if (it == params_.end()) throw_unknown(id);
  return it->second;
}

void LifetimeCore::pin_locked(ParamState& s) {
  s.pinned = true;
  stats_.pinned_params += 1;
  stats_.pinned_bytes += s.nbytes;
  stats_.peak_pinned_bytes = std::max(stats_.peak_pinned_bytes, stats_.pinned_bytes);
}

void LifetimeCore::unpin_locked(ParamState& s) {
  s.pinned = false;
  stats_.pinned_params -= 1;
  stats_.pinned_bytes -= s.nbytes;
}

void LifetimeCore::add_param(int64_t id, int64_t nbytes, bool persistent) {
  if (nbytes < 0) {
    throw std::invalid_argument("zero_lifetime: param id " + std::to_string(id) +
                                " has negative nbytes " + std::to_string(nbytes));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  auto [it, inserted] = params_.try_emplace(id);
  ParamState& s = it->second;
  if (!inserted && s.pinned) {
    // Keep the pinned total equal to the sum of the pinned params' current sizes.
    stats_.pinned_bytes += nbytes - s.nbytes;
    stats_.peak_pinned_bytes = std::max(stats_.peak_pinned_bytes, stats_.pinned_bytes);
  }
  s.nbytes = nbytes;
  s.persistent = persistent;
}

bool LifetimeCore::has_param(int64_t id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return params_.count(id) != 0;
}

void LifetimeCore::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  params_.clear();
  ranges_.clear();
  range_start_.clear();
  stats_.pinned_params = 0;
  stats_.pinned_bytes = 0;
  stats_.live_handles = 0;
}

AcquireResult LifetimeCore::acquire(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  ParamState& s = state_locked(id);
  s.refcount += 1;
  stats_.live_handles += 1;
  bool pinned_now = false;
  // Persistent params are never released by ZeRO-3, so pinning them would only waste budget.
  if (policy_ == Policy::Pin && !s.pinned && !s.persistent) {
    if (max_pinned_bytes_ < 0 || stats_.pinned_bytes + s.nbytes <= max_pinned_bytes_) {
      pin_locked(s);
      pinned_now = true;
    } else {
      stats_.pin_budget_fallbacks += 1;  // stays unpinned: backward will regather it
    }
  }
  return {s.refcount, pinned_now};
}

ReleaseResult LifetimeCore::release(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  ParamState& s = state_locked(id);
  if (s.refcount <= 0) {
    throw std::logic_error("zero_lifetime: refcount underflow for param id " +
                           std::to_string(id));
  }
  s.refcount -= 1;
  stats_.live_handles -= 1;
  bool unpinned_now = false;
  if (s.refcount == 0 && s.pinned) {
    unpin_locked(s);
    stats_.deferred_releases += 1;
    unpinned_now = true;
  }
  return {s.refcount, unpinned_now};
}

int64_t LifetimeCore::refcount(int64_t id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return state_locked(id).refcount;
}

bool LifetimeCore::is_pinned(int64_t id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return state_locked(id).pinned;
}

void LifetimeCore::note_regather(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  state_locked(id);  // validates the id
  stats_.regathers += 1;
}

std::vector<int64_t> LifetimeCore::force_unpin_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> ids;
  for (auto& [id, s] : params_) {
    if (s.pinned) {
      unpin_locked(s);
      ids.push_back(id);
    }
  }
  std::sort(ids.begin(), ids.end());  // deterministic order for callers and tests
  return ids;
}

std::vector<int64_t> LifetimeCore::pinned_ids() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> ids;
  for (const auto& [id, s] : params_) {
    if (s.pinned) ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

Stats LifetimeCore::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void LifetimeCore::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_pinned_bytes = stats_.pinned_bytes;
}

void LifetimeCore::clear_range_locked(int64_t id) {
  auto it = range_start_.find(id);
  if (it == range_start_.end()) return;
  ranges_.erase(it->second);
  range_start_.erase(it);
}

void LifetimeCore::set_range(int64_t id, uintptr_t start, int64_t nbytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  state_locked(id);  // validates the id
  const uintptr_t end = start + static_cast<uintptr_t>(std::max<int64_t>(nbytes, 0));
  if (end < start) {  // validated before touching the registry: a failed call changes nothing
    throw std::invalid_argument("zero_lifetime: address range of param id " +
                                std::to_string(id) + " wraps around");
  }
  if (nbytes > 0) {
    // The common case: the param was gathered to where it lived before (the caching
    // allocators hand the same blocks back). Nothing to move in the registry then, and
    // this runs for every gathered param on every forward.
    const auto known = range_start_.find(id);
    if (known != range_start_.end() && known->second == start) {
      const auto registered = ranges_.find(start);
      if (registered != ranges_.end() && registered->second.end == end && registered->second.id == id) return;
    }
  }
  clear_range_locked(id);
  if (nbytes <= 0) return;
  // Drop stale ranges overlapping [start, end): the first candidate is the range that
  // starts before `start`, if it reaches past it.
  auto it = ranges_.lower_bound(start);
  if (it != ranges_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.end > start) it = prev;
  }
  while (it != ranges_.end() && it->first < end) {
    range_start_.erase(it->second.id);
    it = ranges_.erase(it);
  }
  ranges_.emplace(start, Range{end, id});
  range_start_[id] = start;
}

void LifetimeCore::clear_range(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  clear_range_locked(id);
}

int64_t LifetimeCore::lookup(uintptr_t addr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = ranges_.upper_bound(addr);  // first range starting after addr
  if (it == ranges_.begin()) return -1;
  --it;
  return addr < it->second.end ? it->second.id : -1;
}

}  // namespace zero_lifetime
