#include "ops/copy_plan.h"

#include <c10/core/SymInt.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <tuple>

namespace zero_lifetime::ops {

namespace {

bool supported_dtype(c10::ScalarType t) {
  return t == c10::ScalarType::Float || t == c10::ScalarType::BFloat16 ||
         t == c10::ScalarType::Half;
}

// numel that also works on fake tensors with symbolic shapes (adds a guard there).
int64_t numel_of(const at::Tensor& t) {
  if (!t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return t.numel();  // hot path
  return t.sym_numel().guard_int(__FILE__, __LINE__);
}

void check_dtype(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(supported_dtype(t.scalar_type()), op, ": unsupported dtype ", t.scalar_type(),
              " for ", name, "; expected float32, bfloat16 or float16");
}

// The message is only built on failure: this runs once per tensor on the hot path.
void check_element_dtype(const char* op, size_t index, c10::ScalarType dtype) {
  TORCH_CHECK(supported_dtype(dtype), op, ": unsupported dtype ", dtype,
              " for tensors[", index, "]; expected float32, bfloat16 or float16");
}

// [first, last) bytes a possibly strided tensor can touch; {0, 0} when empty.
std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  const int64_t numel = t.numel();
  if (numel == 0) return {0, 0};
  int64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  auto start = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  return {start, start + static_cast<uintptr_t>(extent) * t.element_size()};
}

std::pair<uintptr_t, uintptr_t> byte_span(const SourceInfo& s) {
  if (s.numel == 0) return {0, 0};
  if (!s.contiguous) return byte_span(*s.tensor);  // rare: walk the strides
  auto start = reinterpret_cast<uintptr_t>(s.data);
  return {start, start + static_cast<uintptr_t>(s.numel) * c10::elementSize(s.dtype)};
}

// What the per-source aliasing test reads of the buffer, read once: const_data_ptr() checks
// the storage on every call, which was a visible cost per source with thousands of grads.
struct BufferMemory {
  explicit BufferMemory(const at::Tensor& buffer)
      : data(static_cast<const char*>(buffer.const_data_ptr())),
        dtype(buffer.scalar_type()),
        itemsize(static_cast<int64_t>(buffer.element_size())) {}
  const char* data;
  c10::ScalarType dtype;
  int64_t itemsize;
};

bool aliases_own_slice(const BufferMemory& buffer, const SourceInfo& s, int64_t offset) {
  return s.dtype == buffer.dtype && s.contiguous && s.data == buffer.data + offset * buffer.itemsize;
}

}  // namespace

void check_flat(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.layout() == c10::kStrided, op, ": ", name,
              " must be a dense (strided) tensor, got layout ", t.layout());
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), op, ": ", name,
              " must be a 1-D contiguous tensor, got sizes ", t.sym_sizes(), " strides ",
              t.sym_strides());
}

namespace {
std::atomic<CudaPlanRunner> registered_cuda_runner{nullptr};
std::atomic<int64_t> memcpy_segment_bytes{std::numeric_limits<int64_t>::max()};
}  // namespace

int64_t cuda_memcpy_segment_bytes() { return memcpy_segment_bytes.load(std::memory_order_relaxed); }

int64_t set_cuda_memcpy_segment_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "CUDA memcpy segment bytes must be >= 0, got ", bytes);
  return memcpy_segment_bytes.exchange(bytes, std::memory_order_relaxed);
}

void set_cuda_plan_runner(CudaPlanRunner runner) { registered_cuda_runner.store(runner); }

CudaPlanRunner cuda_plan_runner() { return registered_cuda_runner.load(std::memory_order_acquire); }

SourceInfo describe_source(const at::Tensor& t, bool with_memory) {
  SourceInfo s{&t, nullptr, numel_of(t), t.device(), t.scalar_type(), t.layout(), false};
  if (with_memory && s.layout == c10::kStrided) {  // sparse tensors have no data pointer
    s.contiguous = t.is_contiguous();
    s.data = t.const_data_ptr();
  }
  return s;
}

std::vector<SourceInfo> describe_sources(at::TensorList tensors, bool with_memory) {
  std::vector<SourceInfo> sources;
  sources.reserve(tensors.size());
  for (const at::Tensor& t : tensors) sources.push_back(describe_source(t, with_memory));
  return sources;
}

namespace {

using DestinationRanges = std::vector<std::tuple<int64_t, int64_t, size_t>>;

// (begin, end, index) of the non-empty destination ranges, sorted.
DestinationRanges sorted_destination_ranges(Sources sources, c10::IntArrayRef offsets) {
  DestinationRanges ranges;
  ranges.reserve(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    if (sources[i].numel > 0) ranges.emplace_back(offsets[i], offsets[i] + sources[i].numel, i);
  }
  if (!std::is_sorted(ranges.begin(), ranges.end())) std::sort(ranges.begin(), ranges.end());
  return ranges;
}

}  // namespace

void check_bucket_fill(const at::Tensor& buffer, Sources sources, c10::IntArrayRef offsets,
                       bool check_memory) {
  constexpr const char* op = "bucket_fill";
  check_flat(op, "buffer", buffer);
  check_dtype(op, "buffer", buffer);
  TORCH_CHECK(sources.size() == offsets.size(), op, ": got ", sources.size(),
              " tensors but ", offsets.size(), " offsets");
  const int64_t buffer_numel = numel_of(buffer);
  const c10::Device device = buffer.device();
  // DeepSpeed hands the ranges over in ascending order, which already proves them disjoint:
  // the sorted list of ranges is only built when they are not (or for the memory check).
  bool ascending_and_disjoint = true;
  int64_t previous_end = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    const SourceInfo& s = sources[i];
    TORCH_CHECK(s.device == device, op, ": tensors[", i, "] is on ", s.device,
                " but buffer is on ", device);
    check_element_dtype(op, i, s.dtype);
    TORCH_CHECK(s.layout == c10::kStrided, op, ": tensors[", i, "] has layout ", s.layout,
                "; expected a dense (strided) tensor");
    const int64_t offset = offsets[i];
    TORCH_CHECK(offset >= 0, op, ": offsets[", i, "] is negative (", offset, ")");
    const int64_t n = s.numel;
    // Written as a subtraction: offset + n could overflow for absurd offsets.
    TORCH_CHECK(offset <= buffer_numel - n, op, ": tensors[", i, "] (", n,
                " elements at offset ", offset, ") is out of bounds of the buffer (",
                buffer_numel, " elements)");
    if (n > 0) {
      ascending_and_disjoint = ascending_and_disjoint && offset >= previous_end;
      previous_end = offset + n;
    }
  }
  DestinationRanges ranges;
  if (!ascending_and_disjoint) {
    ranges = sorted_destination_ranges(sources, offsets);
    for (size_t k = 1; k < ranges.size(); ++k) {
      const auto& [a0, a1, i] = ranges[k - 1];
      const auto& [b0, b1, j] = ranges[k];
      TORCH_CHECK(b0 >= a1, op, ": destination ranges overlap: tensors[", i, "] [", a0, ", ",
                  a1, ") and tensors[", j, "] [", b0, ", ", b1, ")");
    }
  }
  if (!check_memory) return;

  // A source may share memory with the buffer only as exactly its own destination slice
  // (DeepSpeed may already have re-pointed a grad there); any other overlap with a
  // destination range would be read after (or while) it is overwritten.
  const BufferMemory memory(buffer);
  const auto base = reinterpret_cast<uintptr_t>(memory.data);
  const auto itemsize = static_cast<uintptr_t>(memory.itemsize);
  const uintptr_t buffer_end = base + static_cast<uintptr_t>(buffer_numel) * itemsize;
  for (size_t i = 0; i < sources.size(); ++i) {
    const auto [lo, hi] = byte_span(sources[i]);
    if (lo == hi || hi <= base || lo >= buffer_end) continue;
    if (aliases_own_slice(memory, sources[i], offsets[i])) continue;
    if (ranges.empty()) ranges = sorted_destination_ranges(sources, offsets);
    // First destination range ending after `lo`; it overlaps if it also starts before `hi`.
    const int64_t first_elem = static_cast<int64_t>((std::max(lo, base) - base) / itemsize);
    auto it = std::upper_bound(ranges.begin(), ranges.end(), first_elem,
                               [](int64_t e, const auto& r) { return e < std::get<1>(r); });
    if (it == ranges.end()) continue;
    const auto& [r0, r1, j] = *it;
    TORCH_CHECK(base + static_cast<uintptr_t>(r0) * itemsize >= hi, op, ": tensors[", i,
                "] overlaps the destination range of tensors[", j,
                "] in the buffer; it may only alias exactly its own destination slice");
  }
}

void check_gather_copy_out(const at::Tensor& gathered, const at::Tensor& out,
                           c10::IntArrayRef shard_numels, c10::IntArrayRef numels,
                           int64_t world_size, bool check_memory) {
  constexpr const char* op = "gather_copy_out";
  check_flat(op, "gathered", gathered);
  check_flat(op, "out", out);
  check_dtype(op, "gathered", gathered);
  check_dtype(op, "out", out);
  TORCH_CHECK(out.device() == gathered.device(), op, ": out is on ", out.device(),
              " but gathered is on ", gathered.device());
  TORCH_CHECK(world_size >= 1, op, ": world_size must be >= 1, got ", world_size);
  TORCH_CHECK(shard_numels.size() == numels.size(), op, ": got ", shard_numels.size(),
              " shard_numels but ", numels.size(), " numels");
  int64_t segment = 0;
  int64_t total = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t shard = shard_numels[i];
    const int64_t n = numels[i];
    TORCH_CHECK(shard >= 0 && n >= 0, op, ": shard_numels[", i, "] (", shard, ") and numels[",
                i, "] (", n, ") must be >= 0");
    TORCH_CHECK(shard == 0 ? n == 0 : (n - 1) / shard < world_size, op, ": numels[", i, "] (",
                n, ") exceeds world_size * shard_numels[", i, "] (", world_size, " * ", shard,
                ")");
    segment += shard;
    total += n;
  }
  const int64_t expected = world_size * segment;
  TORCH_CHECK(numel_of(gathered) == expected, op, ": gathered has ", numel_of(gathered),
              " elements, expected world_size * sum(shard_numels) = ", expected);
  TORCH_CHECK(numel_of(out) == total, op, ": out has ", numel_of(out),
              " elements, expected sum(numels) = ", total);
  if (!check_memory) return;
  const auto [g0, g1] = byte_span(gathered);
  const auto [o0, o1] = byte_span(out);
  TORCH_CHECK(g0 == g1 || o0 == o1 || g1 <= o0 || o1 <= g0, op,
              ": out overlaps gathered in memory");
}

CopyPlan plan_bucket_fill(const at::Tensor& buffer, Sources sources, c10::IntArrayRef offsets,
                          double scale) {
  CopyPlan plan;
  plan.dst = buffer.data_ptr();
  plan.dst_dtype = buffer.scalar_type();
  plan.scale = static_cast<float>(scale);
  plan.segments.reserve(sources.size());
  const BufferMemory memory(buffer);
  for (size_t i = 0; i < sources.size(); ++i) {
    const SourceInfo& s = sources[i];
    if (s.numel == 0) continue;
    if (aliases_own_slice(memory, s, offsets[i])) {
      if (plan.scale == 1.0f) continue;  // already in place
      // else: an element-wise in-place scale, each element read before it is written
    }
    const void* src = s.data;
    if (!s.contiguous) {
      plan.keep_alive.push_back(s.tensor->contiguous());
      src = plan.keep_alive.back().const_data_ptr();
    }
    plan.segments.push_back({src, offsets[i], s.numel, s.dtype});
    plan.total_numel += s.numel;
  }
  return plan;
}

CopyPlan plan_gather_copy_out(const at::Tensor& gathered, const at::Tensor& out,
                              c10::IntArrayRef shard_numels, c10::IntArrayRef numels,
                              int64_t world_size) {
  CopyPlan plan;
  plan.dst = out.data_ptr();
  plan.dst_dtype = out.scalar_type();
  int64_t segment = 0;
  for (int64_t shard : shard_numels) segment += shard;
  const auto* src = static_cast<const char*>(gathered.const_data_ptr());
  const int64_t itemsize = gathered.element_size();
  plan.segments.reserve(numels.size() * static_cast<size_t>(world_size));
  int64_t src_offset = 0;
  int64_t dst_offset = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t shard = shard_numels[i];
    for (int64_t rank = 0; rank < world_size; ++rank) {
      const int64_t take = std::min(shard, numels[i] - rank * shard);
      if (take <= 0) break;  // the rest of this param is padding
      plan.segments.push_back({src + (rank * segment + src_offset) * itemsize,
                               dst_offset + rank * shard, take, gathered.scalar_type()});
      plan.total_numel += take;
    }
    src_offset += shard;
    dst_offset += numels[i];
  }
  return plan;
}

}  // namespace zero_lifetime::ops
