// torch.ops.zero_lifetime: schemas, and the CPU and Meta kernels. The CUDA kernels
// register themselves in copy_plan_cuda.cu, which only CUDA builds compile.
#include <torch/library.h>

#include "ops/copy_plan.h"

namespace zero_lifetime::ops {

namespace {

void bucket_fill_cpu(const at::Tensor& buffer, at::TensorList tensors,
                     c10::IntArrayRef offsets, double scale) {
  const std::vector<SourceInfo> sources = describe_sources(tensors, /*with_memory=*/true);
  check_bucket_fill(buffer, sources, offsets, /*check_memory=*/true);
  run_plan_cpu(plan_bucket_fill(buffer, sources, offsets, scale));
}

void gather_copy_out_cpu(const at::Tensor& gathered, const at::Tensor& out,
                         c10::IntArrayRef shard_numels, c10::IntArrayRef numels,
                         int64_t world_size) {
  check_gather_copy_out(gathered, out, shard_numels, numels, world_size, /*check_memory=*/true);
  run_plan_cpu(plan_gather_copy_out(gathered, out, shard_numels, numels, world_size));
}

// Meta (and fake tensors): the checks alone, so 64-bit sizes validate without memory.
void bucket_fill_meta(const at::Tensor& buffer, at::TensorList tensors,
                      c10::IntArrayRef offsets, double /*scale*/) {
  check_bucket_fill(buffer, describe_sources(tensors, /*with_memory=*/false), offsets,
                    /*check_memory=*/false);
}

void gather_copy_out_meta(const at::Tensor& gathered, const at::Tensor& out,
                          c10::IntArrayRef shard_numels, c10::IntArrayRef numels,
                          int64_t world_size) {
  check_gather_copy_out(gathered, out, shard_numels, numels, world_size, /*check_memory=*/false);
}

}  // namespace

TORCH_LIBRARY(zero_lifetime, m) {
  m.def("bucket_fill(Tensor(a!) buffer, Tensor[] tensors, int[] offsets, float scale=1.0) -> ()");
  m.def("gather_copy_out(Tensor gathered, Tensor(a!) out, int[] shard_numels, int[] numels, "
        "int world_size) -> ()");
}

TORCH_LIBRARY_IMPL(zero_lifetime, CPU, m) {
  m.impl("bucket_fill", bucket_fill_cpu);
  m.impl("gather_copy_out", gather_copy_out_cpu);
}

TORCH_LIBRARY_IMPL(zero_lifetime, Meta, m) {
  m.impl("bucket_fill", bucket_fill_meta);
  m.impl("gather_copy_out", gather_copy_out_meta);
}

}  // namespace zero_lifetime::ops
