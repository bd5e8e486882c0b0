// Fused copy ops (bucket_fill, gather_copy_out): both reduce to a CopyPlan, a list of
// contiguous source runs written, scaled and cast, into one flat destination. The checks
// and the planning are shared by the CPU, CUDA and Meta kernels; only running a plan is
// device specific.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
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

// The sources of a bucket_fill as pointers: the dispatcher hands over a TensorList, the
// CPU fast path (fast_path.cpp) borrows the tensors of Python objects without copying
// them (a copy of a Python-owned tensor costs a GIL round trip for its PyObject).
using TensorRefs = c10::ArrayRef<const at::Tensor*>;
std::vector<const at::Tensor*> tensor_refs(at::TensorList tensors);

// Argument checks (TORCH_CHECK); `check_memory` adds the pointer-based aliasing checks,
// which meta tensors have no memory for. Work on symbolic shapes (fake tensors) too.
void check_bucket_fill(const at::Tensor& buffer, TensorRefs tensors, c10::IntArrayRef offsets,
                       bool check_memory);
inline void check_bucket_fill(const at::Tensor& buffer, at::TensorList tensors,
                              c10::IntArrayRef offsets, bool check_memory) {
  check_bucket_fill(buffer, TensorRefs(tensor_refs(tensors)), offsets, check_memory);
}
void check_gather_copy_out(const at::Tensor& gathered, const at::Tensor& out,
                           c10::IntArrayRef shard_numels, c10::IntArrayRef numels,
                           int64_t world_size, bool check_memory);

// Plans of already checked arguments.
CopyPlan plan_bucket_fill(const at::Tensor& buffer, TensorRefs tensors, c10::IntArrayRef offsets,
                          double scale);
inline CopyPlan plan_bucket_fill(const at::Tensor& buffer, at::TensorList tensors,
                                 c10::IntArrayRef offsets, double scale) {
  return plan_bucket_fill(buffer, TensorRefs(tensor_refs(tensors)), offsets, scale);
}
CopyPlan plan_gather_copy_out(const at::Tensor& gathered, const at::Tensor& out,
                              c10::IntArrayRef shard_numels, c10::IntArrayRef numels,
                              int64_t world_size);

void run_plan_cpu(const CopyPlan& plan);

// Runs a plan on the current CUDA stream of dst's device. Set by copy_plan_cuda.cu when it
// is compiled in (a registration, not a symbol: CPU-only builds must link without it), so
// the direct Python entries (fast_path.cpp, built by the host compiler) can reach it.
using CudaPlanRunner = void (*)(const CopyPlan& plan, const at::Tensor& dst);
void set_cuda_plan_runner(CudaPlanRunner runner);
CudaPlanRunner cuda_plan_runner();  // nullptr in a build without CUDA kernels

}  // namespace zero_lifetime::ops
