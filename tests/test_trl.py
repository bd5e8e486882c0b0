"""TRL (1.16) on installed engines: its generation context around a ZeRO-3 step with two
backwards.

TRL's ``unwrap_model_for_generation`` (GRPO, PPO, online DPO, GKD) gathers the whole model,
removes DeepSpeed's module hooks for the generation and registers them again after it, every
step. DeepSpeed's new hooks then ran after the ones zero_lifetime registered at install: the
hook that opens each backward sat on the root's output before DeepSpeed wrapped it, so each
backward was opened after DeepSpeed's backward hooks had started. Of the step's two backwards
only the second's gradients were kept, silently (``engine.backward``), or DeepSpeed never took
the second's (``loss.backward()``: step() failed). Installed, ours are registered again behind
DeepSpeed's before the next forward. Against plain torch: the same tiny GPT-2 generating
greedily, the same two losses backwarded in turn, SGD.
"""

import copy
import os

import pytest
import torch

pytest.importorskip("trl")  # installed by scripts/setup_env.sh

from trl.models.utils import unwrap_model_for_generation  # noqa: E402

import zero_lifetime  # noqa: E402
from harness import BACKWARD_PATHS, backward_by, full_weights  # noqa: E402
from test_hf_trainer import _model, second_loss  # noqa: E402

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

