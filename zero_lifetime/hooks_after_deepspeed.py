"""Module hooks of ours that must run after DeepSpeed's hooks on the same module.

Torch runs a module's hooks in registration order. ZeRO-3 registers its own at
deepspeed.initialize, so ours, registered at install, run after them: a module's params are
gathered before we note where they live, and the root's output already carries DeepSpeed's
backward function when we put on it the hook that opens each backward before any of
DeepSpeed's backward hooks runs. Where DeepSpeed's hooks are registered again (TRL's generation
context does it every step) they would run after ours: each backward was opened after
DeepSpeed's had started, and of two backwards over one forward only the second's gradients
were kept, silently. So ours are registered again behind them, checked before every forward
of the root.
"""

from .never_traced import never_traced


class HooksAfterDeepSpeed:
    """``deepspeed_hooks``: the adapter that tells when DeepSpeed registered its module hooks
    again (``adapters.zero3_module_hooks``), or None where it registers none (ZeRO-1/2)."""

    def __init__(self, root_module, deepspeed_hooks=None):
        self._deepspeed_hooks = deepspeed_hooks
        self._registrations = []  # (register method, hook), in registration order
        self._handles = []
        self.registered_again = 0  # times ours were moved behind DeepSpeed's
        self._check_handle = None
        if deepspeed_hooks is not None:
            # Ahead of every other hook of the root (DeepSpeed appends its own): also for a
            # forward that bypasses engine.forward (engine.module(x)).
            self._check_handle = root_module.register_forward_pre_hook(
                never_traced(lambda _module, _inputs: self.keep_after_deepspeeds()), prepend=True)

    def forward_hook(self, module, hook) -> None:
        self._register(module.register_forward_hook, hook)

    def forward_pre_hook(self, module, hook) -> None:
        self._register(module.register_forward_pre_hook, hook)

    def _register(self, register, hook) -> None:
        self._registrations.append((register, hook))
        self._handles.append(register(hook))

    def keep_after_deepspeeds(self) -> None:
        """Register ours again when DeepSpeed registered its hooks since the last check.

        The root's own pre-forward hooks of a forward already running are not reordered: the
        one forward that finds the change through the root's check (not engine.forward's)
        notes the root's own params before they are gathered (only raw aliases of them need it)."""
        if self._deepspeed_hooks is not None and self._deepspeed_hooks.registered_anew():
            self._remove_ours()
            self._handles = [register(hook) for register, hook in self._registrations]
            self.registered_again += 1

    def _remove_ours(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def remove(self) -> None:
        self._remove_ours()
        self._registrations.clear()
        if self._check_handle is not None:
            self._check_handle.remove()
            self._check_handle = None
