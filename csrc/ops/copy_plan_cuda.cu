// CUDA execution of a CopyPlan and the CUDA kernels of the ops: ONE launch for the whole
// tensor list, however long. Per-segment metadata lives in a device buffer (one async H2D
// copy from pinned memory), not in kernel arguments, so there is no 64-tensor limit.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "ops/copy_plan.h"

namespace zero_lifetime::ops {

namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;                        // elements per thread step: 16 B of 2-byte types
constexpr int64_t kChunk = kThreads * kVec * 2;  // elements per block work item

enum DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

DType to_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return kF32;
    case c10::ScalarType::BFloat16: return kBF16;
    default: return kF16;  // the checks admit only these three
  }
}

// One segment, split into ceil(numel / kChunk) work items numbered from first_chunk.
struct SegmentMeta {
  const void* src;
  int64_t dst_offset;
  int64_t numel;
  int64_t first_chunk;
  int32_t src_dtype;
  int32_t padding;
};

template <typename T>
struct alignas(16) Pack8 {
  T v[kVec];
};

template <typename Src, typename Dst>
__device__ __forceinline__ void copy_range(const Src* src, Dst* dst,
                                           int64_t begin, int64_t end, float scale) {
  constexpr bool same = std::is_same_v<Src, Dst>;
  const bool raw = same && scale == 1.0f;  // bit copy: NaN payloads kept, as memcpy would
  const bool aligned = reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  int64_t vec_end = begin;
  if (aligned) {
    // begin is a multiple of kChunk, so every 8-element group is 16 B aligned (and 32 B
    // for fp32, read as two 16-byte halves of the Pack8).
    vec_end = begin + (end - begin) / kVec * kVec;
    for (int64_t i = begin + static_cast<int64_t>(threadIdx.x) * kVec; i < vec_end;
         i += static_cast<int64_t>(blockDim.x) * kVec) {
      Pack8<Src> in = *reinterpret_cast<const Pack8<Src>*>(src + i);
      Pack8<Dst> out;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if constexpr (same) {
          out.v[k] = raw ? in.v[k] : static_cast<Dst>(static_cast<float>(in.v[k]) * scale);
        } else {
          out.v[k] = static_cast<Dst>(static_cast<float>(in.v[k]) * scale);
        }
      }
      *reinterpret_cast<Pack8<Dst>*>(dst + i) = out;
    }
  }
  for (int64_t i = vec_end + threadIdx.x; i < end; i += blockDim.x) {
    if constexpr (same) {
      dst[i] = raw ? src[i] : static_cast<Dst>(static_cast<float>(src[i]) * scale);
    } else {
      dst[i] = static_cast<Dst>(static_cast<float>(src[i]) * scale);
    }
  }
}

template <typename Dst>
__device__ __forceinline__ void copy_segment_range(const SegmentMeta& seg, Dst* dst,
                                                   int64_t begin, int64_t end, float scale) {
  Dst* out = dst + seg.dst_offset;
  switch (seg.src_dtype) {  // runtime dtype per segment: mixed-dtype lists in one launch
    case kF32: return copy_range(static_cast<const float*>(seg.src), out, begin, end, scale);
    case kBF16:
      return copy_range(static_cast<const c10::BFloat16*>(seg.src), out, begin, end, scale);
    default: return copy_range(static_cast<const c10::Half*>(seg.src), out, begin, end, scale);
  }
}

template <typename Dst>
__global__ void __launch_bounds__(kThreads)
    copy_plan_kernel(const SegmentMeta* __restrict__ segments, int64_t num_segments,
                     int64_t num_chunks, Dst* dst, float scale) {
  for (int64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
    // The segment owning this chunk: the last one with first_chunk <= chunk.
    int64_t lo = 0;
    int64_t hi = num_segments - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (segments[mid].first_chunk <= chunk) lo = mid; else hi = mid - 1;
    }
    const SegmentMeta seg = segments[lo];
    const int64_t begin = (chunk - seg.first_chunk) * kChunk;
    const int64_t end = begin + kChunk < seg.numel ? begin + kChunk : seg.numel;
    copy_segment_range(seg, dst, begin, end, scale);
  }
}

// Blocks that fit on the current device at once (8 of kThreads per SM): a grid-stride
// launch of that size keeps every SM busy without a tail of tiny waves.
int64_t resident_blocks() {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount,
                                        c10::cuda::current_device()));
  return static_cast<int64_t>(sms) * (2048 / kThreads);
}

void run_plan_cuda(const CopyPlan& plan, const at::Tensor& dst_tensor) {
  if (plan.segments.empty()) return;
  const int64_t num_segments = static_cast<int64_t>(plan.segments.size());
  const int64_t meta_bytes = num_segments * static_cast<int64_t>(sizeof(SegmentMeta));
  at::Tensor host = at::empty({meta_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  auto* meta = reinterpret_cast<SegmentMeta*>(host.data_ptr());
  int64_t num_chunks = 0;
  for (int64_t k = 0; k < num_segments; ++k) {
    const CopySegment& s = plan.segments[k];
    meta[k] = {s.src, s.dst_offset, s.numel, num_chunks, to_dtype(s.src_dtype), 0};
    num_chunks += (s.numel + kChunk - 1) / kChunk;
  }
  // non_blocking from pinned memory: stream-ordered, and torch's host allocator keeps the
  // pinned block until the copy has run. The device copy is freed stream-ordered too.
  at::Tensor device_meta = host.to(dst_tensor.device(), /*non_blocking=*/true);
  const auto* segments = reinterpret_cast<const SegmentMeta*>(device_meta.const_data_ptr());

  const int64_t blocks = std::min<int64_t>(num_chunks, resident_blocks());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (to_dtype(plan.dst_dtype)) {
    case kF32:
      copy_plan_kernel<<<blocks, kThreads, 0, stream>>>(
          segments, num_segments, num_chunks, static_cast<float*>(plan.dst), plan.scale);
      break;
    case kBF16:
      copy_plan_kernel<<<blocks, kThreads, 0, stream>>>(
          segments, num_segments, num_chunks, static_cast<c10::BFloat16*>(plan.dst), plan.scale);
      break;
    default:
      copy_plan_kernel<<<blocks, kThreads, 0, stream>>>(
          segments, num_segments, num_chunks, static_cast<c10::Half*>(plan.dst), plan.scale);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void bucket_fill_cuda(const at::Tensor& buffer, at::TensorList tensors, c10::IntArrayRef offsets,
                      double scale) {
  check_bucket_fill(buffer, tensors, offsets, /*check_memory=*/true);
  const c10::cuda::CUDAGuard device_guard(buffer.device());
  // keep_alive (contiguous copies) dies after the launch: freed stream-ordered, safe.
  run_plan_cuda(plan_bucket_fill(buffer, tensors, offsets, scale), buffer);
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
