"""TRL (1.16) on installed engines: its generation context around a ZeRO-3 step with two
backwards, and its GRPO trainer, whose fused LM head reads ZeRO-3 attributes in its backward.

TRL's ``unwrap_model_for_generation`` (GRPO, PPO, online DPO, GKD) gathers the whole model,
removes DeepSpeed's module hooks for the generation and registers them again after it, every
step. DeepSpeed's new hooks then ran after the ones zero_lifetime registered at install: the
hook that opens each backward sat on the root's output before DeepSpeed wrapped it, so each
backward was opened after DeepSpeed's backward hooks had started. Of the step's two backwards
only the second's gradients were kept, silently (``engine.backward``), or DeepSpeed never took
the second's (``loss.backward()``: step() failed). Installed, ours are registered again behind
DeepSpeed's before the next forward. Against plain torch: the same tiny GPT-2 generating
greedily, the same two losses backwarded in turn, SGD.

TRL's GRPO trainer scores completions with a chunked log-prob autograd Function whose backward
reads ``ds_status`` off the LM head weight it saved; under zero_lifetime's saved-tensor hooks
that is a new tensor object without it, and the first backward failed with AttributeError
(``zero_lifetime/integrations/trl_fused_head.py``). Installed, GRPO trains as stock GRPO.
"""

import contextlib
import copy
import gc
import os
import sys

import pytest
import torch

pytest.importorskip("trl")  # installed by scripts/setup_env.sh

import trl.trainer.utils  # noqa: E402
from trl.models.utils import unwrap_model_for_generation  # noqa: E402

import zero_lifetime  # noqa: E402
from harness import BACKWARD_PATHS, backward_by, full_weights, make_input, make_pair  # noqa: E402
from test_hf_trainer import _model, second_loss  # noqa: E402
from zero_lifetime.integrations.hf_trainer import add_to_trainer  # noqa: E402

STEPS, LR, NEW_TOKENS = 3, 0.05, 4


def _prompts(step):
    return torch.randint(1, 50, (2, 4), generator=torch.Generator().manual_seed(step))


def _generate(model, prompts):
    with torch.no_grad():
        return model.generate(prompts, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0)


def _accelerated_engine(model, stage):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    engine, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    return accelerator, engine


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "hooked"])
@pytest.mark.parametrize("policy", ["regather", "pin"])
@pytest.mark.parametrize("path", BACKWARD_PATHS)
def test_generation_then_two_backwards_match_torch(path, policy, gather):
    """Per step: generate in TRL's context, forward the completions, backward the language-model
    loss (graph retained) by ``path``, then a penalty on the logits through accelerate, step.
    ``gather`` False: TRL's ``ds3_gather_for_generation=False``, the generation runs through
    DeepSpeed's hooks, which stay registered."""
    reference = _model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    accelerator, engine = _accelerated_engine(copy.deepcopy(reference), 3)
    installation = zero_lifetime.install(engine, policy=policy)
    for step in range(STEPS):
        with unwrap_model_for_generation(engine, accelerator, gather_deepspeed3_params=gather) as unwrapped:
            completions = _generate(unwrapped, _prompts(step))
        want_completions = _generate(reference, _prompts(step))
        assert torch.equal(completions, want_completions), step

        out = engine(input_ids=completions, labels=completions)
        backward_by(engine, out.loss, path, retain_graph=True)
        accelerator.backward(second_loss(out.logits))  # accelerate's: backward, then engine.step()

        out = reference(input_ids=completions, labels=completions)
        out.loss.backward(retain_graph=True)
        second_loss(out.logits).backward()
        optimizer.step()
        optimizer.zero_grad()
    # Gathered: seen twice a step, DeepSpeed's hooks removed (by the generation's forwards),
    # then registered anew.
    assert installation.module_hooks.registered_again == (2 * STEPS if gather else 0)
    for (name, want), got in zip(reference.named_parameters(), full_weights(engine)):
        torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=1e-5, msg=name)
    moved = max((want.detach() - start).abs().max().item()
                for want, start in zip(reference.parameters(), _model().parameters()))
    assert moved > 1e-3, moved  # it trained
    engine.destroy()


class _GrpoData:
    """Prompts of a word-level vocabulary made in memory (no download), and a reward."""

    def __init__(self):
        from datasets import Dataset
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        vocab = {**{f"w{i}": i for i in range(48)}, "<pad>": 48, "<eos>": 49}
        words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
        words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        self.tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>",
                                                 padding_side="left")
        self.prompts = Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5 w6", "w7 w8 w9", "w10 w11 w12"]})

    @staticmethod
    def reward(completions, **_):
        return [float(len(completion) % 7) for completion in completions]


def _grpo_run(tmp_path, data, install: bool):
    """Three GRPO steps (two completions per prompt, sampled) on ZeRO-3; the weights after."""
    from trl import GRPOConfig, GRPOTrainer
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, max_steps=STEPS, deepspeed=ds, use_cpu=True, report_to=[],
                      save_strategy="no", learning_rate=LR, optim="sgd", lr_scheduler_type="constant",
                      max_grad_norm=0.0, logging_strategy="no", disable_tqdm=True, seed=0)
    model = _model()
    model.config.pad_token_id, model.config.eos_token_id = 48, 49
    trainer = GRPOTrainer(model=model, reward_funcs=data.reward, args=args, train_dataset=data.prompts,
                          processing_class=data.tokenizer)
    callback = add_to_trainer(trainer) if install else None
    trainer.train()
    weights = full_weights(trainer.model_wrapped)
    if install:
        assert callback.installation is not None
        assert callback.installation.module_hooks.registered_again == 2 * STEPS  # generated in TRL's context
    trainer.accelerator.free_memory()  # destroys the engine: installed, TRL's function is put back
    return weights


def test_grpo_trainer_installed_matches_stock(tmp_path):
    original = trl.trainer.utils.maybe_gather_lm_head_ctx
    data = _GrpoData()
    want = _grpo_run(tmp_path / "stock", data, install=False)
    got = _grpo_run(tmp_path / "installed", data, install=True)
    assert trl.trainer.utils.maybe_gather_lm_head_ctx is original
    for index, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5, msg=f"param {index}")
    moved = max((w - start.detach()).abs().max().item() for w, start in zip(want, _model().parameters()))
    assert moved > 1e-3, moved  # it trained


@pytest.fixture
def no_other_holds():
    """Other tests' installations may outlive their engines: DeepSpeed keeps a ZeRO-3 model alive
    after its engine is gone, the installation's hooks on it keep the installation, and
    test_lifetime_programs freezes its installed engines out of garbage collection. Their holds
    on the patch are let go here, so the patch's lifetime is these tests' engines'."""
    from zero_lifetime.integrations.trl_fused_head import TrlFusedHead
    gc.unfreeze()  # frozen objects are neither collected nor listed by gc.get_objects()
    gc.collect()
    for hold in [o for o in gc.get_objects() if isinstance(o, TrlFusedHead)]:
        hold.release()
    gc.freeze()  # as they were: out of later collections


def _recording_gather(calls):

    def maybe_gather_lm_head_ctx(*params):  # TRL's signature
        calls.append(params)
        return contextlib.nullcontext()

    return maybe_gather_lm_head_ctx


def test_fused_head_gathers_only_zero3_params_while_an_installed_zero3_engine_lives(monkeypatch,
                                                                                    no_other_holds):
    """TRL's function sees the ZeRO-3 params it is given (and None, as TRL passes a missing bias)
    but not a tensor without ds_status; ZeRO-2 installs patch nothing; the last ZeRO-3 engine
    uninstalled puts TRL's function back."""
    calls = []
    original = _recording_gather(calls)
    monkeypatch.setattr(trl.trainer.utils, "maybe_gather_lm_head_ctx", original)
    zero2, *_ = make_pair("mlp_norm", 2)
    zero_lifetime.install(zero2)
    assert trl.trainer.utils.maybe_gather_lm_head_ctx is original
    first, *_ = make_pair("mlp_norm", 3)
    second, *_ = make_pair("mlp_norm", 3)
    zero_lifetime.install(first)
    zero_lifetime.install(second)
    patched = trl.trainer.utils.maybe_gather_lm_head_ctx
    assert patched is not original
    weight = first.module.l1.weight
    with patched(torch.zeros(3), weight, None):
        pass
    assert calls == [(weight, None)]
    zero_lifetime.uninstall(first)
    assert trl.trainer.utils.maybe_gather_lm_head_ctx is patched  # the second still needs it
    second.destroy()
    assert trl.trainer.utils.maybe_gather_lm_head_ctx is original
    zero_lifetime.uninstall(zero2)
    first.destroy()


def test_fused_head_patched_at_the_first_forward_when_trl_comes_after_install(monkeypatch, no_other_holds):
    calls = []
    original = _recording_gather(calls)
    monkeypatch.setattr(trl.trainer.utils, "maybe_gather_lm_head_ctx", original)
    module = sys.modules.pop("trl.trainer.utils")
    try:
        engine, *_ = make_pair("mlp_norm", 3)
        zero_lifetime.install(engine)
    finally:
        sys.modules["trl.trainer.utils"] = module
    assert trl.trainer.utils.maybe_gather_lm_head_ctx is original
    engine(make_input("mlp_norm", 0))
    assert trl.trainer.utils.maybe_gather_lm_head_ctx is not original
    engine.destroy()
    assert trl.trainer.utils.maybe_gather_lm_head_ctx is original


def test_fused_head_of_another_shape_is_left_alone_with_a_warning(monkeypatch, no_other_holds):
    def maybe_gather_lm_head_ctx(weight, bias=None):  # not TRL 1.16's (*params)
        return contextlib.nullcontext()

    monkeypatch.setattr(trl.trainer.utils, "maybe_gather_lm_head_ctx", maybe_gather_lm_head_ctx)
    engine, *_ = make_pair("mlp_norm", 3)
    with pytest.warns(RuntimeWarning, match="no attribute 'ds_status'"):
        zero_lifetime.install(engine)
    assert trl.trainer.utils.maybe_gather_lm_head_ctx is maybe_gather_lm_head_ctx
    engine.destroy()


def test_fused_head_hold_of_an_installation_gone_without_uninstall_is_let_go(monkeypatch, no_other_holds):
    """A hold whose installation was dropped without destroy() or uninstall() ends with it."""
    from zero_lifetime.integrations.trl_fused_head import TrlFusedHead
    original = _recording_gather([])
    monkeypatch.setattr(trl.trainer.utils, "maybe_gather_lm_head_ctx", original)
    hold = TrlFusedHead()
    hold.settle_if_trl_imported()
    assert trl.trainer.utils.maybe_gather_lm_head_ctx is not original
    del hold
    gc.collect()
    assert trl.trainer.utils.maybe_gather_lm_head_ctx is original
