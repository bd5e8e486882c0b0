// zero_lifetime._C: Python module exposing the compiled Tracker.
// Built by setup.py (zero_lifetime._C), the JIT loader (zero_lifetime/_native.py) or
// CMake with ZL_BUILD_TORCH_EXTENSION=ON, all from csrc/sources.txt.
#include <torch/extension.h>

#include "ops/fast_path.h"
#include "tracker_binding.h"

// ZL_BUILD_HASH arrives as an identifier (see build_hash_define() in _native.py).
#define ZL_STRINGIZE_IMPL(x) #x
#define ZL_STRINGIZE(x) ZL_STRINGIZE_IMPL(x)
#ifdef ZL_BUILD_HASH
#define ZL_BUILD_HASH_STRING ZL_STRINGIZE(ZL_BUILD_HASH)
#else
#define ZL_BUILD_HASH_STRING ""
#endif

namespace py = pybind11;
using zero_lifetime::Tracker;

namespace {

// Map torch's exception types to the matching Python ones, without the C++ backtrace.
// Module-local, so torch's own translation is left alone.
void translate_c10_errors(std::exception_ptr error) {
  try {
    if (error) std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    zero_lifetime::set_python_error(e);
  }
}

// GC support: callbacks commonly close over the engine that owns the tracker.
void setup_tracker_gc(PyHeapTypeObject* heap_type) {
  PyTypeObject* type = &heap_type->ht_type;
  type->tp_flags |= Py_TPFLAGS_HAVE_GC;
  type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) -> int {
    Py_VISIT(Py_TYPE(self));  // heap types own a reference to their type
    if (!py::detail::is_holder_constructed(self)) return 0;
    return py::cast<const Tracker&>(py::handle(self)).traverse(visit, arg);
  };
  type->tp_clear = [](PyObject* self) -> int {
    if (py::detail::is_holder_constructed(self)) {
      py::cast<Tracker&>(py::handle(self)).clear_references();
    }
    return 0;
  };
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Compiled core of zero_lifetime: saved-tensor lifetime tracking for ZeRO-3 params";
  m.attr("build_hash") = ZL_BUILD_HASH_STRING;  // lets the loader detect a stale prebuilt module
  py::register_local_exception_translator(translate_c10_errors);
  zero_lifetime::init_saved_param_type(m);

  // module_local: a stale prebuilt _C and its JIT rebuild can both be loaded in one
  // process (the loader imports the former to read its build hash); global registration
  // of the same C++ type would make the second import fail.
  auto tracker_class =
      py::class_<Tracker>(m, "Tracker", py::module_local(), py::custom_type_setup(setup_tracker_gc))
      .def(py::init<const std::string&, int64_t>(), py::arg("policy"),
           py::arg("max_pinned_bytes"))
      .def("set_callbacks", &Tracker::set_callbacks, py::arg("gather"), py::arg("on_pinned"),
           py::arg("on_unpinned"))
      .def("set_available_status", &Tracker::set_available_status, py::arg("status"))
      .def("register_param", &Tracker::register_param, py::arg("param"))
      .def("unregister_all", &Tracker::unregister_all)
      .def("note_gathered", &Tracker::note_gathered, py::arg("param"))
      .def("note_released", &Tracker::note_released, py::arg("param"))
      .def("advance_weights_epoch", &Tracker::advance_weights_epoch, py::arg("step_note") = std::string())
      .def("refcount", &Tracker::refcount, py::arg("param"))
      .def("is_pinned", &Tracker::is_pinned, py::arg("param"))
      .def("force_unpin_all", &Tracker::force_unpin_all)
      .def("stats", &Tracker::stats)
      .def("reset_peak", &Tracker::reset_peak)
      .def_property_readonly("policy", &Tracker::policy)
      .def_property_readonly("max_pinned_bytes", &Tracker::max_pinned_bytes)
      .def("__repr__", [](const Tracker& self) {
        return "zero_lifetime._C.Tracker(policy='" + self.policy() +
               "', max_pinned_bytes=" + std::to_string(self.max_pinned_bytes()) + ")";
      });
  zero_lifetime::add_hot_path_methods(tracker_class);  // pack / unpack
  zero_lifetime::ops::add_fast_path_bindings(m);
}
