"""The explicit backward protocol (DeepSpeed 0.17.6): ``engine.backward`` does it all.

``engine.backward(loss)`` runs ``_backward_prologue`` (loss scaling by the
accumulation steps), ``loss.backward()`` and ``_backward_epilogue`` (the bucket
reduction) in turn. Every call is a complete backward and advances the micro step
itself (stage 1/2 in ``backward_prologue`` at the first gradient hook, stage 3 at the
end of its epilogue), so a second backward over a retained graph needs no re-arming.
There are no hooks on the forward outputs.

A plain ``loss.backward()`` (or ``engine.scale(loss).backward()``, which 0.17.6 does
not have) runs neither prologue nor epilogue: the last bucket is never reduced and the
step applies partial gradients. That path exists from DeepSpeed 0.18 on; here it is
refused with an error at the first gradient, before DeepSpeed sees it.
"""

from .engine_backward import EngineBackwardBase
from .errors import require, unsupported_feature
from .grad_window import EPILOGUE
from .patching import Patches

_PROLOGUE, _EPILOGUE = "_backward_prologue", "_backward_epilogue"


def _refuse_a_pipeline_of_several_stages(engine) -> None:
    """A pipeline's stages before the last backward through ``torch.autograd.backward`` in its
    schedule (``PipelineEngine._exec_backward_pass``) and reduce after it: a backward outside
    engine.backward, which this protocol refuses at its first gradient. Refused here, at install,
    rather than mid-schedule. (One stage backwards through engine.backward: supported.)"""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    if isinstance(engine, PipelineEngine) and getattr(engine, "num_stages", 1) > 1:
        raise unsupported_feature(
            f"a pipeline of {engine.num_stages} stages",
            "every stage but the last backwards outside engine.backward(loss), and this DeepSpeed reduces "
            "gradients only inside it (from DeepSpeed 0.18 on zero_lifetime supports such backwards)")


class ExplicitEngineBackward(EngineBackwardBase):

    supports_torch_style_backward = False

    def __init__(self, engine):
        _refuse_a_pipeline_of_several_stages(engine)
        super().__init__(engine)
        for name in (_PROLOGUE, _EPILOGUE):
            require(engine, name, "the engine backward prologue/epilogue")
        require(self.optimizer, EPILOGUE, "the ZeRO gradient epilogue")
        self._inside_engine_backward = False
        self._finished_since_forward = False

        def prologue(original, *args, **kwargs):
            self._inside_engine_backward = True
            return original(*args, **kwargs)

        def epilogue(original, *args, **kwargs):
            try:
                return original(*args, **kwargs)
            finally:
                self._inside_engine_backward = False
                self._finished_since_forward = True

        self._patches = Patches()
        self._patches.wrap(engine, _PROLOGUE, prologue)
        self._patches.wrap(engine, _EPILOGUE, epilogue)

    def backward_finished_since_forward(self) -> bool:
        """A previous engine.backward over the current forward ran to its end."""
        return self._finished_since_forward

    def note_forward(self) -> None:
        self._finished_since_forward = False

    def check_backward_entry(self) -> None:
        """Refuse a backward that accumulates gradients outside engine.backward()."""
        if not self._inside_engine_backward:
            raise unsupported_feature(
                "loss.backward() without engine.backward(loss)",
                "this DeepSpeed reduces gradients only inside engine.backward(loss) (the torch-style "
                "backward exists from DeepSpeed 0.18 on), and this backward writes gradients of this "
                "engine's params outside it (loss.backward(), or another engine's backward passing "
                "through this model); call engine.backward(loss, retain_graph=...) instead, or freeze "
                "this model's params (requires_grad_(False)) for a backward that belongs to another engine")

    def start_new_micro_step(self) -> None:
        """DeepSpeed advanced the micro step when the previous backward ended."""

    @staticmethod
    def output_hook_managers(outputs) -> list:
        return []  # no hooks on the forward outputs in this protocol

    @staticmethod
    def rearm_output_hooks(managers) -> None:
        pass

    @staticmethod
    def scale_outputs_only_when(managers, should_scale, on_divided) -> None:
        pass  # engine.backward(loss) divides the loss itself; nothing else is scaled

    @staticmethod
    def suppress_output_hooks(managers) -> None:
        pass

    def run_prologue(self) -> None:
        """engine.backward() already ran it (check_backward_entry refused any other entry)."""

    def engine_backward_running(self) -> bool:
        return self._inside_engine_backward

    @staticmethod
    def prologue_pending() -> bool:
        return False  # every backward that gets this far runs inside engine.backward

    @staticmethod
    def note_output_hooks_ran(on_ran):
        """There are no hooks on the forward outputs: engine.backward(loss) divides the loss."""
        return Patches()  # nothing patched

    def reset_after_failed_backward(self) -> None:
        """An exception inside loss.backward() skipped the epilogue."""
        self._inside_engine_backward = False

    def restore(self) -> None:
        self._patches.undo()
