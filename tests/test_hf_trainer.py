"""Hugging Face Trainer + DeepSpeed ZeRO-3 + zero_lifetime, on the CPU, with a tiny GPT-2
built from a config (no download). A Trainer whose training step backwards two losses over
one forward (retain_graph) fails on stock ZeRO-3; with the callback it trains exactly like
the same Trainer backwarding the summed loss once on stock DeepSpeed (torch semantics: two
backwards without zero_grad sum their gradients)."""

import gc
import os
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")  # installed by scripts/setup_env.sh

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import zero_lifetime  # noqa: E402
from harness import TORCH_STYLE_BACKWARD, graph_has_compiled_code  # noqa: E402
from zero_lifetime.integrations.hf_trainer import ZeroLifetimeCallback, add_to_trainer  # noqa: E402

STEPS, LR = 3, 0.05


class Tokens(torch.utils.data.Dataset):

    def __len__(self):
        return 4  # one batch: the same data every step, whatever the sampler's order

    def __getitem__(self, i):
        tokens = torch.randint(0, 50, (8, ), generator=torch.Generator().manual_seed(i))
        return {"input_ids": tokens, "labels": tokens}


def second_loss(logits):
    return logits.float().pow(2).mean()


class TwoLossTrainer(Trainer):
    """Language-model loss plus a penalty on the logits, as two backwards of one forward."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        out = model(**inputs)
        self.steps_run = getattr(self, "steps_run", 0) + 1
        self.compiled_steps = getattr(self, "compiled_steps", 0) + graph_has_compiled_code(out.loss)
        engine = self.model_wrapped
        engine.backward(out.loss, retain_graph=True)
        self.accelerator.backward(second_loss(out.logits))  # accelerate's: backward, then engine.step()
        return out.loss.detach()


def _model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


def _trainer(model, tmp_path, compile_backend=None, stage=3, **overrides):
    """``compile_backend``: TrainingArguments' torch_compile, which accelerate turns into
    ``engine.compile()`` after deepspeed.initialize (the callback installs after that).
    ``overrides``: other TrainingArguments."""
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    # gradient_clipping "auto": the Trainer's max_grad_norm (DeepSpeed's own default is 0.0 up
    # to 0.18.9 and 1.0 in 0.19.8).
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
          "zero_allow_untested_optimizer": True}
    arguments = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=STEPS, deepspeed=ds,
                     use_cpu=True, report_to=[], save_strategy="no", optim="sgd", learning_rate=LR,
                     lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, disable_tqdm=True,
                     logging_strategy="no", torch_compile=compile_backend is not None,
                     torch_compile_backend=compile_backend)
    args = TrainingArguments(**{**arguments, **overrides})
    return TwoLossTrainer(model=model, args=args, train_dataset=Tokens())


class SummedLossTrainer(Trainer):
    """The oracle: one backward of the summed losses, which stock ZeRO-3 handles."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        out = model(**inputs)
        self.accelerator.backward(out.loss + second_loss(out.logits))
        return out.loss.detach()


def _weights(trainer):
    from deepspeed.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in trainer.model_wrapped.module.named_parameters()}


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"], ids=["eager", "torch_compile"])
def test_trainer_with_callback_matches_summed_loss(tmp_path, compile_backend):
    # AOTAutograd may reuse ("donate") saved activations in a compiled backward, which then
    # refuses retain_graph=True, stock DeepSpeed included: turned off, as the README says.
    with torch._functorch.config.patch(donated_buffer=False):
        _trainer_matches_summed_loss(tmp_path, compile_backend)


def _trainer_matches_summed_loss(tmp_path, compile_backend):
    torch._dynamo.reset()  # compiled code is cached per code object: compile anew
    oracle = _trainer(_model(), tmp_path / "oracle", compile_backend)
    oracle.__class__ = SummedLossTrainer
    oracle.train()
    want = _weights(oracle)

    torch._dynamo.reset()
    trainer = _trainer(_model(), tmp_path / "two", compile_backend)
    callback = add_to_trainer(trainer)
    trainer.train()
    assert callback.installation is not None
    assert trainer.compiled_steps == (STEPS if compile_backend else 0)  # compiled code saved tensors each step
    assert zero_lifetime.stats(trainer.model_wrapped)["pinned_params"] == 0
    got = _weights(trainer)
    initial = {n: p.detach() for n, p in _model().named_parameters()}
    assert max((want[n] - initial[n]).abs().max().item() for n in want) > 1e-3  # it trained
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("stage", [2, 3])
def test_stock_summed_loss_oracle_matches_plain_torch(tmp_path, stage):
    """The oracle the Trainer tests compare with, against plain torch: the same model, the four
    sequences as one batch, the summed loss, SGD."""
    oracle = _trainer(_model(), tmp_path / "oracle", stage=stage)
    oracle.__class__ = SummedLossTrainer
    oracle.train()
    got = _weights(oracle)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batch = {key: torch.stack([Tokens()[i][key] for i in range(len(Tokens()))]) for key in ("input_ids", "labels")}
    for _ in range(STEPS):
        out = model(**batch)
        (out.loss + second_loss(out.logits)).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.detach(), atol=1e-6, rtol=1e-5, msg=name)


def test_stock_trainer_fails_on_the_second_backward(tmp_path):
    """Negative control: the same Trainer without the callback."""
    trainer = _trainer(_model(), tmp_path)
    # The released (empty) params reach the second backward; the op that notices names it.
    with pytest.raises(RuntimeError, match=r"size of tensor a \(0\)|weight of shape \[0\]"):
        trainer.train()


def _train_twice_with_model_init(trainer, install: bool):
    """Two train() calls of a Trainer with model_init (a hyperparameter search runs one per
    trial): each builds a new model and engine, and accelerate destroys the previous engine
    first. Returns a weak reference to the first run's model, after the second run."""
    trainer.model_init = lambda trial=None: _model()
    if install:
        add_to_trainer(trainer)
    trainer.train()
    first = weakref.ref(trainer.model)
    trainer.train()
    assert trainer.model is not first()
    gc.collect()
    return first


def test_model_init_trainer_frees_each_destroyed_engine(tmp_path):
    """Stock ZeRO-3 keeps the destroyed engine's model alive for the rest of the process
    (DeepSpeed's module stack; adapters/zero3_teardown); installed, it is freed. The second
    run, installed on the second engine, trains like the summed-loss oracle."""
    oracle = _trainer(_model(), tmp_path / "oracle")
    oracle.__class__ = SummedLossTrainer
    stock_first = _train_twice_with_model_init(oracle, install=False)
    trainer = _trainer(_model(), tmp_path / "two")
    first = _train_twice_with_model_init(trainer, install=True)
    assert first() is None, "the first run's model outlived its destroyed engine"
    assert stock_first() is not None  # as documented; if DeepSpeed frees it, the docs and this line go
    want, got = _weights(oracle), _weights(trainer)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)


def _assert_installed_gas_run_matches_one_large_batch(tmp_path, stage, trainer_class, gas, **overrides):
    """``trainer_class`` installed, GAS ``gas`` over 4 // gas sequences per micro step, against
    the stock summed-loss Trainer at GAS 1 over all 4 (the same sequences, of equal length: the
    same mean loss). ``overrides``: other TrainingArguments of both."""
    oracle = _trainer(_model(), tmp_path / "oracle", stage=stage, **overrides)
    oracle.__class__ = SummedLossTrainer
    oracle.train()
    want = _weights(oracle)
    trainer = _trainer(_model(), tmp_path / "gas", stage=stage, gradient_accumulation_steps=gas,
                       per_device_train_batch_size=4 // gas, **overrides)
    trainer.__class__ = trainer_class
    add_to_trainer(trainer)
    trainer.train()
    got = _weights(trainer)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)
    return trainer


class TorchStyleSummedLossTrainer(Trainer):
    """The summed loss through ``loss.backward()`` (DeepSpeed's torch-style path), with the
    window boundary and the step done as accelerate's backward would."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        out = model(**inputs)
        self.model_wrapped.set_gradient_accumulation_boundary(self.accelerator.sync_gradients)
        (out.loss + second_loss(out.logits)).backward()
        if self.accelerator.sync_gradients:
            self.model_wrapped.step()
        return out.loss.detach()


@pytest.mark.parametrize("trainer_class", [SummedLossTrainer, TorchStyleSummedLossTrainer],
                         ids=["accelerate_backward", "loss_backward"])
@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_accumulation_matches_one_large_batch(tmp_path, stage, trainer_class):
    """GAS 2 of 2 sequences against GAS 1 of all 4 (same token count per sequence: the same
    mean), installed. The model returns its loss and the logits it computed it from, which
    stock ZeRO-2 divided by GAS twice: on 0.18.9 through accelerate too, on 0.19.8 through
    ``loss.backward()`` (test_output_division has the mechanism against torch)."""
    if trainer_class is TorchStyleSummedLossTrainer and not TORCH_STYLE_BACKWARD:
        pytest.skip("loss.backward() reduces nothing on this DeepSpeed")
    _assert_installed_gas_run_matches_one_large_batch(tmp_path, stage, trainer_class, gas=2)


class TorchStyleTwoLossTrainer(Trainer):
    """TwoLossTrainer with the first loss through ``loss.backward(retain_graph=True)``."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        out = model(**inputs)
        out.loss.backward(retain_graph=True)
        self.accelerator.backward(second_loss(out.logits))
        return out.loss.detach()


@pytest.mark.parametrize("gas", [2, 4])
@pytest.mark.parametrize("trainer_class", [TwoLossTrainer, TorchStyleTwoLossTrainer],
                         ids=["engine_backward", "loss_backward"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_losses_with_gradient_accumulation_match_one_large_batch(tmp_path, stage, trainer_class, gas):
    """A training step that backwards its first loss itself, then the second through
    accelerate, with GAS 2 and 4 against GAS 1 over the same sequences (stock, summed loss).
    accelerate sets DeepSpeed's window boundary only inside its own backward: the first loss of
    each window ran with the previous window's True, and ZeRO-2 dropped it (0.0070 off after
    three steps at GAS 2): installed, a step that closes a window leaves the flag False
    (tests/test_accumulation_boundary_by_hand.py)."""
    if trainer_class is TorchStyleTwoLossTrainer and not TORCH_STYLE_BACKWARD:
        pytest.skip("loss.backward() reduces nothing on this DeepSpeed")
    _assert_installed_gas_run_matches_one_large_batch(tmp_path, stage, trainer_class, gas)


# AdamW, a decaying learning rate, weight decay and clipping: the optimizer, scheduler and
# scaler state a checkpoint must carry. A large epsilon: the key bias gets no gradient in
# theory, and Adam would turn its rounding noise into full steps that differ between runs.
CHECKPOINTED = dict(max_steps=4, save_strategy="steps", save_steps=2, optim="adamw_torch", learning_rate=0.01,
                    lr_scheduler_type="linear", max_grad_norm=1.0, weight_decay=0.01, adam_epsilon=1e-4)


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_resumed_from_a_checkpoint_matches_an_uninterrupted_run(tmp_path, stage):
    """A run saves checkpoints with zero_lifetime installed; a new Trainer resumes from the
    half-way one and installs again (after the Trainer loaded it). Both end where the stock
    summed-loss oracle does, uninterrupted."""
    oracle = _trainer(_model(), tmp_path / "oracle", stage=stage, **CHECKPOINTED)
    oracle.__class__ = SummedLossTrainer
    oracle.train()
    want = _weights(oracle)
    first = _trainer(_model(), tmp_path / "run", stage=stage, **CHECKPOINTED)
    add_to_trainer(first)
    first.train()
    resumed = _trainer(_model(), tmp_path / "run", stage=stage, **CHECKPOINTED)
    callback = add_to_trainer(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert callback.installation is not None
    assert (first.steps_run, resumed.steps_run, resumed.state.global_step) == (4, 2, 4)
    initial = {n: p.detach() for n, p in _model().named_parameters()}
    assert max((want[n] - initial[n]).abs().max().item() for n in want) > 1e-3  # it trained
    for run, got in (("first", _weights(first)), ("resumed", _weights(resumed))):
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=f"{run}: {name}")


def test_callback_without_deepspeed_says_so(tmp_path):
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=_model(), args=args, train_dataset=Tokens())
    trainer.add_callback(ZeroLifetimeCallback(trainer))
    with pytest.raises(RuntimeError, match="does not train with DeepSpeed"):
        trainer.train()


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("stage", [2, 3])
def test_two_losses_under_activation_checkpointing_match_one_large_batch(tmp_path, stage, reentrant):
    """TrainingArguments' activation (gradient) checkpointing, which the Trainer turns on in the
    model: each layer recomputed inside each backward, GAS 2 (as above; the oracle at GAS 1,
    since stock ZeRO-2 on 0.18.9 divides the summed loss by GAS twice at GAS 2)."""
    name = "activation_checkpointing" if hasattr(TrainingArguments, "activation_checkpointing") else \
        "gradient_checkpointing"  # before transformers 5.24
    trainer = _assert_installed_gas_run_matches_one_large_batch(
        tmp_path, stage, TwoLossTrainer, 2, **{name: True, f"{name}_kwargs": {"use_reentrant": reentrant}})
    assert trainer.model_wrapped.module.is_gradient_checkpointing
