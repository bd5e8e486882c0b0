// CUDA execution of a CopyPlan and the CUDA kernels of the ops: ONE launch for the whole
// tensor list, however long. Up to kInlineSegments segments travel in the kernel's own
// arguments (no allocation, no copy before the launch: this is the common case of a few
// large tensors, where any fixed cost shows against the bandwidth). Longer lists put their
// metadata in a device buffer (one async H2D copy from pinned memory), so there is no
// limit on the number of tensors.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>

#include "ops/copy_kernels.cuh"
#include "ops/copy_plan.h"

namespace zero_lifetime::ops {

namespace {

using namespace kernels;

constexpr int kInlineSegments = 64;  // 64 x 40 B of metadata fit the 4 KB kernel arguments

DType to_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return kF32;
    case c10::ScalarType::BFloat16: return kBF16;
    default: return kF16;  // the checks admit only these three
  }
}

struct InlineSegments {
  SegmentMeta seg[kInlineSegments];
};

__device__ __forceinline__ ThreadCoord this_thread() {
  return {threadIdx.x, blockDim.x, blockIdx.x, gridDim.x};
}

template <typename Dst>
__global__ void __launch_bounds__(kThreads)
    copy_plan_table_kernel(const SegmentMeta* __restrict__ segments, int64_t num_segments,
                           int64_t num_chunks, Dst* dst, float scale) {
  copy_chunks(segments, num_segments, num_chunks, dst, scale, this_thread());
}

template <typename Dst>
__global__ void __launch_bounds__(kThreads)
    copy_plan_inline_kernel(const __grid_constant__ InlineSegments segments,
                            int64_t num_segments, int64_t num_chunks, Dst* dst, float scale) {
  copy_chunks(segments.seg, num_segments, num_chunks, dst, scale, this_thread());
}

// Blocks of `Kernel` that fit on the device at once, found by the occupancy API: a
// grid-stride launch of exactly that many keeps every SM busy with no tail wave. Their
// register use decides it, and differs per kernel: on sm_90 they need 32-40 registers a
// thread (ptxas -v), so 8 blocks of kThreads fit on an SM at 32 and 6 above. A fixed grid
// of 8 per SM would leave a second, quarter-full wave for the others.
// Cached per kernel and device: the queries are driver calls.
template <auto Kernel>
int64_t resident_blocks(c10::DeviceIndex device) {
  static std::array<std::atomic<int64_t>, 64> cached{};
  const auto slot = static_cast<size_t>(device);
  if (slot < cached.size()) {
    const int64_t known = cached[slot].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int sms = 0;
  int per_sm = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // For the current device, which the caller's guard made `device`.
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kThreads, 0));
  const int64_t blocks = static_cast<int64_t>(sms) * std::max(per_sm, 1);
  if (slot < cached.size()) cached[slot].store(blocks, std::memory_order_relaxed);
  return blocks;
}

template <typename Dst>
void launch(const SegmentMeta* table, const InlineSegments* inline_segments,
            int64_t num_segments, int64_t num_chunks, void* dst, float scale,
            c10::DeviceIndex device, cudaStream_t stream) {
  if (inline_segments != nullptr) {
    const int64_t blocks = std::min(num_chunks, resident_blocks<copy_plan_inline_kernel<Dst>>(device));
    copy_plan_inline_kernel<<<blocks, kThreads, 0, stream>>>(
        *inline_segments, num_segments, num_chunks, static_cast<Dst*>(dst), scale);
  } else {
    const int64_t blocks = std::min(num_chunks, resident_blocks<copy_plan_table_kernel<Dst>>(device));
    copy_plan_table_kernel<<<blocks, kThreads, 0, stream>>>(
        table, num_segments, num_chunks, static_cast<Dst*>(dst), scale);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// A few large segments with nothing to cast or scale: one cudaMemcpyAsync each, the call
// torch's contiguous copy_ (the benchmarks' roofline) makes. Off by default until a GPU run
// measures it against the kernel (set_cuda_memcpy_segment_bytes). False: the kernel runs.
// Plans never hold a segment already in place (src == dst) when the scale is 1.
bool run_plan_as_memcpys(const CopyPlan& plan, cudaStream_t stream) {
  const auto count = static_cast<int64_t>(plan.segments.size());
  if (plan.scale != 1.0f || count > kMaxMemcpySegments) return false;
  const int64_t min_bytes = cuda_memcpy_segment_bytes();
  const auto itemsize = static_cast<int64_t>(c10::elementSize(plan.dst_dtype));
  for (const CopySegment& seg : plan.segments) {
    if (seg.src_dtype != plan.dst_dtype || seg.numel * itemsize < min_bytes) return false;
  }
  char* dst = static_cast<char*>(plan.dst);
  for (const CopySegment& seg : plan.segments) {
    C10_CUDA_CHECK(cudaMemcpyAsync(dst + seg.dst_offset * itemsize, seg.src,
                                   static_cast<size_t>(seg.numel * itemsize),
                                   cudaMemcpyDeviceToDevice, stream));
  }
  return true;
}

// Runs on the current stream of dst's device, whose guard the caller need not hold.
void run_plan_cuda(const CopyPlan& plan, const at::Tensor& dst_tensor) {
  if (plan.segments.empty()) return;
  const c10::cuda::CUDAGuard device_guard(dst_tensor.device());
  if (run_plan_as_memcpys(plan, c10::cuda::getCurrentCUDAStream())) return;
  const int64_t num_segments = static_cast<int64_t>(plan.segments.size());
  const bool use_inline = num_segments <= kInlineSegments;
  InlineSegments inline_segments;
  at::Tensor host;
  SegmentMeta* meta = inline_segments.seg;
  if (!use_inline) {
    host = at::empty({num_segments * static_cast<int64_t>(sizeof(SegmentMeta))},
                     at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    meta = reinterpret_cast<SegmentMeta*>(host.data_ptr());
  }
  const int64_t num_chunks = fill_segment_meta(plan.segments.data(), num_segments, meta, to_dtype);
  at::Tensor device_meta;
  if (!use_inline) {
    // non_blocking from pinned memory: stream-ordered, and torch's host allocator keeps the
    // pinned block until the copy has run. The device copy is freed stream-ordered too.
    device_meta = host.to(dst_tensor.device(), /*non_blocking=*/true);
  }
  const auto* table = use_inline ? nullptr
                                 : reinterpret_cast<const SegmentMeta*>(device_meta.const_data_ptr());
  const InlineSegments* inline_arg = use_inline ? &inline_segments : nullptr;
  const c10::DeviceIndex device = dst_tensor.device().index();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (to_dtype(plan.dst_dtype)) {
    case kF32:
      return launch<float>(table, inline_arg, num_segments, num_chunks, plan.dst, plan.scale, device, stream);
    case kBF16:
      return launch<c10::BFloat16>(table, inline_arg, num_segments, num_chunks, plan.dst, plan.scale,
                                   device, stream);
    default:
      return launch<c10::Half>(table, inline_arg, num_segments, num_chunks, plan.dst, plan.scale,
                               device, stream);
  }
}

// The direct Python entries (fast_path.cpp) find the runner through this registration.
[[maybe_unused]] const bool runner_registered = (set_cuda_plan_runner(&run_plan_cuda), true);

void bucket_fill_cuda(const at::Tensor& buffer, at::TensorList tensors, c10::IntArrayRef offsets,
                      double scale) {
  const std::vector<SourceInfo> sources = describe_sources(tensors, /*with_memory=*/true);
  check_bucket_fill(buffer, sources, offsets, /*check_memory=*/true);
  const c10::cuda::CUDAGuard device_guard(buffer.device());  // planning may copy on the device
  // keep_alive (contiguous copies) dies after the launch: freed stream-ordered, safe.
  run_plan_cuda(plan_bucket_fill(buffer, sources, offsets, scale), buffer);
}

void gather_copy_out_cuda(const at::Tensor& gathered, const at::Tensor& out,
                          c10::IntArrayRef shard_numels, c10::IntArrayRef numels,
                          int64_t world_size) {
  check_gather_copy_out(gathered, out, shard_numels, numels, world_size, /*check_memory=*/true);
  const c10::cuda::CUDAGuard device_guard(out.device());
  run_plan_cuda(plan_gather_copy_out(gathered, out, shard_numels, numels, world_size), out);
}

}  // namespace

TORCH_LIBRARY_IMPL(zero_lifetime, CUDA, m) {
  m.impl("bucket_fill", bucket_fill_cuda);
  m.impl("gather_copy_out", gather_copy_out_cuda);
}

}  // namespace zero_lifetime::ops
