"""Hugging Face Trainer: install zero_lifetime on the DeepSpeed engine the Trainer creates.

    from zero_lifetime.integrations.hf_trainer import add_to_trainer
    trainer = Trainer(model=model, args=TrainingArguments(..., deepspeed=ds_config), ...)
    add_to_trainer(trainer, policy="regather")   # or a "zero_lifetime" section in ds_config
    trainer.train()

The Trainer builds its DeepSpeed engine inside train(), so the callback installs at
on_train_begin, once the engine exists.
"""

from transformers import TrainerCallback

import zero_lifetime


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
        return control


def add_to_trainer(trainer, **install_kwargs) -> ZeroLifetimeCallback:
    callback = ZeroLifetimeCallback(trainer, **install_kwargs)
    trainer.add_callback(callback)
    return callback
