"""An engine fed a DeepSpeed engine's output: each engine's gradients divided by its gradient
accumulation once, not once per engine they pass on the way back.

On the torch-style path (``loss.backward()``), DeepSpeed 0.18.9 and 0.19.8 divide the gradient
flowing back through an engine's forward outputs by that engine's gradient_accumulation_steps
(stock 0.18.9's ``engine.backward(loss)`` too: it divides at the outputs, not the loss).
When engine B is fed engine A's output (an encoder engine feeding a head engine, a GAN's G
feeding a D whose params take gradients in G's step, an engine fed its own earlier output), the
gradient reaching A's params has passed B's outputs and then A's: with GAS 2 on both, A trained
on a quarter of the loss's gradient instead of the half that torch's ``(loss / 2).backward()``
gives, silently, installed or not. 0.19.8's ``engine.backward(loss)`` divides the loss once
instead (its hooks stand aside), and was right; installed 0.18.9's does the same.

B multiplies the gradient leaving it through such an input back by its own GAS, in the passes
where the hooks on that forward's outputs divided. Only inputs whose whole gradient goes on into
engines' outputs are undone: an output itself, or what ops made of engine outputs alone (pooled,
sliced, an activation, concatenated with labels; two towers' outputs added or concatenated).
The gradient of any other input (data, an embedding computed outside the engines) stays
divided, as torch's ``(loss / GAS).backward()`` has it. An input mixed from an engine output
and something else that needs a gradient (``encoder(x) + free_param``) cannot be undone: the two
shares are one gradient at B's input. Its engine share stays divided twice, as in stock, and
the first pass where that happens warns, with the ways out.
"""

import collections
import warnings

import torch

from .tensor_containers import replace_tensors

# Autograd node metadata of each output of an installed engine's forward: the output numbers
# (of that node) that are engine outputs. Nodes take neither attributes nor weak references,
# and the output tensor may be gone (a temporary) when the next engine sees what came of it.
ENGINE_OUTPUT_MARK = "zero_lifetime_engine_output"
# Nodes walked back from an input looking for engine outputs: a pooling, an activation or the
# join of two towers between engines is a few nodes; a long walk means the input came from
# elsewhere (and nothing is done to it; having met an engine output on the way, it warns).
MAX_NODES_WALKED = 64
MIXED_INPUT_WARNING = (
    "zero_lifetime: an input of this engine comes partly from another engine's output and partly "
    "from a tensor outside the engines that needs a gradient (as in `encoder(x) + free_param`), "
    f"or from more than {MAX_NODES_WALKED} autograd nodes besides, which zero_lifetime does not "
    "follow. With gradient accumulation, the engine output's share of its gradient was divided "
    "by both engines' gradient_accumulation_steps, as in stock DeepSpeed: the shares cannot be "
    "told apart at the input. Keep such tensors inside an engine, or call "
    "engine.backward(loss), which divides the loss once.")


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
        self._warned = set()  # the warnings given, each once per engine

    def undo_division_on_inputs(self, args, kwargs, division: OutputDivision):
        """``args`` and ``kwargs`` with each tensor among them (in lists, tuples, named tuples
        and mappings such as a transformers ModelOutput too) whose gradient goes on into an
        engine's output replaced by a view whose gradient is multiplied back by this engine's
        GAS in the passes where ``division`` happened. Containers holding one are copies."""
        factor = self._engine.gradient_accumulation_steps()
        if factor == 1:
            return args, kwargs

        def hooked(tensor):
            return self._hooked(tensor, factor, division)

        return (replace_tensors(args, hooked, self._warn_unbuildable),
                replace_tensors(kwargs, hooked, self._warn_unbuildable))

    def _warn_unbuildable(self, container, exc):
        """The engine outputs in ``container`` stay divided twice, as in stock."""
        self._warn_once("container", f"zero_lifetime: could not pass this engine's input, a "
                        f"{type(container).__name__} holding another engine's output, on as a copy "
                        f"({exc!r}). With gradient accumulation on the torch-style path, that output's "
                        "gradient is divided by both engines' gradient_accumulation_steps, as in stock "
                        "DeepSpeed. Pass the tensor itself, or a list, tuple or dict of them.")

    def _warn_once(self, kind, message):
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    @staticmethod
    def mark_outputs(tensors) -> None:
        for tensor in tensors:
            node = tensor.grad_fn
            if node is not None:
                node.metadata.setdefault(ENGINE_OUTPUT_MARK, set()).add(tensor.output_nr)

    def _hooked(self, tensor, factor, division):
        """``tensor``, or a view of it whose hook multiplies back (its gradient all goes into
        engine outputs) or warns (only part of it does)."""
        if not tensor.requires_grad or tensor.grad_fn is None:
            return tensor
        if self._is_deepspeed_output(tensor):  # a stock engine's (first) output
            into_engines, elsewhere = True, False
        else:
            into_engines, elsewhere = _where_the_gradient_goes(tensor.grad_fn, tensor.output_nr)
        if not into_engines:
            return tensor
        if elsewhere:  # a view only to say so, until it has been said
            if "mixed" in self._warned:
                return tensor
            return _view_with_hook(tensor, self._warn_mixed_if_divided(division))
        return _view_with_hook(tensor, lambda grad: grad * factor if division.happened_in_this_pass() else None)

    def _warn_mixed_if_divided(self, division):
        def warn_if_divided(grad):
            if division.happened_in_this_pass():
                self._warn_once("mixed", MIXED_INPUT_WARNING)
            return None

        return warn_if_divided


def _view_with_hook(tensor, hook):
    # A plain view with a tensor hook, not a custom autograd Function: the model may still
    # modify its input in place.
    view = tensor.view_as(tensor)
    view.register_hook(hook)
    return view


def _where_the_gradient_goes(node, output_nr) -> tuple:
    """(into engine outputs, elsewhere): where the gradient flowing into output ``output_nr`` of
    ``node`` ends, walking back through every input that needs a gradient and stopping at marked
    engine outputs. Breadth first, so that engine outputs near the input are met before a walk
    longer than MAX_NODES_WALKED stops, counting the rest as elsewhere."""
    into_engines = elsewhere = False
    # The set keeps the nodes' Python objects alive: their identity is the node's meanwhile.
    edges, expanded = collections.deque([(node, output_nr)]), set()
    while edges:
        node, output_nr = edges.popleft()
        marked = node.metadata.get(ENGINE_OUTPUT_MARK)
        if marked is not None:  # an engine's last op: past it lies that engine's inside
            if output_nr in marked:
                into_engines = True
            else:
                elsewhere = True  # into the engine past its outputs' division
            continue
        if node in expanded:
            continue
        if len(expanded) == MAX_NODES_WALKED:
            return into_engines, True
        expanded.add(node)
        inputs = [(parent, nr) for parent, nr in node.next_functions if parent is not None]
        if not inputs:
            elsewhere = True  # a leaf that needs a gradient
        edges.extend(inputs)
    return into_engines, elsewhere
