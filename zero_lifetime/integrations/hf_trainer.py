"""Hugging Face Trainer: install zero_lifetime on the DeepSpeed engine the Trainer creates.

    from zero_lifetime.integrations.hf_trainer import add_to_trainer
    trainer = Trainer(model=model, args=TrainingArguments(..., deepspeed=ds_config), ...)
    add_to_trainer(trainer, policy="regather")   # or a "zero_lifetime" section in ds_config
    trainer.train()

The Trainer builds its DeepSpeed engine inside train(), so the callback installs at
on_train_begin, once the engine exists.

With gradient accumulation, accelerate tells DeepSpeed whether a backward closes the window
(``set_gradient_accumulation_boundary``) only inside its own ``backward()``, just before its
backward. A backward the training step runs before that one (``engine.backward(loss,
retain_graph=True)`` or ``loss.backward(retain_graph=True)``, then ``accelerator.backward(...)``)
ran with what the previous window's last backward left, True: ZeRO-1/2 closed the window at the
first micro step and lost its first loss, silently. The callback sets the flag for the first
micro step of each window as accelerate would; later micro steps find accelerate's own.
"""

from transformers import TrainerCallback

import zero_lifetime
from zero_lifetime.adapters.engine_boundary import boundary_set_by_hand


def deepspeed_engine_of(trainer):
    """The DeepSpeedEngine a Trainer trains with, or None."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    for candidate in (getattr(trainer, "model_wrapped", None),
                      getattr(getattr(getattr(trainer, "accelerator", None), "deepspeed_engine_wrapped", None),
                              "engine", None)):
        if isinstance(candidate, DeepSpeedEngine):
            return candidate
    return None


class ZeroLifetimeCallback(TrainerCallback):
    """Installs zero_lifetime when training begins; keyword arguments go to install()."""

    def __init__(self, trainer=None, **install_kwargs):
        self.trainer = trainer
        self.install_kwargs = install_kwargs
        self.installation = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise RuntimeError("ZeroLifetimeCallback needs its Trainer: use add_to_trainer(trainer), or "
                               "ZeroLifetimeCallback(trainer) and trainer.add_callback(...)")
        engine = deepspeed_engine_of(self.trainer)
        if engine is None:
            raise RuntimeError("zero_lifetime: this Trainer does not train with DeepSpeed (no DeepSpeedEngine "
                               "at on_train_begin); pass TrainingArguments(deepspeed=<config>)")
        self.installation = zero_lifetime.install(engine, **self.install_kwargs)
        boundary_set_by_hand(engine)  # probed now: a DeepSpeed without the name fails here, clearly
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        engine = deepspeed_engine_of(self.trainer)
        # Only once accelerate sets the flag itself: else DeepSpeed counts micro steps, and a
        # flag set here would stay for the whole window.
        if self.installation is not None and engine is not None and boundary_set_by_hand(engine):
            engine.set_gradient_accumulation_boundary(self.trainer.accelerator.sync_gradients)
        return control


def add_to_trainer(trainer, **install_kwargs) -> ZeroLifetimeCallback:
    callback = ZeroLifetimeCallback(trainer, **install_kwargs)
    trainer.add_callback(callback)
    return callback
