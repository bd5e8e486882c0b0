// A direct Python entry for bucket_fill on CPU tensors, beside the dispatcher op.
//
// Calling torch.ops.zero_lifetime.bucket_fill with a list of 2000 tensors costs ~0.4 ms
// before any byte is copied (measured here): every tensor is copied into an IValue, and
// copying a Python-owned tensor takes the GIL for its PyObject. This entry borrows the
// tensors of the list's objects instead (~0.07 ms for 2000). It runs the same checks,
// plan and CPU kernel, and answers False (nothing done) whenever the dispatcher is
// needed: tensor subclasses (fake tensors, wrappers), non-CPU tensors, autograd.
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include "ops/copy_plan.h"
#include "ops/fast_path.h"

namespace py = pybind11;

namespace zero_lifetime::ops {

namespace {

// Plain CPU tensor outside autograd, or nullptr.
const at::Tensor* plain_cpu_tensor(PyObject* obj) {
  if (!THPVariable_CheckExact(obj)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.device().type() != c10::kCPU || t.requires_grad()) return nullptr;
  return &t;
}

bool bucket_fill_cpu_fast(py::handle buffer_obj, py::list tensors, py::list offsets, double scale) {
  const at::Tensor* buffer = plain_cpu_tensor(buffer_obj.ptr());
  if (buffer == nullptr) return false;
  // A tuple of the same objects: the tensors stay alive while the GIL is released below,
  // whatever another thread does to the list.
  py::tuple owners = py::reinterpret_steal<py::tuple>(PySequence_Tuple(tensors.ptr()));
  if (!owners) throw py::error_already_set();
  std::vector<const at::Tensor*> refs(owners.size());
  for (size_t i = 0; i < refs.size(); ++i) {
    refs[i] = plain_cpu_tensor(PyTuple_GET_ITEM(owners.ptr(), i));
    if (refs[i] == nullptr) return false;
  }
  std::vector<int64_t> offset_values(offsets.size());
  for (size_t i = 0; i < offset_values.size(); ++i) {
    offset_values[i] = PyLong_AsLongLong(PyList_GET_ITEM(offsets.ptr(), i));
    if (offset_values[i] == -1 && PyErr_Occurred()) throw py::error_already_set();
  }
  check_bucket_fill(*buffer, TensorRefs(refs), offset_values, /*check_memory=*/true);
  CopyPlan plan = plan_bucket_fill(*buffer, TensorRefs(refs), offset_values, scale);
  {
    py::gil_scoped_release no_gil;
    run_plan_cpu(plan);
  }
  // What the dispatcher's in-place handling does for a mutated argument.
  buffer->unsafeGetTensorImpl()->bump_version();
  return true;
}

}  // namespace

void add_fast_path_bindings(py::module& m) {
  m.def("bucket_fill_cpu_fast", &bucket_fill_cpu_fast, py::arg("buffer"), py::arg("tensors"),
        py::arg("offsets"), py::arg("scale"),
        "bucket_fill for plain CPU tensors without the dispatcher; False when it does not apply");
}

}  // namespace zero_lifetime::ops
