// Python-facing Tracker: glues LifetimeCore to torch saved-tensor hooks.
// Semantics mirror zero_lifetime/tracker_py.py (the reference implementation).
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/lifetime_core.h"

namespace zero_lifetime {

namespace py = pybind11;

// Set the Python error matching a torch error (ValueError, TypeError, IndexError, else
// RuntimeError), without the C++ backtrace. Shared by both binding paths.
void set_python_error(const c10::Error& error);

// Type object of the handles pack() returns; a plain CPython type (not pybind11) so that
// creating one and recognising one in unpack() costs next to nothing on the hot path.
extern PyTypeObject SavedParamType;
void init_saved_param_type(py::module_& m);
// Installs Tracker.pack / Tracker.unpack as METH_O methods on the bound Tracker type.
void add_hot_path_methods(py::handle tracker_type);

// Hidden visibility like pybind11's own types, which it holds (avoids -Wattributes).
class __attribute__((visibility("hidden"))) Tracker {
 public:
  Tracker(const std::string& policy, int64_t max_pinned_bytes);
  Tracker(const Tracker&) = delete;
  Tracker& operator=(const Tracker&) = delete;

  void set_callbacks(py::object gather, py::object on_pinned, py::object on_unpinned);
  void set_available_status(py::object status);
  void register_param(py::handle param);
  void unregister_all();
  void note_gathered(py::handle param);
  // note_gathered for each param of a sequence that is gathered now (what unpack would not
  // gather): one call per module forward instead of one per param.
  void note_gathered_all(py::handle params);
  void note_released(py::handle param);
  // An optimizer step changed the weights: handles saved before it refuse to unpack.
  // `step_note`: who took that step, when the refusal alone would not tell the user
  // (accelerate's backward() steps by itself); empty for none.
  void advance_weights_epoch(std::string step_note);

  // Hot path. `self` is this tracker's Python object: handles keep it alive.
  py::object pack(py::handle self, py::handle tensor);
  py::object unpack(py::handle obj);

  // Called by a dying handle (GIL held). Throws; the caller reports instead of raising.
  void release_handle(int64_t id, uint64_t generation);

  int64_t refcount(py::handle param) const;
  bool is_pinned(py::handle param) const;
  py::list force_unpin_all();
  py::dict stats() const;
  void reset_peak() { core_.reset_peak(); }
  std::string policy() const { return policy_name(core_.policy()); }
  int64_t max_pinned_bytes() const { return core_.max_pinned_bytes(); }

  // Garbage-collector support: callbacks often close over the object owning the tracker.
  int traverse(visitproc visit, void* arg) const;
  void clear_references();

 private:
  struct ParamEntry {
    py::object param;           // strong ref: backward may outlive the module's bookkeeping
    const c10::TensorImpl* impl;  // stable across `param.data = ...` (set_data keeps the impl)
    int64_t numel;              // ds_numel: full, gathered size
  };

  int64_t registered_id(py::handle param) const;  // ds_id of a registered param or ValueError
  void set_range_to_current_data(int64_t id, const at::Tensor& param_data);
  const ParamEntry* resolve(const at::Tensor& t, int64_t& id) const;
  const ParamEntry* resolve_by_address(const at::Tensor& t, int64_t& id) const;
  bool needs_gather(py::handle param, int64_t full_numel, const at::Tensor& data) const;
  static at::Tensor restore_view(const at::Tensor& p, c10::IntArrayRef sizes,
                                 c10::IntArrayRef strides, int64_t delta, int64_t id);

  LifetimeCore core_;
  std::unordered_map<int64_t, ParamEntry> params_;
  std::unordered_map<const c10::TensorImpl*, int64_t> id_by_impl_;
  // Handles from before unregister_all() carry an older generation and become inert.
  uint64_t generation_ = 0;
  uint64_t weights_epoch_ = 0;
  // The note of each step, as runs of equal notes (an accelerate loop: one run), so a
  // refusal names the first step after its handle's forward, not the latest one. Bounded:
  // the oldest runs are dropped, and a step older than every run kept has no note.
  struct StepNoteRun {
    uint64_t first_epoch;
    std::string note;
  };
  std::deque<StepNoteRun> step_note_runs_;
  const std::string& note_of_step(uint64_t epoch) const;
  py::object gather_ = py::none();
  py::object on_pinned_ = py::none();
  py::object on_unpinned_ = py::none();
  py::object available_status_;  // null until set_available_status: status not checked
};

}  // namespace zero_lifetime
