#include "tracker_binding.h"

#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/python_variable.h>

#include <new>
#include <typeinfo>
#include <utility>

namespace zero_lifetime {

namespace {

using DimVector = c10::SmallVector<int64_t, 5>;

struct SavedParamObject {
  PyObject_HEAD
  Tracker* tracker;       // valid while tracker_ref is held
  PyObject* tracker_ref;  // strong ref to the Python Tracker: handles may outlive its owner
  int64_t id;
  uint64_t generation;
  uint64_t weights_epoch;  // the tracker's weights epoch when the forward saved it
  int64_t delta;          // element offset of the saved view from the start of param.data
  bool holds_reference;   // set once the acquire it must give back has happened
  DimVector sizes;
  DimVector strides;
};

SavedParamObject* as_saved_param(PyObject* obj) {
  return reinterpret_cast<SavedParamObject*>(obj);
}

// Reports the pending Python error, or `what`, without raising: used where an exception
// cannot propagate (a handle dies inside autograd or the garbage collector).
void write_unraisable(PyObject* context, const char* what) {
  if (what != nullptr) PyErr_SetString(PyExc_RuntimeError, what);
  PyErr_WriteUnraisable(context);
}

void saved_param_dealloc(PyObject* self) {
  SavedParamObject* h = as_saved_param(self);
  if (h->holds_reference) {
    // A handle can die while an exception is propagating; keep it intact.
    py::error_scope keep_pending_error;
    try {
      h->tracker->release_handle(h->id, h->generation);
    } catch (py::error_already_set& e) {
      e.restore();
      write_unraisable(h->tracker_ref, nullptr);
    } catch (const c10::Error& e) {
      write_unraisable(h->tracker_ref, e.what_without_backtrace());
    } catch (const std::exception& e) {
      write_unraisable(h->tracker_ref, e.what());
    }
  }
  h->sizes.~DimVector();
  h->strides.~DimVector();
  Py_XDECREF(h->tracker_ref);
  Py_TYPE(self)->tp_free(self);
}

PyObject* saved_param_repr(PyObject* self) {
  SavedParamObject* h = as_saved_param(self);
  std::string sizes;
  for (size_t i = 0; i < h->sizes.size(); ++i) {
    sizes += (i ? ", " : "") + std::to_string(h->sizes[i]);
  }
  return PyUnicode_FromFormat("SavedParam(ds_id=%lld, sizes=[%s])",
                              static_cast<long long>(h->id), sizes.c_str());
}

PyObject* saved_param_get_ds_id(PyObject* self, void*) {
  return PyLong_FromLongLong(as_saved_param(self)->id);
}

PyGetSetDef saved_param_getset[] = {
    {"ds_id", saved_param_get_ds_id, nullptr, "ds_id of the saved parameter", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

// Interned once: looked up on every unpack that checks the gather status.
PyObject* ds_status_name() {
  static PyObject* name = PyUnicode_InternFromString("ds_status");
  return name;
}

py::object borrow(py::handle h) { return py::reinterpret_borrow<py::object>(h); }

const at::Tensor& tensor_of(py::handle param) { return THPVariable_Unpack(param.ptr()); }

int64_t nbytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.itemsize()); }

// A dense tensor backed by a plain TensorImpl (CPU/CUDA), not a subclass such as a
// Python-dispatch wrapper or a functional tensor: only for those do the fast paths
// below, which bypass the dispatcher, produce what the dispatcher would.
bool is_plain_dense(const at::TensorBase& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return typeid(*impl) == typeid(c10::TensorImpl) && impl->has_storage() &&
         t.layout() == c10::kStrided;
}

// Same data, no autograd history. variable_data() (what `.data` does) skips the
// dispatcher round trip of detach(); the differences (own version counter, no view
// tracking) do not matter for a saved tensor: autograd skips version checks when
// saved-tensor hooks are used, and hands it back unchanged on unpack.
at::Tensor alias_without_autograd(const at::Tensor& t) {
  return is_plain_dense(t) ? at::Tensor(t.variable_data()) : t.detach();
}

// Elements spanned by a strided view: 1 + sum((size-1)*stride), 0 when empty.
int64_t extent_in_elements(c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  int64_t extent = 1;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return 0;
    extent += (sizes[d] - 1) * strides[d];
  }
  return extent;
}

}  // namespace

PyTypeObject SavedParamType = {PyVarObject_HEAD_INIT(nullptr, 0)};

void init_saved_param_type(py::module_& m) {
  SavedParamType.tp_name = "zero_lifetime._C.SavedParam";
  SavedParamType.tp_basicsize = sizeof(SavedParamObject);
  SavedParamType.tp_dealloc = saved_param_dealloc;
  SavedParamType.tp_repr = saved_param_repr;
  SavedParamType.tp_flags = Py_TPFLAGS_DEFAULT;
  SavedParamType.tp_doc =
      "Handle autograd stores instead of a ZeRO-3 parameter (or a view of one); its "
      "death releases the reference it counted.";
  SavedParamType.tp_getset = saved_param_getset;
  // No tp_new: only Tracker.pack creates handles.
  if (PyType_Ready(&SavedParamType) < 0) throw py::error_already_set();
  Py_INCREF(&SavedParamType);
  m.add_object("SavedParam", reinterpret_cast<PyObject*>(&SavedParamType));
}

namespace {
Policy parse_policy(const std::string& policy) {
  if (policy == "regather") return Policy::Regather;
  if (policy == "pin") return Policy::Pin;
  TORCH_CHECK_VALUE(false, "unknown policy '", policy, "'; allowed values: regather, pin");
}
}  // namespace

Tracker::Tracker(const std::string& policy, int64_t max_pinned_bytes)
    : core_(parse_policy(policy), max_pinned_bytes) {}

void Tracker::set_callbacks(py::object gather, py::object on_pinned, py::object on_unpinned) {
  gather_ = std::move(gather);
  on_pinned_ = std::move(on_pinned);
  on_unpinned_ = std::move(on_unpinned);
}

void Tracker::set_available_status(py::object status) { available_status_ = std::move(status); }

void Tracker::register_param(py::handle param) {
  TORCH_CHECK_TYPE(THPVariable_Check(param.ptr()),
                   "register_param expects a torch.nn.Parameter, got ",
                   Py_TYPE(param.ptr())->tp_name);
  const auto id = py::cast<int64_t>(param.attr("ds_id"));
  const auto numel = py::cast<int64_t>(param.attr("ds_numel"));
  const int persistent = PyObject_IsTrue(py::getattr(param, "ds_persist", py::bool_(false)).ptr());
  if (persistent < 0) throw py::error_already_set();
  const at::Tensor& t = tensor_of(param);
  core_.add_param(id, numel * static_cast<int64_t>(t.itemsize()), persistent != 0);
  auto it = params_.find(id);
  if (it != params_.end()) id_by_impl_.erase(it->second.impl);
  params_[id] = ParamEntry{borrow(param), t.unsafeGetTensorImpl(), numel};
  id_by_impl_[t.unsafeGetTensorImpl()] = id;
}

void Tracker::unregister_all() {
  ++generation_;
  core_.clear();
  id_by_impl_.clear();
  // Move out first: dropping the last ref to a param can run arbitrary Python code.
  auto dropped = std::move(params_);
  params_.clear();
}

int64_t Tracker::registered_id(py::handle param) const {
  // By TensorImpl first, without an attribute lookup: the registered param object itself
  // (set_data keeps its impl). Anything else goes by its ds_id.
  if (THPVariable_Check(param.ptr())) {
    const auto known = id_by_impl_.find(tensor_of(param).unsafeGetTensorImpl());
    if (known != id_by_impl_.end()) return known->second;
  }
  const auto id = py::cast<int64_t>(param.attr("ds_id"));
  TORCH_CHECK_VALUE(params_.count(id) != 0, "zero_lifetime: param ds_id=", id,
                    " is not registered");
  return id;
}

void Tracker::set_range_to_current_data(int64_t id, const at::Tensor& p) {
  core_.set_range(id, reinterpret_cast<uintptr_t>(p.const_data_ptr()), nbytes_of(p));
}

void Tracker::note_gathered(py::handle param) {
  const int64_t id = registered_id(param);
  set_range_to_current_data(id, tensor_of(params_.at(id).param));
}

void Tracker::note_gathered_all(py::handle params) {
  const py::object items =
      py::reinterpret_steal<py::object>(PySequence_Fast(params.ptr(), "note_gathered_all expects a sequence of params"));
  if (!items) throw py::error_already_set();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(items.ptr());
  PyObject** values = PySequence_Fast_ITEMS(items.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    const py::handle param(values[i]);
    TORCH_CHECK_TYPE(THPVariable_Check(param.ptr()), "note_gathered_all expects params, got ",
                     Py_TYPE(param.ptr())->tp_name);
    const int64_t id = registered_id(param);
    const ParamEntry& entry = params_.at(id);
    const py::object owner = entry.param;  // copied out: the status lookup runs Python
    const int64_t full_numel = entry.numel;
    const at::Tensor& p = tensor_of(owner);
    if (needs_gather(owner, full_numel, p)) continue;  // released or in flight
    set_range_to_current_data(id, p);
  }
}

void Tracker::note_released(py::handle param) { core_.clear_range(registered_id(param)); }

namespace {
// Enough for a loop that alternates a few kinds of step; a handle older than all of them
// is refused without a note rather than with a wrong one.
constexpr size_t kMaxStepNoteRuns = 16;
const std::string kNoNote;
}  // namespace

void Tracker::advance_weights_epoch(std::string step_note) {
  ++weights_epoch_;
  if (!step_note_runs_.empty() && step_note_runs_.back().note == step_note) return;
  step_note_runs_.push_back({weights_epoch_, std::move(step_note)});
  if (step_note_runs_.size() > kMaxStepNoteRuns) step_note_runs_.pop_front();
}

const std::string& Tracker::note_of_step(uint64_t epoch) const {
  for (auto run = step_note_runs_.rbegin(); run != step_note_runs_.rend(); ++run) {
    if (run->first_epoch <= epoch) return run->note;
  }
  return kNoNote;
}

const Tracker::ParamEntry* Tracker::resolve(const at::Tensor& t, int64_t& id) const {
  // (a) the parameter object itself: its TensorImpl is registered.
  const auto direct = id_by_impl_.find(t.unsafeGetTensorImpl());
  if (direct != id_by_impl_.end()) {
    id = direct->second;
    return &params_.at(id);
  }
  // (b) an autograd view of the parameter, e.g. W.t() saved by addmm.
  if (t.is_view()) {
    const at::TensorBase& base = t._base();
    const auto via_base = id_by_impl_.find(base.unsafeGetTensorImpl());
    if (via_base != id_by_impl_.end()) {
      if (base.dtype() != t.dtype()) return nullptr;  // a reinterpreting view: not restorable
      id = via_base->second;
      return &params_.at(id);
    }
  }
  return resolve_by_address(t, id);
}

// (c) memory shared without autograd view tracking (e.g. `p.data[2:]`): found by address.
const Tracker::ParamEntry* Tracker::resolve_by_address(const at::Tensor& t, int64_t& id) const {
  if (t.layout() != c10::kStrided || !t.unsafeGetTensorImpl()->has_storage() || t.numel() == 0) {
    return nullptr;
  }
  uintptr_t t_start = 0;
  try {
    t_start = reinterpret_cast<uintptr_t>(t.const_data_ptr());  // const: no copy-on-write side effect
  } catch (const c10::Error&) {
    return nullptr;  // e.g. tensor subclasses without accessible data
  }
  const int64_t found = core_.lookup(t_start);
  if (found < 0) return nullptr;
  const auto entry = params_.find(found);
  if (entry == params_.end()) return nullptr;
  const at::Tensor& p = tensor_of(entry->second.param);
  if (p.dtype() != t.dtype() || p.device() != t.device()) return nullptr;
  const auto itemsize = static_cast<uintptr_t>(t.itemsize());
  const auto p_start = reinterpret_cast<uintptr_t>(p.const_data_ptr());
  const uintptr_t p_end = p_start + static_cast<uintptr_t>(nbytes_of(p));
  const uintptr_t t_end =
      t_start + static_cast<uintptr_t>(extent_in_elements(t.sizes(), t.strides())) * itemsize;
  // The range registry can be stale; only the param's current data counts.
  if (t_start < p_start || t_end > p_end || (t_start - p_start) % itemsize != 0) return nullptr;
  id = found;
  return &entry->second;
}

void set_python_error(const c10::Error& error) {
  PyObject* type = PyExc_RuntimeError;
  if (dynamic_cast<const c10::ValueError*>(&error)) {
    type = PyExc_ValueError;
  } else if (dynamic_cast<const c10::TypeError*>(&error)) {
    type = PyExc_TypeError;
  } else if (dynamic_cast<const c10::IndexError*>(&error)) {
    type = PyExc_IndexError;
  }
  PyErr_SetString(type, error.what_without_backtrace());
}

namespace {
// Runs `body` for a CPython entry point: C++ exceptions become the matching Python error.
template <typename Body>
PyObject* translate_exceptions(Body&& body) {
  try {
    return body();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const c10::Error& e) {
    set_python_error(e);
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyObject* tracker_pack(PyObject* self, PyObject* tensor) {
  return translate_exceptions(
      [&] { return py::cast<Tracker&>(py::handle(self)).pack(self, tensor).release().ptr(); });
}

PyObject* tracker_unpack(PyObject* self, PyObject* obj) {
  return translate_exceptions(
      [&] { return py::cast<Tracker&>(py::handle(self)).unpack(obj).release().ptr(); });
}

PyObject* tracker_note_gathered_all(PyObject* self, PyObject* params) {
  return translate_exceptions([&] {
    py::cast<Tracker&>(py::handle(self)).note_gathered_all(params);
    return py::none().release().ptr();
  });
}

PyMethodDef hot_path_methods[] = {
    {"pack", tracker_pack, METH_O,
     "pack(tensor) -> SavedParam | Tensor: saved_tensors_hooks pack hook"},
    {"unpack", tracker_unpack, METH_O,
     "unpack(obj) -> Tensor: saved_tensors_hooks unpack hook"},
    {"note_gathered_all", tracker_note_gathered_all, METH_O,
     "note_gathered_all(params): note_gathered(p) for each p that is gathered now"},
};
}  // namespace

void add_hot_path_methods(py::handle tracker_type) {
  // Plain METH_O method descriptors: calling them skips pybind11's overload dispatch and
  // argument conversion, which costs more than the work pack/unpack do for most tensors.
  for (PyMethodDef& def : hot_path_methods) {
    py::object descr = py::reinterpret_steal<py::object>(
        PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(tracker_type.ptr()), &def));
    if (!descr) throw py::error_already_set();
    py::setattr(tracker_type, def.ml_name, descr);
  }
}

py::object Tracker::pack(py::handle self, py::handle obj) {
  if (!THPVariable_Check(obj.ptr())) return borrow(obj);
  const at::Tensor& t = THPVariable_Unpack(obj.ptr());
  int64_t id = -1;
  const ParamEntry* entry = params_.empty() ? nullptr : resolve(t, id);
  if (entry == nullptr) {
    // Returning a tensor that owns a grad_fn would make the graph reference itself
    // through the saved tensor: an uncollectable cycle.
    if (!t.grad_fn()) return borrow(obj);
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(alias_without_autograd(t)));
  }

  const at::Tensor& p = tensor_of(entry->param);
  TORCH_CHECK(p.numel() != 0 || entry->numel == 0, "zero_lifetime: param ds_id=", id,
              " is saved for backward while released (numel 0, ds_numel ", entry->numel,
              "); it must be gathered during forward");
  const auto byte_delta = reinterpret_cast<intptr_t>(t.const_data_ptr()) -
                          reinterpret_cast<intptr_t>(p.const_data_ptr());
  const int64_t delta = byte_delta / static_cast<intptr_t>(p.itemsize());
  const py::object param = entry->param;  // survives callbacks that re-register params

  auto* h = PyObject_New(SavedParamObject, &SavedParamType);
  if (h == nullptr) throw py::error_already_set();
  // Everything dealloc touches is initialised before anything can fail.
  h->tracker = this;
  h->tracker_ref = self.inc_ref().ptr();
  h->id = id;
  h->generation = generation_;
  h->weights_epoch = weights_epoch_;
  h->delta = delta;
  h->holds_reference = false;
  new (&h->sizes) DimVector();
  new (&h->strides) DimVector();
  py::object handle = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(h));
  h->sizes.assign(t.sizes().begin(), t.sizes().end());
  h->strides.assign(t.strides().begin(), t.strides().end());

  const AcquireResult acquired = core_.acquire(id);
  h->holds_reference = true;
  // If on_pinned raises, `handle` dies on the way out and gives the reference back.
  if (acquired.pinned_now && !on_pinned_.is_none()) on_pinned_(param);
  return handle;
}

bool Tracker::needs_gather(py::handle param, int64_t full_numel, const at::Tensor& data) const {
  if (data.numel() == 0 && full_numel > 0) return true;
  if (!available_status_) return false;  // no status configured: the size check decides
  py::object status = py::reinterpret_steal<py::object>(PyObject_GetAttr(param.ptr(), ds_status_name()));
  if (!status) throw py::error_already_set();
  const int equal = PyObject_RichCompareBool(status.ptr(), available_status_.ptr(), Py_EQ);
  if (equal < 0) throw py::error_already_set();
  return equal == 0;
}

py::object Tracker::unpack(py::handle obj) {
  if (Py_TYPE(obj.ptr()) != &SavedParamType) return borrow(obj);
  const SavedParamObject* h = as_saved_param(obj.ptr());
  TORCH_CHECK(h->tracker == this && h->generation == generation_,
              "zero_lifetime: saved param ds_id=", h->id,
              " belongs to another tracker or was unregistered (unregister_all) before "
              "backward used it");
  // torch refuses a saved tensor modified in place since the forward; with saved-tensor
  // hooks it does not check, so the step that updated the weights is checked here.
  TORCH_CHECK(h->weights_epoch == weights_epoch_, "zero_lifetime: param ds_id=", h->id,
              " was updated by an optimizer step() after the forward that saved it for this "
              "backward. torch refuses the same for a param modified in place (\"one of the "
              "variables needed for gradient computation has been modified by an inplace "
              "operation\"); run a new forward after step()",
              note_of_step(h->weights_epoch + 1).empty() ? "" : ". ", note_of_step(h->weights_epoch + 1));
  const auto entry = params_.find(h->id);
  TORCH_CHECK(entry != params_.end(), "zero_lifetime: saved param ds_id=", h->id,
              " is no longer registered");
  const py::object param = entry->second.param;  // strong ref: gather may re-register params
  const int64_t full_numel = entry->second.numel;
  const at::Tensor& p = tensor_of(param);

  if (needs_gather(param, full_numel, p)) {
    TORCH_CHECK(!gather_.is_none(), "zero_lifetime: param ds_id=", h->id,
                " is released and no gather callback is set");
    gather_(param);
    TORCH_CHECK(p.numel() == full_numel, "zero_lifetime: gather(p) did not make param ds_id=",
                h->id, " available (numel ", p.numel(), ", expected ds_numel ", full_numel, ")");
    core_.note_regather(h->id);
    set_range_to_current_data(h->id, p);  // the gathered data may live at a new address
  }
  // A plain, grad-less view of the current data: autograd re-attaches the grad metadata
  // it recorded at pack time.
  return py::reinterpret_steal<py::object>(
      THPVariable_Wrap(restore_view(p, h->sizes, h->strides, h->delta, h->id)));
}

at::Tensor Tracker::restore_view(const at::Tensor& p, c10::IntArrayRef sizes,
                                 c10::IntArrayRef strides, int64_t delta, int64_t id) {
  const int64_t offset = p.storage_offset() + delta;
  if (!is_plain_dense(p)) {
    const at::Tensor data = p.variable_data();
    return data.as_strided(sizes, strides, offset);
  }
  // Equivalent to p.data.as_strided(...) with one TensorImpl instead of two and no
  // dispatcher; as as_strided would, refuse geometry outside the storage.
  const int64_t extent = extent_in_elements(sizes, strides);
  const auto itemsize = static_cast<int64_t>(p.itemsize());
  TORCH_CHECK(offset >= 0 && (offset + extent) * itemsize <=
                                 static_cast<int64_t>(p.storage().nbytes()),
              "zero_lifetime: saved view of param ds_id=", id, " (offset ", offset,
              ", extent ", extent, " elements) lies outside its gathered storage");
  c10::intrusive_ptr<c10::TensorImpl> impl = p.unsafeGetTensorImpl()->shallow_copy_and_detach(
      c10::VariableVersion(/*version=*/0), /*allow_tensor_metadata_change=*/true);
  impl->set_autograd_meta(nullptr);
  impl->set_sizes_and_strides(sizes, strides, offset);
  return at::Tensor(std::move(impl));
}

void Tracker::release_handle(int64_t id, uint64_t generation) {
  if (generation != generation_) return;  // unregistered since: nothing to give back
  const ReleaseResult released = core_.release(id);
  if (released.unpinned_now && !on_unpinned_.is_none()) {
    const py::object param = params_.at(id).param;
    on_unpinned_(param);
  }
}

int64_t Tracker::refcount(py::handle param) const { return core_.refcount(registered_id(param)); }

bool Tracker::is_pinned(py::handle param) const { return core_.is_pinned(registered_id(param)); }

py::list Tracker::force_unpin_all() {
  py::list unpinned;
  for (int64_t id : core_.force_unpin_all()) unpinned.append(params_.at(id).param);
  return unpinned;
}

py::dict Tracker::stats() const {
  const Stats s = core_.stats();
  py::dict d;
  d["pinned_params"] = s.pinned_params;
  d["pinned_bytes"] = s.pinned_bytes;
  d["peak_pinned_bytes"] = s.peak_pinned_bytes;
  d["deferred_releases"] = s.deferred_releases;
  d["regathers"] = s.regathers;
  d["live_handles"] = s.live_handles;
  d["pin_budget_fallbacks"] = s.pin_budget_fallbacks;
  return d;
}

int Tracker::traverse(visitproc visit, void* arg) const {
  Py_VISIT(gather_.ptr());
  Py_VISIT(on_pinned_.ptr());
  Py_VISIT(on_unpinned_.ptr());
  Py_VISIT(available_status_.ptr());
  for (const auto& kv : params_) Py_VISIT(kv.second.param.ptr());
  return 0;
}

void Tracker::clear_references() {
  // Break cycles through the callbacks (they usually close over the tracker's owner).
  // Params stay: live handles may still need them, and they do not point back here.
  gather_ = py::none();
  on_pinned_ = py::none();
  on_unpinned_ = py::none();
  available_status_ = py::object();
}

}  // namespace zero_lifetime
