"""ZeRO-1/2 without offload, DeepSpeed's Muon optimizer: several backwards before one step().

At a boundary epilogue ``get_flat_partition`` turns the running sum of reduced gradients
(``all_grad_tensors[g]``) of a group of params tagged ``use_muon`` into Muon's update: it
folds the gradient into the momentum and orthogonalises the result (Newton-Schulz). That is
not linear in the gradient, so the partitions of two backwards cannot be summed afterwards
as for other groups (summed: 0.017 off stock's summed loss after 3 steps). Instead the
epilogue of a later backward gets the raw sum:

- every boundary call keeps a copy of the raw gradients it is given (``muon_update``
  overwrites them in place, with nesterov) and, where the release updates the momentum
  in place (0.17.6, 0.18.9), a copy of the momentum from before the first call of the step;
- ``take`` arms the kept raw sum for the next epilogue of that group, which adds it to the
  new backward's gradients and starts again from the momentum of before the step, so Muon
  runs once on the sum of the backwards. 0.19.8 stages the momentum of each call from the
  committed one and commits it in step(), so there is nothing to put back there;
- a backward dropped by ``zero_grad()``, or a step skipped on an fp16 overflow, leaves the
  momentum as it was before the step on every release (stock 0.17.6 and 0.18.9 keep its fold:
  after an overflow a non-finite momentum, and every later step overflows too).

The copies live from a boundary epilogue to step(): one copy of the gradients of this
rank's Muon params (the gradients stock frees there).
"""

from .errors import require
from .patching import wrap_method

_FLAT_PARTITION = "get_flat_partition"
_STAGED_MOMENTUM = "_muon_staging_momentum"  # 0.19.8: the epilogue leaves the committed momentum alone
_ABSENT = object()  # no momentum yet: the first epilogue makes a zero one


def muon_rewritten_groups(optimizer) -> set:
    """Param groups whose boundary partitions DeepSpeed fills with Muon's update: ones with
    params tagged ``use_muon``, under an optimizer whose class name says Muon (its own test in
    ``get_flat_partition``, 0.17.6 to 0.19.8)."""
    inner = getattr(optimizer, "optimizer", None)
    if "muon" not in type(inner).__name__.lower():
        return set()
    groups = require(optimizer, "bit16_groups", "the ZeRO-1/2 param groups")
    return {i for i, group in enumerate(groups) if any(getattr(p, "use_muon", False) for p in group)}


class _Boundary:
    """One group's raw gradient sum at the step's boundary so far, and the momentum before it."""

    __slots__ = ("raw_sum", "momentum_before")

    def __init__(self, raw_sum, momentum_before):
        self.raw_sum = raw_sum
        self.momentum_before = momentum_before


class Zero12MuonCarry:

    def __init__(self, optimizer, groups):
        self.optimizer = optimizer
        self.groups = frozenset(groups)
        require(optimizer, _FLAT_PARTITION, "the ZeRO-1/2 boundary partition builder")
        require(optimizer, "all_grad_tensors", "the ZeRO-1/2 running gradient sums")
        require(optimizer, "param_groups", "the ZeRO-1/2 flat param groups")
        self._inner = require(optimizer, "optimizer", "the optimizer ZeRO-1/2 wraps")
        self._momentum_in_place = not hasattr(optimizer, _STAGED_MOMENTUM)
        self._seen = {}  # group -> _Boundary: what this step's boundary epilogues were given
        self._armed = {}  # group -> _Boundary: to add in the next epilogue
        self._patch = wrap_method(optimizer, _FLAT_PARTITION, self._flat_partition)

    def take(self, groups) -> None:
        """Before another backward: the earlier backwards' raw sum for ``groups`` (ones whose
        boundary partitions are built) goes into that backward's epilogue."""
        missing = sorted(g for g in groups if g not in self._seen)
        if missing:  # built where we did not see it (before install() is refused earlier)
            raise RuntimeError(f"zero_lifetime: no raw gradients kept for DeepSpeed's Muon param groups {missing}")
        self._armed = {g: self._seen[g] for g in groups}

    def backward_ended(self) -> None:
        """After that backward's epilogue, or its death before it. A group it did not rebuild
        still has the earlier sum in ``_seen``, for the next backward's ``take``."""
        self._armed = {}

    def step_done(self, skipped: bool = False) -> None:
        """step() took the sum, and the momentum it left is the step's; or ``skipped`` it (an
        fp16 overflow), which leaves the optimizer state as it was (torch's GradScaler, and
        0.19.8's staged momentum): 0.17.6 and 0.18.9 kept the overflow folded into the momentum,
        non-finite, so that every later step overflowed too."""
        if skipped:
            self.discard()
        self._seen, self._armed = {}, {}

    def discard(self) -> None:
        """zero_grad() before step(): the backwards of the step never happened for Muon either."""
        for group, boundary in {**self._seen, **self._armed}.items():
            self._restore_momentum(group, boundary.momentum_before)
        self._seen, self._armed = {}, {}

    def restore(self) -> None:
        self._patch.undo()

    def _flat_partition(self, original, tensor_list, *args, **kwargs):
        group = _group_index(args, kwargs)
        if group not in self.groups or not tensor_list:
            return original(tensor_list, *args, **kwargs)
        running = self.optimizer.all_grad_tensors
        armed = self._armed.pop(group, None)
        if armed is None:
            momentum_before = self._momentum_copy(group)
        else:
            momentum_before = armed.momentum_before
            self._restore_momentum(group, momentum_before)
            running[group] = [now + earlier for now, earlier in zip(running[group], armed.raw_sum)]
        # Before the call: with nesterov, muon_update overwrites the gradients it is given.
        self._seen[group] = _Boundary([g.detach().clone() for g in running[group]], momentum_before)
        return original(tensor_list, *args, **kwargs)

    def _state(self, group):
        return self._inner.state[self.optimizer.param_groups[group]["params"][0]]

    def _momentum_copy(self, group):
        if not self._momentum_in_place:
            return None
        momentum = self._state(group).get("momentum_buffer")
        return _ABSENT if momentum is None else momentum.detach().clone()

    def _restore_momentum(self, group, momentum_before) -> None:
        if momentum_before is None:
            return
        state = self._state(group)
        if momentum_before is _ABSENT:
            state.pop("momentum_buffer", None)
        else:
            state["momentum_buffer"].copy_(momentum_before)


def _group_index(args, kwargs) -> int:
    """``param_group_idx`` of ``get_flat_partition(tensor_list, first_offset, partition_size,
    dtype, device, param_group_idx, ...)``, passed by keyword or by position."""
    if "param_group_idx" in kwargs:
        return kwargs["param_group_idx"]
    return args[4]
