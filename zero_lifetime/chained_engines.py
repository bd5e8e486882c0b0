"""An engine fed a DeepSpeed engine's output: each engine's gradients divided by its gradient
accumulation once, not once per engine they pass on the way back.

On the torch-style path (``loss.backward()``), DeepSpeed 0.18.9 and 0.19.8 divide the gradient
flowing back through an engine's forward outputs by that engine's gradient_accumulation_steps
(0.18.9's ``engine.backward(loss)`` too: it divides at the outputs, not the loss).
When engine B is fed engine A's output (an encoder engine feeding a head engine, a GAN's G
feeding a D whose params take gradients in G's step, an engine fed its own earlier output), the
gradient reaching A's params has passed B's outputs and then A's: with GAS 2 on both, A trained
on a quarter of the loss's gradient instead of the half that torch's ``(loss / 2).backward()``
gives, silently, installed or not. 0.19.8's ``engine.backward(loss)`` divides the loss once
instead (its hooks stand aside), and was right.

B multiplies the gradient leaving it through such an input back by its own GAS, in the passes
where the hooks on that forward's outputs divided. Only inputs whose whole gradient goes on into
one engine's output are undone: the output itself, or what one chain of ops made of it alone
(pooled, sliced, an activation, concatenated with labels). The gradient of any other input
(data, an embedding computed outside the engines) stays divided, as torch's
``(loss / GAS).backward()`` has it. An input mixed from an engine output and something else
that needs a gradient is left alone too (its engine share stays divided twice, as in stock):
the two shares cannot be told apart at B's input.
"""

import torch

# Autograd node metadata of each output of an installed engine's forward: the output numbers
# (of that node) that are engine outputs. Nodes take neither attributes nor weak references,
# and the output tensor may be gone (a temporary) when the next engine sees what came of it.
ENGINE_OUTPUT_MARK = "zero_lifetime_engine_output"
# Nodes walked back from an input looking for an engine output: a pooling or an activation
# between two engines is a few nodes; a long walk means the input came from elsewhere.
MAX_NODES_WALKED = 64


class OutputDivision:
    """Whether one forward's output hooks divided the gradient in the running backward pass."""

    __slots__ = ("_task",)

    def __init__(self):
        self._task = None

    def note(self) -> None:
        self._task = torch._C._current_graph_task_id()

    def happened_in_this_pass(self) -> bool:
        return self._task is not None and self._task == torch._C._current_graph_task_id()


class ChainedInputs:
    """Undoes one engine's output division on the gradient it passes back into another
    engine's outputs (see the module docstring)."""

    def __init__(self, engine, is_deepspeed_output):
        self._engine = engine
        self._is_deepspeed_output = is_deepspeed_output  # the adapter's: DeepSpeed's mark

    def undo_division_on_inputs(self, args, kwargs, division: OutputDivision):
        """``args`` and ``kwargs`` with each tensor among them (in lists, tuples and dicts too)
        whose gradient goes on into an engine's output replaced by a view whose gradient is
        multiplied back by this engine's GAS in the passes where ``division`` happened."""
        factor = self._engine.gradient_accumulation_steps()
        if factor == 1:
            return args, kwargs

        def undo(value):
            if isinstance(value, torch.Tensor):
                return self._undone(value, factor, division) if self._is_engine_output(value) else value
            if type(value) in (list, tuple):
                items = [undo(item) for item in value]
                changed = any(new is not old for new, old in zip(items, value))
                return type(value)(items) if changed else value
            if type(value) is dict:
                items = {key: undo(item) for key, item in value.items()}
                changed = any(items[key] is not value[key] for key in value)
                return items if changed else value
            return value

        return undo(args), undo(kwargs)

    @staticmethod
    def mark_outputs(tensors) -> None:
        for tensor in tensors:
            node = tensor.grad_fn
            if node is not None:
                node.metadata.setdefault(ENGINE_OUTPUT_MARK, set()).add(tensor.output_nr)

    def _is_engine_output(self, tensor) -> bool:
        """All of the gradient flowing into ``tensor`` goes on into one engine's output."""
        if not tensor.requires_grad or tensor.grad_fn is None:
            return False
        if self._is_deepspeed_output(tensor):  # a stock engine's (first) output
            return True
        return _chain_ends_at_engine_output(tensor.grad_fn, tensor.output_nr)

    @staticmethod
    def _undone(tensor, factor, division):
        # A plain view with a tensor hook, not a custom autograd Function: the model may
        # still modify its input in place.
        view = tensor.view_as(tensor)

        def multiply_back(grad):
            return grad * factor if division.happened_in_this_pass() else None

        view.register_hook(multiply_back)
        return view


def _chain_ends_at_engine_output(node, output_nr) -> bool:
    """Walk back from output ``output_nr`` of ``node`` while each node has one input that needs
    a gradient; True on reaching a marked engine output."""
    for _ in range(MAX_NODES_WALKED):
        marked = node.metadata.get(ENGINE_OUTPUT_MARK)
        if marked is not None:  # an engine's last op: past it lies that engine's inside
            return output_nr in marked
        inputs = [(parent, nr) for parent, nr in node.next_functions if parent is not None]
        if len(inputs) != 1:
            return False  # a leaf (no inputs), or a mix of several
        node, output_nr = inputs[0]
    return False
