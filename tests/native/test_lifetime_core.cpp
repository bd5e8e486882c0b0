// Native tests for the torch-free core (built and run by CTest, see CMakeLists.txt).
// A tiny self-made CHECK keeps the build free of downloads; every failure is reported
// with file:line and the run continues, so one run shows all failures.
#include "core/lifetime_core.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

using zero_lifetime::LifetimeCore;
using zero_lifetime::Policy;

namespace {
int g_failures = 0;

#define CHECK(cond)                                                      \
  do {                                                                   \
    if (!(cond)) {                                                       \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                      \
    }                                                                    \
  } while (0)

#define CHECK_EQ(a, b)                                                               \
  do {                                                                               \
    const auto va = (a);                                                             \
    const auto vb = (b);                                                             \
    if (!(va == vb)) {                                                               \
      std::fprintf(stderr, "%s:%d: CHECK_EQ failed: %s == %s (%lld vs %lld)\n", __FILE__, \
                   __LINE__, #a, #b, static_cast<long long>(va), static_cast<long long>(vb)); \
      ++g_failures;                                                                  \
    }                                                                                \
  } while (0)

template <typename Exception>
bool throws(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Exception&) {
    return true;
  } catch (...) {
    return false;
  }
  return false;
}

void test_refcounts_regather_policy() {
  LifetimeCore core(Policy::Regather, -1);
  core.add_param(1, 400, false);
  CHECK(core.has_param(1));
  CHECK(!core.has_param(2));
  auto a1 = core.acquire(1);
  auto a2 = core.acquire(1);
  CHECK_EQ(a1.refcount, 1);
  CHECK_EQ(a2.refcount, 2);
  CHECK(!a1.pinned_now && !a2.pinned_now);  // Regather never pins
  CHECK(!core.is_pinned(1));
  CHECK_EQ(core.stats().live_handles, 2);
  auto r1 = core.release(1);
  auto r2 = core.release(1);
  CHECK_EQ(r1.refcount, 1);
  CHECK_EQ(r2.refcount, 0);
  CHECK(!r2.unpinned_now);
  const auto s = core.stats();
  CHECK_EQ(s.live_handles, 0);
  CHECK_EQ(s.deferred_releases, 0);
  CHECK_EQ(s.pin_budget_fallbacks, 0);
  core.note_regather(1);
  core.note_regather(1);
  CHECK_EQ(core.stats().regathers, 2);
}

void test_pin_and_deferred_release() {
  LifetimeCore core(Policy::Pin, -1);
  core.add_param(7, 1000, false);
  auto a1 = core.acquire(7);
  CHECK(a1.pinned_now);
  auto a2 = core.acquire(7);
  CHECK(!a2.pinned_now);  // already pinned
  CHECK(core.is_pinned(7));
  CHECK_EQ(core.stats().pinned_params, 1);
  CHECK_EQ(core.stats().pinned_bytes, 1000);
  CHECK(!core.release(7).unpinned_now);  // still referenced
  CHECK(core.is_pinned(7));
  auto last = core.release(7);
  CHECK(last.unpinned_now);
  CHECK_EQ(last.refcount, 0);
  CHECK(!core.is_pinned(7));
  const auto s = core.stats();
  CHECK_EQ(s.pinned_params, 0);
  CHECK_EQ(s.pinned_bytes, 0);
  CHECK_EQ(s.deferred_releases, 1);
  CHECK_EQ(s.peak_pinned_bytes, 1000);
}

void test_persistent_never_pinned() {
  LifetimeCore core(Policy::Pin, 10);  // budget too small anyway: must not count as fallback
  core.add_param(1, 100, true);
  CHECK(!core.acquire(1).pinned_now);
  CHECK(!core.is_pinned(1));
  CHECK_EQ(core.stats().pin_budget_fallbacks, 0);
  CHECK(!core.release(1).unpinned_now);
  CHECK_EQ(core.stats().deferred_releases, 0);
}

void test_pin_budget_and_fallback() {
  LifetimeCore core(Policy::Pin, 100);
  core.add_param(1, 60, false);
  core.add_param(2, 50, false);
  core.add_param(3, 40, false);
  CHECK(core.acquire(1).pinned_now);  // 60 <= 100
  auto b = core.acquire(2);           // 60 + 50 > 100
  CHECK(!b.pinned_now);
  CHECK_EQ(b.refcount, 1);            // still counted, just not pinned
  CHECK(!core.is_pinned(2));
  CHECK_EQ(core.stats().pin_budget_fallbacks, 1);
  CHECK(core.acquire(3).pinned_now);  // 60 + 40 == 100: exactly fits
  CHECK_EQ(core.stats().pinned_bytes, 100);
  CHECK(!core.acquire(2).pinned_now);  // still no room
  CHECK_EQ(core.stats().pin_budget_fallbacks, 2);
  CHECK(!core.release(2).unpinned_now);  // an unpinned param is not a deferred release
  CHECK(core.release(1).unpinned_now);
  CHECK(core.acquire(2).pinned_now);  // room again: a referenced, unpinned param pins now
  CHECK_EQ(core.refcount(2), 2);
  CHECK_EQ(core.stats().pinned_bytes, 90);
  CHECK_EQ(core.stats().peak_pinned_bytes, 100);
  CHECK_EQ(core.stats().live_handles, 3);

  LifetimeCore zero_budget(Policy::Pin, 0);
  zero_budget.add_param(1, 4, false);
  CHECK(!zero_budget.acquire(1).pinned_now);
  CHECK_EQ(zero_budget.stats().pin_budget_fallbacks, 1);
}

void test_errors() {
  LifetimeCore core(Policy::Pin, -1);
  core.add_param(1, 8, false);
  CHECK(throws<std::logic_error>([&] { core.release(1); }));  // underflow
  CHECK_EQ(core.refcount(1), 0);                                 // unchanged by the failure
  CHECK_EQ(core.stats().live_handles, 0);
  CHECK(throws<std::logic_error>([&] { core.release(99); }));  // unknown id
  CHECK(throws<std::invalid_argument>([&] { core.acquire(99); }));
  CHECK(throws<std::invalid_argument>([&] { core.refcount(99); }));
  CHECK(throws<std::invalid_argument>([&] { core.is_pinned(99); }));
  CHECK(throws<std::invalid_argument>([&] { core.note_regather(99); }));
  CHECK(throws<std::invalid_argument>([&] { core.set_range(99, 0x1000, 8); }));
  CHECK(throws<std::invalid_argument>([&] { core.add_param(2, -1, false); }));
}

void test_force_unpin_all() {
  LifetimeCore core(Policy::Pin, -1);
  for (int64_t id : {5, 3, 9}) core.add_param(id, 10 * id, false);
  core.add_param(4, 40, true);  // persistent: never pinned, never returned
  for (int64_t id : {5, 3, 9, 4}) core.acquire(id);
  core.acquire(3);
  CHECK((core.pinned_ids() == std::vector<int64_t>{3, 5, 9}));
  auto ids = core.force_unpin_all();
  CHECK((ids == std::vector<int64_t>{3, 5, 9}));
  CHECK(core.pinned_ids().empty());
  CHECK_EQ(core.refcount(3), 2);  // refcounts untouched
  CHECK_EQ(core.refcount(5), 1);
  auto s = core.stats();
  CHECK_EQ(s.pinned_params, 0);
  CHECK_EQ(s.pinned_bytes, 0);
  CHECK_EQ(s.live_handles, 5);
  CHECK_EQ(s.peak_pinned_bytes, 170);
  // Releasing what was force-unpinned is an ordinary release, not a deferred one.
  CHECK(!core.release(5).unpinned_now);
  CHECK_EQ(core.stats().deferred_releases, 0);
  CHECK(core.force_unpin_all().empty());
}

void test_peak_and_readd() {
  LifetimeCore core(Policy::Pin, -1);
  core.add_param(1, 60, false);
  core.add_param(2, 30, false);
  core.acquire(1);
  core.acquire(2);
  CHECK_EQ(core.stats().peak_pinned_bytes, 90);
  core.release(1);
  CHECK_EQ(core.stats().pinned_bytes, 30);
  CHECK_EQ(core.stats().peak_pinned_bytes, 90);  // peak survives the drop
  core.reset_peak();
  CHECK_EQ(core.stats().peak_pinned_bytes, 30);
  // Re-adding a pinned param updates its size and the pinned total, keeps counts.
  core.add_param(2, 50, false);
  CHECK_EQ(core.refcount(2), 1);
  CHECK(core.is_pinned(2));
  CHECK_EQ(core.stats().pinned_bytes, 50);
  CHECK_EQ(core.stats().peak_pinned_bytes, 50);
  CHECK(core.release(2).unpinned_now);
  CHECK_EQ(core.stats().pinned_bytes, 0);
}

void test_ranges() {
  LifetimeCore core(Policy::Regather, -1);
  for (int64_t id = 1; id <= 4; ++id) core.add_param(id, 64, false);
  CHECK_EQ(core.lookup(0x1000), -1);  // empty registry
  core.set_range(1, 0x1000, 0x100);
  core.set_range(2, 0x1100, 0x100);  // adjacent to 1
  CHECK_EQ(core.lookup(0x0fff), -1);  // below everything
  CHECK_EQ(core.lookup(0x1000), 1);   // start is inclusive
  CHECK_EQ(core.lookup(0x10ff), 1);
  CHECK_EQ(core.lookup(0x1100), 2);   // end is exclusive: next range's start
  CHECK_EQ(core.lookup(0x11ff), 2);
  CHECK_EQ(core.lookup(0x1200), -1);  // past the last range
  CHECK_EQ(core.lookup(0), -1);
  CHECK_EQ(core.lookup(std::numeric_limits<uintptr_t>::max()), -1);

  core.set_range(1, 0x5000, 0x10);  // re-gathered elsewhere: old range gone
  CHECK_EQ(core.lookup(0x1000), -1);
  CHECK_EQ(core.lookup(0x5008), 1);
  core.set_range(1, 0x5000, 0x10);  // gathered to the same place again: nothing moves
  CHECK_EQ(core.lookup(0x5008), 1);
  CHECK_EQ(core.lookup(0x5010), -1);
  core.set_range(1, 0x5000, 0x20);  // same start, longer: the end moves
  CHECK_EQ(core.lookup(0x5018), 1);
  core.set_range(1, 0x5000, 0x10);  // and back
  CHECK_EQ(core.lookup(0x5018), -1);
  CHECK_EQ(core.lookup(0x500f), 1);

  // A stale range (id 2 never cleared) overlapped by new memory is evicted.
  core.set_range(3, 0x10f0, 0x20);
  CHECK_EQ(core.lookup(0x1100), 3);
  CHECK_EQ(core.lookup(0x1180), -1);  // id 2's whole range is gone, not just the overlap
  core.set_range(4, 0x4ff0, 0x100);   // overlaps id 1's range from below
  CHECK_EQ(core.lookup(0x5008), 4);

  core.clear_range(4);
  CHECK_EQ(core.lookup(0x5008), -1);
  core.clear_range(4);  // clearing twice is harmless
  core.set_range(2, 0x9000, 0);  // empty param: nothing to look up
  CHECK_EQ(core.lookup(0x9000), -1);

  // Near the top of the address space: last byte found, one past the end not,
  // and a range that would wrap around is rejected instead of silently matching low addresses.
  const uintptr_t high = std::numeric_limits<uintptr_t>::max() - 0x1ff;
  core.set_range(2, high, 0x100);
  CHECK_EQ(core.lookup(high + 0xff), 2);
  CHECK_EQ(core.lookup(high + 0x100), -1);
  CHECK(throws<std::invalid_argument>([&] { core.set_range(2, high, 0x300); }));
  CHECK_EQ(core.lookup(high), 2);  // a failed set_range leaves the registry unchanged

  core.clear();
  CHECK(!core.has_param(1));
  CHECK_EQ(core.lookup(0x10f0), -1);
}

// 8 threads acquire/release random ids while one more thread churns address ranges and
// reads stats; afterwards every count must be back to 0 and the stats must agree with
// the events the threads observed.
void test_threaded_stress() {
  constexpr int kThreads = 8;
  constexpr int kIterations = 100000;
  constexpr int64_t kParams = 32;
  constexpr int64_t kBudget = 10 * 64;  // room for ~10 of the 32 params at once
  LifetimeCore core(Policy::Pin, kBudget);
  for (int64_t id = 0; id < kParams; ++id) core.add_param(id, 64, id % 8 == 0);

  std::atomic<int64_t> pinned_events{0}, unpinned_events{0}, observer_rounds{0};
  std::atomic<bool> stop{false};
  std::atomic<bool> invariant_broken{false};

  auto worker = [&](unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int64_t> pick(0, kParams - 1);
    std::vector<int64_t> held;
    for (int i = 0; i < kIterations; ++i) {
      if (held.empty() || (rng() & 1)) {
        int64_t id = pick(rng);
        if (core.acquire(id).pinned_now) pinned_events++;
        held.push_back(id);
      } else {
        std::uniform_int_distribution<size_t> which(0, held.size() - 1);
        size_t k = which(rng);
        if (core.release(held[k]).unpinned_now) unpinned_events++;
        held[k] = held.back();
        held.pop_back();
      }
    }
    for (int64_t id : held) {
      if (core.release(id).unpinned_now) unpinned_events++;
    }
  };
  auto observer = [&] {
    uintptr_t base = 0x100000;
    while (!stop.load()) {
      const auto s = core.stats();
      if (s.pinned_bytes > kBudget || s.pinned_bytes < 0 || s.live_handles < 0) {
        invariant_broken = true;
      }
      core.set_range(base % kParams, base, 64);
      (void)core.lookup(base + 8);
      base += 64;
      observer_rounds++;
    }
  };

  std::thread obs(observer);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, 1234u + t);
  for (auto& th : threads) th.join();
  stop = true;
  obs.join();

  const auto s = core.stats();
  for (int64_t id = 0; id < kParams; ++id) {
    CHECK_EQ(core.refcount(id), 0);
    CHECK(!core.is_pinned(id));
  }
  CHECK(!invariant_broken.load());
  CHECK_EQ(s.live_handles, 0);
  CHECK_EQ(s.pinned_params, 0);
  CHECK_EQ(s.pinned_bytes, 0);
  CHECK_EQ(pinned_events.load(), unpinned_events.load());  // every pin was undone once
  CHECK_EQ(s.deferred_releases, unpinned_events.load());
  CHECK(s.peak_pinned_bytes <= kBudget);
  CHECK(s.peak_pinned_bytes > 0);
  CHECK(s.pin_budget_fallbacks > 0);  // the budget was actually exercised
  CHECK(observer_rounds.load() > 0);
}
}  // namespace

int main() {
  test_refcounts_regather_policy();
  test_pin_and_deferred_release();
  test_persistent_never_pinned();
  test_pin_budget_and_fallback();
  test_errors();
  test_force_unpin_all();
  test_peak_and_readd();
  test_ranges();
  test_threaded_stress();
  if (g_failures != 0) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("all lifetime_core checks passed\n");
  return 0;
}
