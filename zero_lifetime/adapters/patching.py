"""Per-instance overrides of DeepSpeed methods, undone exactly.

An instance attribute shadows the class's method for one optimizer only. Several of our
layers may wrap the same method (each wraps what the one before left), so ``undo``
puts back whatever the instance held before, not just "nothing".
"""

import functools

_ABSENT = object()


class InstancePatch:
    """``obj.<name>`` replaced by ``make_replacement(original)`` on this instance.

    Patches of one name are undone in the reverse order of patching."""

    def __init__(self, obj, name: str, make_replacement):
        self._obj, self._name = obj, name
        self._previous = obj.__dict__.get(name, _ABSENT)
        self.original = getattr(obj, name)  # what ran before: the class's method or an earlier wrapper
        obj.__dict__[name] = make_replacement(self.original)

    def undo(self) -> None:
        if self._previous is _ABSENT:
            self._obj.__dict__.pop(self._name, None)
        else:
            self._obj.__dict__[self._name] = self._previous


def wrap_method(obj, name: str, around) -> InstancePatch:
    """``around(original, *args, **kwargs)`` runs in place of ``obj.<name>(*args, **kwargs)``."""
    return InstancePatch(obj, name, lambda original: functools.partial(around, original))


class Patches:
    """Several instance patches, undone together in the reverse order of patching."""

    def __init__(self):
        self._applied = []

    def wrap(self, obj, name: str, around) -> InstancePatch:
        """As :func:`wrap_method`, kept for ``undo``."""
        return self.keep(wrap_method(obj, name, around))

    def replace(self, obj, name: str, function) -> InstancePatch:
        """``function`` in place of ``obj.<name>`` (``.original`` on the result is what it replaced)."""
        return self.keep(InstancePatch(obj, name, lambda _original: function))

    def apply(self, obj, name: str, make_replacement) -> InstancePatch:
        """``make_replacement(original)`` in place of ``obj.<name>``."""
        return self.keep(InstancePatch(obj, name, make_replacement))

    def undo(self) -> None:
        while self._applied:
            self._applied.pop().undo()

    def keep(self, patch: InstancePatch) -> InstancePatch:
        """A patch made elsewhere (an adapter's), undone with these, in order."""
        self._applied.append(patch)
        return patch
