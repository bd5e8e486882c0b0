// Reference counting, pin policy and address-range registry for ZeRO-3 params that
// autograd saved for backward. Pure C++17: no torch or Python dependency, so it is
// unit-tested (and sanitized) on its own; csrc/tracker_binding.cpp wraps it for Python.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace zero_lifetime {

enum class Policy {
  Regather,  // never keep params gathered for backward: re-gather on unpack
  Pin,       // keep a referenced param gathered until its last saved reference dies
};

struct AcquireResult {
  int64_t refcount;
  bool pinned_now;  // this acquire pinned the param
};

struct ReleaseResult {
  int64_t refcount;
  bool unpinned_now;  // the count hit 0 on a pinned param, which is now unpinned
};

struct Stats {
  int64_t pinned_params = 0;
  int64_t pinned_bytes = 0;
  int64_t peak_pinned_bytes = 0;   // max pinned_bytes since construction / reset_peak()
  int64_t deferred_releases = 0;   // pinned params whose release waited for the last reference
  int64_t regathers = 0;           // unpacks that had to gather a released param again
  int64_t live_handles = 0;        // sum of all refcounts
  int64_t pin_budget_fallbacks = 0;  // acquires that could not pin for lack of budget
};

// Thread-safe: handles are destroyed on autograd worker threads and by the garbage
// collector, so every method takes one internal mutex (the critical sections are tiny).
// Unknown ids raise std::invalid_argument (a std::logic_error).
class LifetimeCore {
 public:
  LifetimeCore(Policy policy, int64_t max_pinned_bytes);  // max < 0: unlimited

  // Re-adding an id updates nbytes / persistent and keeps its counts and pin state.
  void add_param(int64_t id, int64_t nbytes, bool persistent);
  bool has_param(int64_t id) const;
  // Forget every param and range; counts and pins go with them (peak and the event
  // counters are kept).
  void clear();

  AcquireResult acquire(int64_t id);
  ReleaseResult release(int64_t id);  // throws std::logic_error on underflow
  int64_t refcount(int64_t id) const;
  bool is_pinned(int64_t id) const;
  void note_regather(int64_t id);

  // Fault recovery: unpins everything, refcounts untouched; returns the ids that were pinned.
  std::vector<int64_t> force_unpin_all();
  std::vector<int64_t> pinned_ids() const;

  Stats stats() const;
  void reset_peak();

  Policy policy() const { return policy_; }
  int64_t max_pinned_bytes() const { return max_pinned_bytes_; }

  // Address-range registry: identifies a saved tensor by the address of its data.
  // Ranges are kept disjoint: setting a range drops the id's previous range and any
  // stale range it overlaps (memory reused without clear_range). nbytes <= 0 only clears.
  void set_range(int64_t id, uintptr_t start, int64_t nbytes);
  void clear_range(int64_t id);
  int64_t lookup(uintptr_t addr) const;  // id whose [start, start+nbytes) holds addr, else -1

 private:
  struct ParamState {
    int64_t nbytes = 0;
    bool persistent = false;
    int64_t refcount = 0;
    bool pinned = false;
  };
  struct Range {
    uintptr_t end;
    int64_t id;
  };

  ParamState& state_locked(int64_t id);
  const ParamState& state_locked(int64_t id) const;
  void pin_locked(ParamState& s);
  void unpin_locked(ParamState& s);
  void clear_range_locked(int64_t id);

  const Policy policy_;
  const int64_t max_pinned_bytes_;
  mutable std::mutex mutex_;
  std::unordered_map<int64_t, ParamState> params_;
  Stats stats_;
  std::map<uintptr_t, Range> ranges_;                 // start -> (end, id), disjoint
  std::unordered_map<int64_t, uintptr_t> range_start_;  // id -> start
};

const char* policy_name(Policy policy);

}  // namespace zero_lifetime
