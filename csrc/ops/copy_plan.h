// Fused copy ops (bucket_fill, gather_copy_out): both reduce to a CopyPlan, a list of
// contiguous source runs written, scaled and cast, into one flat destination. The checks
// and the planning are shared by the CPU, CUDA and Meta kernels; only running a plan is
// device specific.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>
#include <vector>

namespace zero_lifetime::ops {

// One contiguous run of `numel` source elements written at dst element `dst_offset`.
struct CopySegment {
  const void* src;
  int64_t dst_offset;
  int64_t numel;
  c10::ScalarType src_dtype;
};

struct CopyPlan {
  void* dst = nullptr;
  c10::ScalarType dst_dtype = c10::ScalarType::Float;
  float scale = 1.0f;
  std::vector<CopySegment> segments;    // non-empty runs, destinations disjoint
  std::vector<at::Tensor> keep_alive;   // contiguous copies of strided sources
  int64_t total_numel = 0;              // sum of segments' numel
};

// What the checks and the plan read of one bucket_fill source, read in one pass over the
// tensors: a bucket of thousands of small grads costs cache misses per tensor for every
// pass over their TensorImpls, as much as copying their bytes (8192 x 4 KB on CPU).
struct SourceInfo {
  const at::Tensor* tensor = nullptr;  // borrowed: strided sources (made contiguous), errors
  const void* data = nullptr;          // nullptr without memory (meta and fake tensors)
  int64_t numel = 0;
  c10::Device device{c10::kCPU};
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Layout layout = c10::kStrided;  // anything else is refused (no memory read for it)
  bool contiguous = false;             // false without memory: not asked of symbolic shapes
};
using Sources = c10::ArrayRef<SourceInfo>;

// `with_memory`: read the data pointer and layout too (real tensors; not meta or fake ones).
SourceInfo describe_source(const at::Tensor& t, bool with_memory);
std::vector<SourceInfo> describe_sources(at::TensorList tensors, bool with_memory);

// `t` is a dense 1-D contiguous tensor (TORCH_CHECK, naming `op` and the argument `name`).
void check_flat(const char* op, const char* name, const at::Tensor& t);

// Argument checks (TORCH_CHECK); `check_memory` adds the pointer-based aliasing checks,
// which meta tensors have no memory for (then sources come from describe_source(t, false)).
// Work on symbolic shapes (fake tensors) too.
void check_bucket_fill(const at::Tensor& buffer, Sources sources, c10::IntArrayRef offsets,
                       bool check_memory);
void check_gather_copy_out(const at::Tensor& gathered, const at::Tensor& out,
                           c10::IntArrayRef shard_numels, c10::IntArrayRef numels,
                           int64_t world_size, bool check_memory);

// Plans of already checked arguments.
CopyPlan plan_bucket_fill(const at::Tensor& buffer, Sources sources, c10::IntArrayRef offsets,
                          double scale);
CopyPlan plan_gather_copy_out(const at::Tensor& gathered, const at::Tensor& out,
                              c10::IntArrayRef shard_numels, c10::IntArrayRef numels,
                              int64_t world_size);

void run_plan_cpu(const CopyPlan& plan);

// CPU plans whose destination holds at least this many bytes use non-temporal stores (x86-64
// builds; elsewhere never). Default: the last-level cache's size (Linux sysfs, cpu0) up to
// 96 MiB, 32 MiB where it cannot be read. The setter returns the previous value.
int64_t streaming_store_threshold();
int64_t set_streaming_store_threshold(int64_t bytes);
// The default for a machine whose sysfs cpu directory is `cpu_dir`.
int64_t default_streaming_store_threshold(const std::string& cpu_dir);

// CUDA plans with no cast and no scale whose every segment holds at least this many bytes
// (and that have at most kMaxMemcpySegments segments) run as one cudaMemcpyAsync per segment,
// the call torch's own contiguous copy_ makes, instead of the fused kernel. Default: never
// (INT64_MAX) until measured on a GPU, where benchmarks/profile_ops.py (its "memcpy" way)
// compares the two. The setter returns the previous value.
constexpr int64_t kMaxMemcpySegments = 64;
int64_t cuda_memcpy_segment_bytes();
int64_t set_cuda_memcpy_segment_bytes(int64_t bytes);

// Runs a plan on the current CUDA stream of dst's device. Set by copy_plan_cuda.cu when it
// is compiled in (a registration, not a symbol: CPU-only builds must link without it), so
// the direct Python entries (fast_path.cpp, built by the host compiler) can reach it.
using CudaPlanRunner = void (*)(const CopyPlan& plan, const at::Tensor& dst);
void set_cuda_plan_runner(CudaPlanRunner runner);
CudaPlanRunner cuda_plan_runner();  // nullptr in a build without CUDA kernels

}  // namespace zero_lifetime::ops
