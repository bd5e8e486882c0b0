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
where the hooks on that forward's outputs divided. Only inputs that are DeepSpeed engines'
outputs are undone: the gradient of any other input (data, an embedding computed outside the
engines) stays divided, as torch's ``(loss / GAS).backward()`` has it.
"""

import torch

# Set on every output tensor of an installed engine's forward. DeepSpeed's own mark (its hook
# managers) sits on the first output tensor only; it still finds a stock engine's output.
ENGINE_OUTPUT_MARK = "_zero_lifetime_engine_output"


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
        """``args`` and ``kwargs`` with each engine-output tensor among them (in lists, tuples
        and dicts too) replaced by a view whose gradient is multiplied back by this engine's
        GAS in the passes where ``division`` happened."""
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
            if tensor.grad_fn is not None:
                setattr(tensor, ENGINE_OUTPUT_MARK, True)

    def _is_engine_output(self, tensor) -> bool:
        if not tensor.requires_grad or tensor.grad_fn is None:
            return False
        return getattr(tensor, ENGINE_OUTPUT_MARK, False) or self._is_deepspeed_output(tensor)

    @staticmethod
    def _undone(tensor, factor, division):
        # A plain view with a tensor hook, not a custom autograd Function: the model may
        # still modify its input in place.
        view = tensor.view_as(tensor)

        def multiply_back(grad):
            return grad * factor if division.happened_in_this_pass() else None

        view.register_hook(multiply_back)
        return view
