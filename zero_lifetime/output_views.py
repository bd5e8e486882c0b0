"""An engine's outputs divided by gradient accumulation once, not once per output the
gradient passes.

DeepSpeed 0.18.9 and 0.19.8 divide the gradient arriving at each forward output by
gradient_accumulation_steps, with a hook on the output tensor (on the torch-style
``loss.backward()`` path; stock 0.18.9's ``engine.backward(loss)`` too). On ZeRO-1/2 the outputs are
the model's own tensors, so when the model computed one output from another (every transformers
model: ``loss`` from the ``logits`` it returns beside it), the loss's gradient, divided at the
loss, reaches the logits inside the model and is divided there again: with GAS 2 the model
trains on a quarter of the loss's gradient instead of a half, silently (DeepSpeed #7718). ZeRO-3
returns fresh tensors made after the model, which the model never used, and is right.

Installed, each output that DeepSpeed hooked is returned as a view carrying its hooks: the
model's own use of the output is not divided, what the caller's loss sends through it is, once.
"""

import warnings

from .tensor_containers import replace_tensors, tensors_in


class OutputViews:

    def __init__(self, output_hooks):
        self._output_hooks = output_hooks  # the adapter's: DeepSpeed's hooks on one forward's outputs
        self._warned = False

    def divided_at_views(self, output, managers, opens_backward):
        """``output`` with each tensor DeepSpeed's ``managers`` hooked replaced by a view
        carrying those hooks, after ``opens_backward`` (the installation's own output hook)."""
        hooks = self._output_hooks(managers)
        views = {}  # id(view): the output it views, until the view is known to be returned

        def view_of(tensor):
            if not hooks.on(tensor):
                return tensor
            view = tensor.view_as(tensor)
            # Ours first on the view, as on the output: the backward is opened (DeepSpeed's
            # prologue armed or suppressed) before DeepSpeed's hook runs the prologue and divides.
            view.register_hook(opens_backward)
            views[id(view)] = (tensor, view)
            return view

        result = replace_tensors(output, view_of, lambda container, exc: None)
        # Only now, and only onto views in the result: in a container that could not be
        # copied, the outputs keep their hooks (and their gradient is divided, as in stock).
        for tensor in tensors_in(result):
            returned = views.pop(id(tensor), None)
            if returned is not None:
                hooks.move_one(*returned)
        if hooks.left_behind() and hooks.registered() > 1 and not self._warned:
            self._warned = True
            warnings.warn(
                "zero_lifetime: could not copy a container in this engine's output to return views of the "
                "outputs in it. With gradient accumulation on the torch-style path, where an output was "
                "computed from another output (a loss from the logits returned beside it), or one tensor is "
                "returned twice, its gradient is divided by gradient_accumulation_steps twice, as in stock "
                "DeepSpeed. Return tensors in lists, tuples or dicts (a transformers ModelOutput is one).",
                RuntimeWarning, stacklevel=3)
        return result
