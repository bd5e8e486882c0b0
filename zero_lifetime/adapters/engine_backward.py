"""The engine's per-backward state: which DeepSpeed backward protocol this engine runs.

Two protocols exist among the supported releases, told apart by probing:

* hooked (0.19.8 and 0.18.9, ``engine_backward_hooked``): the prologue runs from hooks on the
  forward outputs and the epilogue from a queued autograd callback, so a plain
  ``loss.backward()`` works; a second backward over a retained graph gets neither
  unless they are re-armed, and the micro step advances only at the next forward.
* explicit (0.17.6, ``engine_backward_explicit``): ``engine.backward(loss)`` runs the
  prologue, ``loss.backward()`` and the epilogue in turn; every such call is a whole
  backward and advances the micro step itself. ``loss.backward()`` alone runs no
  epilogue: DeepSpeed never reduces the last bucket.
"""

import torch

from .errors import require
from .zero12_ready_buffers import Zero12ReadyBuffers


class EngineBackwardBase:
    """What both protocols do the same way."""

    def __init__(self, engine):
        self.engine = engine
        self.optimizer = engine.optimizer
        require(self.optimizer, "micro_step_id", "the ZeRO micro-step counter")
        self._zero12 = int(engine.zero_optimization_stage()) in (1, 2)
        self._buckets_ready_at_start = False
        self._ready_buffers = Zero12ReadyBuffers(self.optimizer) if self._zero12 else None
        if not hasattr(torch._C, "_current_graph_task_id"):
            raise RuntimeError("zero_lifetime needs torch._C._current_graph_task_id (torch >= 2.1)")

    def engine_backward(self, original, loss, *args, **kwargs):
        """Call DeepSpeed's engine.backward (``original``) as this release should run it."""
        return original(loss, *args, **kwargs)

    def clear_reduced_grads(self) -> None:
        """Start the next backward from zero: ZeRO-3 resets its micro step (copy, not add)."""
        self.optimizer.zero_grad()

    def note_backward_start(self) -> None:
        """Before DeepSpeed's first hook of a backward that accumulates."""
        # ZeRO-1 at GAS > 1 leaves its buckets ready from one micro-step to the next (it
        # releases them in the closing epilogue only): a backward that finds them ready did
        # not advance the micro step.
        self._buckets_ready_at_start = self._zero12 and self._ready_buffers.ready()

    def discard_interrupted_reduction(self, keep_param_grads: bool = False) -> None:
        """Drop the gradients an interrupted backward left in the reduction buckets.

        Otherwise the next backward adds the same params to a bucket again (ZeRO-3
        asserts on the duplicates) and the failed step's partial gradients leak into it.
        ``keep_param_grads``: leave param.grad (and DeepSpeed's grad_accum) as they are, where
        they hold what the window summed (see zero1_window_sums).
        """
        optimizer = self.optimizer
        for bucket in getattr(optimizer, "ipg_buckets", {}).values():
            if self._zero12:
                # What DeepSpeed runs after each reduction: on 0.19.8 it also drops the
                # MoE flag and the ready events and copy streams of the dead fill.
                bucket.clear()
            elif hasattr(bucket, "clear_params"):  # ZeRO-3: keep the buffer for reuse
                bucket.clear_params()
            else:  # ZeRO-3 on 0.17.6, as its own reduction resets the bucket
                bucket.params.clear()
                bucket.elements = 0
        # ZeRO-1/2 keep an oversized gradient in a slot of its own until the next reduction;
        # left there, that reduction asserts it is the bucket's only param and fails.
        oversized = getattr(optimizer, "extra_large_param_to_reduce", None)
        if isinstance(oversized, dict):
            oversized.clear()
        reduced = getattr(optimizer, "params_already_reduced", None)
        if isinstance(reduced, dict):
            for key in reduced:
                reduced[key] = False
        elif isinstance(reduced, list):
            reduced[:] = [False] * len(reduced)
        # Drop param.grad ourselves first: ZeRO-3's zero_grad() calls record_stream on
        # a leftover grad, which fails on the CPU accelerator ("unknown parameter type").
        if not keep_param_grads:
            for param in self.engine.module.parameters():
                param.grad = None
        # The next backward takes the dead one's micro step: ZeRO-3's zero_grad() would
        # restart the count (the next backward would overwrite what the earlier ones summed).
        micro_step_id = optimizer.micro_step_id
        if self._zero12 and self._ready_buffers.ready() and not self._buckets_ready_at_start:
            # The dead backward advanced the count when its first gradient came, and its
            # partition buffer is half written (the next backward would run past its end);
            # the epilogue it never reached releases both. (Buckets an earlier micro-step
            # readied stay: that window goes on, or is refused until zero_grad() releases them.)
            micro_step_id -= 1
            self._ready_buffers.release()
        if not keep_param_grads:
            optimizer.zero_grad()
        optimizer.micro_step_id = micro_step_id


def make_engine_backward(engine):
    """The adapter for the backward protocol the installed DeepSpeed runs."""
    if hasattr(engine.optimizer, "_backward_hook_state"):
        from .engine_backward_hooked import HookedEngineBackward
        return HookedEngineBackward(engine)
    from .engine_backward_explicit import ExplicitEngineBackward
    return ExplicitEngineBackward(engine)
