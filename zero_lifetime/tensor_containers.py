"""The tensors in a forward's inputs or outputs, replaced inside the containers that hold them.

What DeepSpeed's output hooks walk (tuples, lists and dicts, subclasses included: named tuples,
OrderedDict, a transformers ModelOutput) is walked here too, so that a tensor DeepSpeed hooked is
a tensor this module can replace.
"""

import copy

import torch


def tensors_in(value):
    """The tensors in ``value``, in the order DeepSpeed's output hooks visit them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif hasattr(value, "to_tuple"):  # transformers ModelOutput
        yield from tensors_in(value.to_tuple())


def replace_tensors(value, replace, on_unbuildable):
    """``value`` with each tensor ``t`` in it replaced by ``replace(t)``. Containers holding a
    replaced tensor are copies of their type; the rest are the objects themselves. Where a
    container's type cannot be rebuilt, ``on_unbuildable(container, exc)`` is called and the
    container is kept as it was, with its tensors unreplaced."""

    def walk(item):
        if isinstance(item, torch.Tensor):
            return replace(item)
        if isinstance(item, (list, tuple)):
            items = [walk(element) for element in item]
            if all(new is old for new, old in zip(items, item)):
                return item
            return _rebuilt(item, lambda: _sequence_like(item, items), on_unbuildable)
        if isinstance(item, dict):
            changed = {key: new for key, old in item.items() if (new := walk(old)) is not old}
            return _rebuilt(item, lambda: _mapping_like(item, changed), on_unbuildable) if changed else item
        return item

    return walk(value)


def _rebuilt(container, rebuild, on_unbuildable):
    try:
        return rebuild()
    except Exception as exc:  # a container type with its own construction rules
        on_unbuildable(container, exc)
        return container


def _sequence_like(sequence, items):
    if hasattr(type(sequence), "_fields"):  # a named tuple
        return type(sequence)._make(items)
    return type(sequence)(items)  # a subclass's constructor may refuse a list of the items


def _mapping_like(mapping, changed):
    if type(mapping) is dict:
        return {**mapping, **changed}
    # An OrderedDict, a transformers ModelOutput (whose item assignment sets the attribute
    # too): a shallow copy keeps the type and its other state.
    copied = copy.copy(mapping)
    for key, value in changed.items():
        copied[key] = value
    return copied
