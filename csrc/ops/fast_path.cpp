// Direct Python entries for the fused ops on plain CPU and CUDA tensors, beside the
// dispatcher ops.
//
// Calling torch.ops.zero_lifetime.bucket_fill with a list of 2000 tensors costs ~0.4 ms
// on CPU before any byte is copied: every tensor is copied into an IValue, and copying a
// Python-owned tensor takes the GIL for its PyObject. Even with two tensors the generic
// boxed call from Python costs tens of microseconds, which on a GPU is the whole time of a
// 64 MB copy. These entries borrow the tensors of the Python objects instead and run the
// same checks, plan and kernels. They answer False (nothing done) whenever the dispatcher
// is needed: tensor subclasses (fake tensors, wrappers), autograd, an active dispatch or
// torch-function mode, a device without a kernel here.
#include <ATen/Parallel.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include "ops/cache_size.h"
#include "ops/copy_plan.h"
#include "ops/cpu_buffer_cache.h"
#include "ops/fast_path.h"

#include <algorithm>
#include <atomic>
#include <limits>

namespace py = pybind11;

namespace zero_lifetime::ops {

namespace {

// Modes intercept ops at the dispatcher or at the Python API: a direct call would skip them.
bool modes_active() {
  return c10::impl::TorchDispatchModeTLS::stack_len() > 0 ||
         at::impl::PythonTorchFunctionTLS::stack_len() > 0;
}

bool device_supported(const c10::Device& device) {
  return device.is_cpu() || (device.is_cuda() && cuda_plan_runner() != nullptr);
}

// A plain tensor outside autograd on a device these entries run, or nullptr.
const at::Tensor* plain_tensor(PyObject* obj) {
  if (!THPVariable_CheckExact(obj)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.requires_grad() || !device_supported(t.device())) return nullptr;
  return &t;
}

// Reading thousands of tensors behind their PyObjects is a chain of cache misses per tensor
// (object, TensorImpl, StorageImpl), not computation, so it is split over the intra-op
// threads. The workers read the objects without the GIL: this thread holds it while it
// waits, so no Python code runs meanwhile, and `owners` keeps every object alive. Without
// a GIL (free-threaded CPython) that argument does not hold: one thread reads them there.
#ifdef Py_GIL_DISABLED
constexpr int64_t kDescribeGrain = std::numeric_limits<int64_t>::max();
#else
constexpr int64_t kDescribeGrain = 1024;
#endif

bool describe_plain_sources(const py::tuple& owners, std::vector<SourceInfo>& sources) {
  const auto n = static_cast<int64_t>(owners.size());
  sources.resize(static_cast<size_t>(n));
  std::atomic<bool> all_plain{true};
  at::parallel_for(0, n, kDescribeGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const at::Tensor* t = plain_tensor(PyTuple_GET_ITEM(owners.ptr(), i));
      if (t == nullptr) {
        all_plain.store(false, std::memory_order_relaxed);
        return;
      }
      sources[i] = describe_source(*t, /*with_memory=*/true);
    }
  });
  return all_plain.load(std::memory_order_relaxed);
}

std::vector<int64_t> int_values(py::handle sequence, const char* what) {
  py::object items = py::reinterpret_steal<py::object>(PySequence_Fast(sequence.ptr(), what));
  if (!items) throw py::error_already_set();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(items.ptr());
  PyObject** values = PySequence_Fast_ITEMS(items.ptr());
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[i] = PyLong_AsLongLong(values[i]);
    if (out[i] == -1 && PyErr_Occurred()) throw py::error_already_set();
  }
  return out;
}

// The tensor's device made current for CUDA (planning may copy there); nothing for CPU.
struct DeviceOf {
  explicit DeviceOf(const at::Tensor& t) {
    if (t.is_cuda()) guard.reset_device(t.device());
  }
  c10::OptionalDeviceGuard guard;
};

void run_plan(const CopyPlan& plan, const at::Tensor& dst) {
  if (dst.is_cuda()) {
    cuda_plan_runner()(plan, dst);
  } else {
    run_plan_cpu(plan);
  }
}

bool bucket_fill_fast(py::handle buffer_obj, py::handle tensors, py::handle offsets, double scale) {
  if (modes_active()) return false;
  const at::Tensor* buffer = plain_tensor(buffer_obj.ptr());
  if (buffer == nullptr) return false;
  // A tuple of the same objects: the tensors stay alive while the GIL is released below,
  // whatever another thread does to the list.
  py::tuple owners = py::reinterpret_steal<py::tuple>(PySequence_Tuple(tensors.ptr()));
  if (!owners) throw py::error_already_set();
  // Everything the checks and the plan need is read here, in the one pass that already
  // touches each TensorImpl (see SourceInfo).
  std::vector<SourceInfo> sources;
  if (!describe_plain_sources(owners, sources)) return false;
  const std::vector<int64_t> offset_values = int_values(offsets, "offsets must be a sequence");
  {
    py::gil_scoped_release no_gil;
    RECORD_FUNCTION("zero_lifetime::bucket_fill", std::vector<c10::IValue>());
    check_bucket_fill(*buffer, sources, offset_values, /*check_memory=*/true);
    const DeviceOf device_guard(*buffer);  // planning may copy on the device
    run_plan(plan_bucket_fill(*buffer, sources, offset_values, scale), *buffer);
  }
  // What the dispatcher's in-place handling does for a mutated argument.
  buffer->unsafeGetTensorImpl()->bump_version();
  return true;
}

bool gather_copy_out_fast(py::handle gathered_obj, py::handle out_obj, py::handle shard_numels,
                          py::handle numels, int64_t world_size) {
  if (modes_active()) return false;
  const at::Tensor* gathered = plain_tensor(gathered_obj.ptr());
  const at::Tensor* out = plain_tensor(out_obj.ptr());
  if (gathered == nullptr || out == nullptr) return false;
  const std::vector<int64_t> shards = int_values(shard_numels, "shard_numels must be a sequence");
  const std::vector<int64_t> sizes = int_values(numels, "numels must be a sequence");
  // The call's argument tuple owns both tensors until we return, GIL released or not.
  {
    py::gil_scoped_release no_gil;
    RECORD_FUNCTION("zero_lifetime::gather_copy_out", std::vector<c10::IValue>());
    check_gather_copy_out(*gathered, *out, shards, sizes, world_size, /*check_memory=*/true);
    const DeviceOf device_guard(*out);
    run_plan(plan_gather_copy_out(*gathered, *out, shards, sizes, world_size), *out);
  }
  out->unsafeGetTensorImpl()->bump_version();
  return true;
}

// A view of buffer[offset : offset + numel(sizes)] in `sizes`: what narrow().view() makes,
// built the way torch builds its own aliases (alias_with_sizes_and_strides), without two trips
// through the dispatcher per tensor.
at::Tensor slice_view(const at::Tensor& buffer, int64_t offset, c10::IntArrayRef sizes) {
  at::Tensor view = at::detail::make_tensor<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(buffer.storage()), buffer.key_set(), buffer.dtype());
  c10::TensorImpl* impl = view.unsafeGetTensorImpl();
  impl->set_storage_offset(buffer.storage_offset() + offset);
  impl->set_sizes_contiguous(sizes);
  return view;
}

// A tensor whose Python `.data = ...` is a plain set_data: torch.Tensor or nn.Parameter
// (requires_grad or not), not a subclass, which may override it.
const at::Tensor* settable_tensor(PyObject* obj) {
  if (!THPVariable_CheckExact(obj)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  return t.defined() ? &t : nullptr;
}

// tensors[i].data = buffer[offsets[i] :].view(shapes[i]), shapes[i] = tensors[i].shape when
// None: what DeepSpeed does to each gradient once it is in its bucket (and the fused ZeRO-3
// gather to each param, with its full shape). From Python that is two view ops and the .data
// setter, ~4 us a tensor on CPU: for 8192 gradients 9x the fused fill of their bytes. Every
// argument is checked before any tensor changes (the Python loop would stop halfway).
bool repoint_to_slices_fast(py::handle buffer_obj, py::handle tensors, py::handle offsets,
                            py::handle shapes) {
  constexpr const char* op = "repoint_to_slices";
  // Under inference mode torch makes views with other dispatch keys: its own ops decide.
  if (modes_active() || c10::InferenceMode::is_enabled()) return false;
  const at::Tensor* buffer = settable_tensor(buffer_obj.ptr());
  if (buffer == nullptr) return false;
  py::tuple owners = py::reinterpret_steal<py::tuple>(PySequence_Tuple(tensors.ptr()));
  if (!owners) throw py::error_already_set();
  const auto n = static_cast<size_t>(owners.size());
  std::vector<const at::Tensor*> targets(n);
  for (size_t i = 0; i < n; ++i) {
    targets[i] = settable_tensor(PyTuple_GET_ITEM(owners.ptr(), static_cast<Py_ssize_t>(i)));
    if (targets[i] == nullptr) return false;
  }
  const std::vector<int64_t> offset_values = int_values(offsets, "offsets must be a sequence");
  std::vector<std::vector<int64_t>> shape_values;
  if (!shapes.is_none()) {
    py::object items = py::reinterpret_steal<py::object>(PySequence_Fast(shapes.ptr(), "shapes must be a sequence"));
    if (!items) throw py::error_already_set();
    PyObject** shape_items = PySequence_Fast_ITEMS(items.ptr());
    shape_values.reserve(static_cast<size_t>(PySequence_Fast_GET_SIZE(items.ptr())));
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items.ptr()); ++i) {
      shape_values.push_back(int_values(shape_items[i], "shapes[i] must be a sequence of ints"));
    }
  }
  check_flat(op, "buffer", *buffer);
  TORCH_CHECK(n == offset_values.size(), op, ": got ", n, " tensors but ", offset_values.size(),
              " offsets");
  TORCH_CHECK(shapes.is_none() || n == shape_values.size(), op, ": got ", n, " tensors but ",
              shape_values.size(), " shapes");
  const int64_t buffer_numel = buffer->numel();
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& t = *targets[i];
    TORCH_CHECK(t.device() == buffer->device(), op, ": tensors[", i, "] is on ", t.device(),
                " but buffer is on ", buffer->device());
    TORCH_CHECK(t.layout() == c10::kStrided, op, ": tensors[", i, "] has layout ", t.layout(),
                "; expected a dense (strided) tensor");
    int64_t numel = t.numel();
    if (!shape_values.empty()) {
      const c10::IntArrayRef shape(shape_values[i]);
      for (const int64_t size : shape) {
        TORCH_CHECK(size >= 0, op, ": shapes[", i, "] ", shape, " has a negative size");
      }
      const bool empty = std::find(shape.begin(), shape.end(), 0) != shape.end();
      numel = empty ? 0 : 1;
      for (const int64_t size : shape) {
        // Past the buffer before the product could overflow: out of bounds either way.
        TORCH_CHECK(empty || numel <= buffer_numel / size, op, ": tensors[", i, "] (shape ", shape,
                    ") is out of bounds of the buffer (", buffer_numel, " elements)");
        if (!empty) numel *= size;
      }
    }
    const int64_t offset = offset_values[i];
    TORCH_CHECK(offset >= 0, op, ": offsets[", i, "] is negative (", offset, ")");
    TORCH_CHECK(offset <= buffer_numel - numel, op, ": tensors[", i, "] (", numel,
                " elements at offset ", offset, ") is out of bounds of the buffer (", buffer_numel,
                " elements)");
  }
  for (size_t i = 0; i < n; ++i) {
    const c10::IntArrayRef sizes =
        shape_values.empty() ? targets[i]->sizes() : c10::IntArrayRef(shape_values[i]);
    targets[i]->set_data(slice_view(*buffer, offset_values[i], sizes));
  }
  return true;
}

}  // namespace

void add_fast_path_bindings(py::module& m) {
  m.def("bucket_fill_fast", &bucket_fill_fast, py::arg("buffer"), py::arg("tensors"),
        py::arg("offsets"), py::arg("scale"),
        "bucket_fill for plain CPU/CUDA tensors without the dispatcher; False when it does not apply");
  m.def("gather_copy_out_fast", &gather_copy_out_fast, py::arg("gathered"), py::arg("out"),
        py::arg("shard_numels"), py::arg("numels"), py::arg("world_size"),
        "gather_copy_out for plain CPU/CUDA tensors without the dispatcher; False when it does not apply");
  m.def("repoint_to_slices_fast", &repoint_to_slices_fast, py::arg("buffer"), py::arg("tensors"),
        py::arg("offsets"), py::arg("shapes") = py::none(),
        "repoint_to_slices for plain tensors without a Python loop; False when it does not apply");
  m.def("streaming_store_threshold", &streaming_store_threshold,
        "Destination bytes from which CPU fused copies use non-temporal stores");
  m.def("set_streaming_store_threshold", &set_streaming_store_threshold, py::arg("nbytes"),
        "Set that threshold (0: always); returns the previous one");
  m.def("cuda_memcpy_segment_bytes", &cuda_memcpy_segment_bytes,
        "Segment bytes from which CUDA fused copies without a cast or scale use cudaMemcpyAsync");
  m.def("set_cuda_memcpy_segment_bytes", &set_cuda_memcpy_segment_bytes, py::arg("nbytes"),
        "Set that threshold (0: always, a huge value: never); returns the previous one");
  m.def("cuda_memcpy_max_segments", [] { return kMaxMemcpySegments; },
        "The most segments a CUDA fused copy may have to run as cudaMemcpyAsync calls");
  m.def("last_level_cache_bytes", &last_level_cache_bytes, py::arg("cpu_dir"),
        "Bytes of the highest-level data/unified cache under a sysfs cpu directory; 0 if unreadable");
  m.def("default_streaming_store_threshold", &default_streaming_store_threshold, py::arg("cpu_dir"),
        "The streaming store threshold a machine with this sysfs cpu directory starts with");
  m.def("cpu_gather_buffer", &cpu_gather_buffer, py::arg("numel"), py::arg("dtype"),
        "An uninitialized 1-D CPU buffer whose memory returns to the cache when its storage dies");
  m.def("cpu_buffer_cache_info", [] {
    const CpuBufferCacheInfo info = cpu_buffer_cache_info();
    py::dict d;
    d["cached_bytes"] = info.cached_bytes;
    d["cached_blocks"] = info.cached_blocks;
    d["limit_bytes"] = info.limit_bytes;
    d["hits"] = info.hits;
    d["misses"] = info.misses;
    return d;
  }, "Bytes and blocks the CPU gather-buffer cache holds, its limit, hits and misses");
  m.def("set_cpu_buffer_cache_limit", &set_cpu_buffer_cache_limit, py::arg("nbytes"),
        "Bytes of released buffers the cache may hold (0: none); returns the previous limit");
  m.def("empty_cpu_buffer_cache", &empty_cpu_buffer_cache, "Free every cached block");
  m.def("cuda_kernels_compiled", [] { return cuda_plan_runner() != nullptr; },
        "Whether this build holds the CUDA kernels the direct entries run");
}

}  // namespace zero_lifetime::ops
