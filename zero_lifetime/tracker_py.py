"""Pure-Python Tracker: reference implementation and fallback for ``zero_lifetime._C``.

Same methods and semantics as the compiled ``Tracker`` (csrc/tracker_binding.cpp), so
``zero_lifetime._native.get_tracker_impl()`` can return either one. The compiled one is
faster on the pack/unpack hot path; this one needs no compiler.

A Tracker is used as ``torch.autograd.graph.saved_tensors_hooks(tr.pack, tr.unpack)``:
``pack`` turns a saved ZeRO-3 parameter (or a view of one) into a :class:`SavedParam`
handle that counts as a live reference on that parameter; ``unpack`` returns the
gathered data, calling the ``gather`` callback first if the parameter was released
meanwhile. Under the "pin" policy, a referenced parameter is pinned (kept gathered)
until its last handle dies, within a byte budget.

This module must not import deepspeed: it is the fallback when nothing else works.
"""

from __future__ import annotations

import bisect
import collections
import threading
from typing import Any, Callable, Dict, List, Optional

import torch

POLICIES = ("regather", "pin")

# As the C++ tracker's kMaxStepNoteRuns: a handle older than every run kept gets no note.
_MAX_STEP_NOTE_RUNS = 16

_STAT_KEYS = (
    "pinned_params",
    "pinned_bytes",
    "peak_pinned_bytes",
    "deferred_releases",
    "regathers",
    "live_handles",
    "pin_budget_fallbacks",
)


class _ParamState:
    __slots__ = ("nbytes", "persistent", "refcount", "pinned")

    def __init__(self, nbytes: int, persistent: bool) -> None:
        self.nbytes = nbytes
        self.persistent = persistent
        self.refcount = 0
        self.pinned = False


class SavedParam:
    """Handle autograd stores instead of a parameter (or a view of one).

    Holds no tensor: only the view geometry relative to the parameter's data, so the
    parameter may be released and re-gathered (at another address) before backward.
    Its death (``__del__``) drops the reference it counted.
    """

    __slots__ = ("_tracker", "ds_id", "_generation", "_weights_epoch", "_sizes", "_strides", "_delta")

    def __init__(self, tracker: "Tracker", ds_id: int, generation: int, weights_epoch: int,
                 sizes: tuple, strides: tuple, delta: int) -> None:
        self._tracker = tracker
        self._weights_epoch = weights_epoch
        self.ds_id = ds_id
        self._generation = generation
        self._sizes = sizes
        self._strides = strides
        self._delta = delta  # element offset of the view from the start of param.data

    def __del__(self) -> None:
        # Exceptions raised here are reported by Python as "Exception ignored in ..."
        # and never propagate, which is what a destructor needs.
        self._tracker._release_handle(self)

    def __repr__(self) -> str:
        return f"SavedParam(ds_id={self.ds_id}, sizes={self._sizes})"


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; allowed values: {', '.join(POLICIES)}")


class Tracker:
    """Reference counts of saved ZeRO-3 params, pin policy and address-range lookup."""

    def __init__(self, policy: str, max_pinned_bytes: int) -> None:
        _check_policy(policy)
        self.policy = policy
        self.max_pinned_bytes = int(max_pinned_bytes)  # < 0 means unlimited
        self._pin_policy = policy == "pin"
        # Guards the counters below: handles die on autograd worker threads and in GC.
        # Callbacks are always invoked after the lock is dropped, so they may re-enter.
        self._lock = threading.Lock()
        self._state: Dict[int, _ParamState] = {}
        self._params: Dict[int, torch.nn.Parameter] = {}
        self._numel: Dict[int, int] = {}
        # id(param object) -> ds_id; ids cannot be reused while we hold the params.
        self._id_by_obj: Dict[int, int] = {}
        # Address ranges of gathered params: sorted, non-overlapping starts.
        self._range_starts: List[int] = []
        self._range_by_start: Dict[int, tuple] = {}  # start -> (end, ds_id)
        self._start_by_id: Dict[int, int] = {}
        # Handles made before unregister_all() carry an older generation and are inert.
        self._generation = 0
        self._weights_epoch = 0  # advanced by each optimizer step that changed the weights
        # Who took each step, as runs of equal notes [first epoch, note], so a refusal names
        # the first step after its forward (the C++ tracker keeps the same, bounded alike).
        self._step_note_runs: collections.deque = collections.deque(maxlen=_MAX_STEP_NOTE_RUNS)
        self._gather: Optional[Callable[[Any], Any]] = None
        self._on_pinned: Optional[Callable[[Any], Any]] = None
        self._on_unpinned: Optional[Callable[[Any], Any]] = None
        self._available_status: Any = None
        self._status_check = False
        self._pinned_bytes = 0
        self._peak_pinned_bytes = 0
        self._pinned_params = 0
        self._deferred_releases = 0
        self._regathers = 0
        self._live_handles = 0
        self._pin_budget_fallbacks = 0

    # ----------------------------------------------------------------- configuration
    def set_callbacks(self, gather, on_pinned, on_unpinned) -> None:
        self._gather = gather
        self._on_pinned = on_pinned
        self._on_unpinned = on_unpinned

    def set_available_status(self, status) -> None:
        self._available_status = status
        self._status_check = True

    def register_param(self, p) -> None:
        ds_id = int(p.ds_id)
        numel = int(p.ds_numel)
        nbytes = numel * p.element_size()
        persistent = bool(getattr(p, "ds_persist", False))
        with self._lock:
            st = self._state.get(ds_id)
            if st is None:
                self._state[ds_id] = _ParamState(nbytes, persistent)
            else:  # re-registration updates size/persistence, keeps counts
                if st.pinned:
                    self._pinned_bytes += nbytes - st.nbytes
                    self._peak_pinned_bytes = max(self._peak_pinned_bytes, self._pinned_bytes)
                st.nbytes = nbytes
                st.persistent = persistent
            old = self._params.get(ds_id)
            if old is not None:
                self._id_by_obj.pop(id(old), None)
            self._params[ds_id] = p
            self._numel[ds_id] = numel
            self._id_by_obj[id(p)] = ds_id

    def advance_weights_epoch(self, step_note: str = "") -> None:
        """An optimizer step changed the weights: handles saved before it refuse to unpack.
        ``step_note``: who took that step, added to the refusal (accelerate's backward() steps
        by itself, which the refusal alone would not tell)."""
        self._weights_epoch += 1
        if not self._step_note_runs or self._step_note_runs[-1][1] != step_note:
            self._step_note_runs.append((self._weights_epoch, step_note))

    def _note_of_step(self, epoch: int) -> str:
        for first_epoch, note in reversed(self._step_note_runs):
            if first_epoch <= epoch:
                return note
        return ""

    def unregister_all(self) -> None:
        """Forget every param. Live handles become inert (their death releases nothing)."""
        with self._lock:
            self._generation += 1
            self._state.clear()
            self._params.clear()
            self._numel.clear()
            self._id_by_obj.clear()
            self._range_starts.clear()
            self._range_by_start.clear()
            self._start_by_id.clear()
            self._pinned_bytes = 0
            self._pinned_params = 0
            self._live_handles = 0

    # ------------------------------------------------------------- address ranges
    def note_gathered(self, p) -> None:
        """Record where p's gathered data lives, so detached views of it are recognised."""
        ds_id = self._known_id(p)
        with self._lock:
            self._set_range_to_data_locked(ds_id, p)

    def note_gathered_all(self, params) -> None:
        """note_gathered(p) for each p of ``params`` that is gathered now (unpack would not gather it)."""
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"note_gathered_all expects params, got {type(p).__name__}")
            ds_id = self._known_id(p)
            if not self._needs_gather(self._params[ds_id], ds_id):
                with self._lock:
                    self._set_range_to_data_locked(ds_id, p)

    def _set_range_to_data_locked(self, ds_id: int, p) -> None:
        """Register p's current data as the address range of param ds_id."""
        self._set_range_locked(ds_id, p.data_ptr(), p.numel() * p.element_size())

    def _needs_gather(self, p, ds_id: int) -> bool:
        return (self._status_check and p.ds_status != self._available_status) or (
            p.numel() == 0 and self._numel[ds_id] > 0)

    def note_released(self, p) -> None:
        ds_id = self._known_id(p)
        with self._lock:
            self._clear_range_locked(ds_id)

    def _set_range_locked(self, ds_id: int, start: int, nbytes: int) -> None:
        self._clear_range_locked(ds_id)
        if nbytes <= 0:
            return
        end = start + nbytes
        starts = self._range_starts
        # Drop stale ranges overlapping the new one (memory reused after a missed
        # note_released), keeping the registry disjoint so lookup is a single bisect.
        i = bisect.bisect_left(starts, start)
        if i > 0 and self._range_by_start[starts[i - 1]][0] > start:
            i -= 1
        while i < len(starts) and starts[i] < end:
            _, stale_id = self._range_by_start.pop(starts[i])
            del self._start_by_id[stale_id]
            del starts[i]
        bisect.insort(starts, start)
        self._range_by_start[start] = (end, ds_id)
        self._start_by_id[ds_id] = start

    def _clear_range_locked(self, ds_id: int) -> None:
        start = self._start_by_id.pop(ds_id, None)
        if start is not None:
            del self._range_by_start[start]
            del self._range_starts[bisect.bisect_left(self._range_starts, start)]

    def _lookup(self, addr: int) -> int:
        with self._lock:
            starts = self._range_starts
            i = bisect.bisect_right(starts, addr) - 1
            if i < 0:
                return -1
            end, ds_id = self._range_by_start[starts[i]]
            return ds_id if addr < end else -1

    # ------------------------------------------------------------------- hot path
    def pack(self, t):
        ds_id = self._id_by_obj.get(id(t))
        if ds_id is not None:  # (a) the param itself
            p = self._params[ds_id]
        else:
            ds_id = self._resolve_view(t)
            if ds_id is None:
                # Returning a tensor that owns a grad_fn would make the graph reference
                # itself through the saved tensor: an uncollectable cycle.
                return t if t.grad_fn is None else t.detach()
            p = self._params[ds_id]
        p_ptr = p.data_ptr()
        if p.numel() == 0 and self._numel[ds_id] > 0:
            raise RuntimeError(
                f"zero_lifetime: param ds_id={ds_id} is saved for backward while released "
                f"(numel 0, ds_numel {self._numel[ds_id]}); it must be gathered during forward")
        delta = (t.data_ptr() - p_ptr) // p.element_size()
        with self._lock:
            gen = self._generation
            pinned_now = self._acquire_locked(ds_id)
        # Create the handle before the callback: if on_pinned raises, the handle's death
        # still gives the reference back.
        handle = SavedParam(self, ds_id, gen, self._weights_epoch, tuple(t.shape), t.stride(), delta)
        if pinned_now and self._on_pinned is not None:
            self._on_pinned(p)
        return handle

    def _resolve_view(self, t) -> Optional[int]:
        base = t._base
        if base is not None:  # (b) an autograd view of the param, e.g. W.t()
            ds_id = self._id_by_obj.get(id(base))
            if ds_id is not None:
                return ds_id if t.dtype == base.dtype else None
        if not self._range_starts:
            return None
        # (c) shares the param's memory without autograd view tracking (e.g. p.data[2:])
        if t.layout is not torch.strided or t.numel() == 0:
            return None
        try:
            t_start = t.data_ptr()
        except RuntimeError:  # e.g. tensor subclasses without accessible data
            return None
        ds_id = self._lookup(t_start)
        if ds_id < 0:
            return None
        p = self._params[ds_id]
        if t.dtype != p.dtype or t.device != p.device:
            return None
        itemsize = t.element_size()
        p_start = p.data_ptr()
        if (t_start - p_start) % itemsize:
            return None
        extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
        if p_start <= t_start and t_start + extent * itemsize <= p_start + p.numel() * itemsize:
            return ds_id
        return None

    def unpack(self, obj):
        if type(obj) is not SavedParam:
            return obj
        if obj._tracker is not self or obj._generation != self._generation:
            raise RuntimeError(
                f"zero_lifetime: saved param ds_id={obj.ds_id} belongs to another tracker or "
                "was unregistered (unregister_all) before backward used it")
        ds_id = obj.ds_id
        if obj._weights_epoch != self._weights_epoch:
            # torch refuses a saved tensor modified in place since the forward; with
            # saved-tensor hooks it does not check, so the step is checked here.
            step_note = self._note_of_step(obj._weights_epoch + 1)
            raise RuntimeError(
                f"zero_lifetime: param ds_id={ds_id} was updated by an optimizer step() after the forward "
                "that saved it for this backward. torch refuses the same for a param modified in place "
                "(\"one of the variables needed for gradient computation has been modified by an inplace "
                "operation\"); run a new forward after step()" + (f". {step_note}" if step_note else ""))
        p = self._params[ds_id]
        if self._needs_gather(p, ds_id):
            if self._gather is None:
                raise RuntimeError(
                    f"zero_lifetime: param ds_id={ds_id} is released and no gather callback is set")
            self._gather(p)
            if p.numel() != self._numel[ds_id]:
                raise RuntimeError(
                    f"zero_lifetime: gather(p) did not make param ds_id={ds_id} available "
                    f"(numel {p.numel()}, expected ds_numel {self._numel[ds_id]})")
            with self._lock:
                self._regathers += 1
                self._set_range_to_data_locked(ds_id, p)  # the gathered data may live at a new address
        data = p.data  # detached alias: the result must be a plain view, autograd re-attaches grad info
        return data.as_strided(obj._sizes, obj._strides, data.storage_offset() + obj._delta)

    # ----------------------------------------------------------- refcount core
    def _acquire_locked(self, ds_id: int) -> bool:
        st = self._state[ds_id]
        st.refcount += 1
        self._live_handles += 1
        if self._pin_policy and not st.pinned and not st.persistent:
            if self.max_pinned_bytes < 0 or self._pinned_bytes + st.nbytes <= self.max_pinned_bytes:
                st.pinned = True
                self._pinned_params += 1
                self._pinned_bytes += st.nbytes
                if self._pinned_bytes > self._peak_pinned_bytes:
                    self._peak_pinned_bytes = self._pinned_bytes
                return True
            self._pin_budget_fallbacks += 1
        return False

    def _release_handle(self, handle: SavedParam) -> None:
        ds_id = handle.ds_id
        with self._lock:
            if handle._generation != self._generation:
                return  # unregistered since: nothing to give back
            st = self._state[ds_id]
            if st.refcount <= 0:
                raise RuntimeError(f"zero_lifetime: refcount underflow for param ds_id={ds_id}")
            st.refcount -= 1
            self._live_handles -= 1
            unpinned_now = st.refcount == 0 and st.pinned
            if unpinned_now:
                st.pinned = False
                self._pinned_params -= 1
                self._pinned_bytes -= st.nbytes
                self._deferred_releases += 1
            p = self._params[ds_id]
        if unpinned_now and self._on_unpinned is not None:
            self._on_unpinned(p)

    # ------------------------------------------------------------------- queries
    def _known_id(self, p) -> int:
        ds_id = int(p.ds_id)
        if ds_id not in self._params:
            raise ValueError(f"zero_lifetime: param ds_id={ds_id} is not registered")
        return ds_id

    def refcount(self, p) -> int:
        ds_id = self._known_id(p)
        with self._lock:
            return self._state[ds_id].refcount

    def is_pinned(self, p) -> bool:
        ds_id = self._known_id(p)
        with self._lock:
            return self._state[ds_id].pinned

    def force_unpin_all(self) -> list:
        """Fault recovery: unpin everything (refcounts untouched); returns the params that were pinned."""
        with self._lock:
            ids = [i for i, st in self._state.items() if st.pinned]
            for i in ids:
                self._state[i].pinned = False
            self._pinned_params = 0
            self._pinned_bytes = 0
            return [self._params[i] for i in ids]

    def stats(self) -> dict:
        with self._lock:
            return {
                "pinned_params": self._pinned_params,
                "pinned_bytes": self._pinned_bytes,
                "peak_pinned_bytes": self._peak_pinned_bytes,
                "deferred_releases": self._deferred_releases,
                "regathers": self._regathers,
                "live_handles": self._live_handles,
                "pin_budget_fallbacks": self._pin_budget_fallbacks,
            }

    def reset_peak(self) -> None:
        with self._lock:
            self._peak_pinned_bytes = self._pinned_bytes

    def __repr__(self) -> str:
        return f"tracker_py.Tracker(policy={self.policy!r}, max_pinned_bytes={self.max_pinned_bytes})"
