"""PEFT LoRA adapters (peft 0.21) on installed engines: the base model frozen when
deepspeed.initialize runs, only the adapters trained, two losses backwarded over one forward.

The usual way to fine-tune a large model with DeepSpeed, and with TRL the usual RL and DPO
setup, where the reference model is the same model with its adapters turned off
(``disable_adapter()``), run without grad beside the policy's forward. On stock ZeRO-3 the
second backward fails on the frozen base weights the graph saved (released after the first).
Against plain torch: the same PeftModel, SGD over its trainable params. Tiny models built from
configs, no download.
"""

import copy
import sys

import pytest
import torch

pytest.importorskip("peft")  # installed by scripts/setup_env.sh

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import deepspeed  # noqa: E402
import zero_lifetime  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402
from harness import DS_VERSION, TORCH_STYLE_BACKWARD, backward_both  # noqa: E402

LR, VOCAB = 0.1, 64
PATHS = ["engine", "manual"] if TORCH_STYLE_BACKWARD else ["engine"]


def _lora_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: A would get no gradient in the first step
            torch.nn.init.normal_(param, std=0.02)
    return model


def _engine_and_oracle(stage, gas):
    model = _lora_llama()
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trainable)
    oracle_optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=LR)
    return engine, reference, oracle_optimizer


def _losses(call, peft_model, ids, reference_through):
    """The language-model loss, and a second loss: the logits' size, or (``reference_through``
    the engine or the module) their distance to the adapter-free model's logits, as DPO-style
    trainers compute them."""
    out = call(input_ids=ids, labels=ids)
    if reference_through is None:
        return out.loss, out.logits.pow(2).mean()
    with torch.no_grad(), peft_model.disable_adapter():
        reference_logits = (call if reference_through == "engine" else peft_model)(input_ids=ids).logits
    return out.loss, (out.logits - reference_logits).pow(2).mean()


def _batch(micro_step):
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(micro_step))


def _train(engine, reference, oracle_optimizer, gas, path, reference_through, install=True):
    if install:
        zero_lifetime.install(engine)
    for micro_step in range(2 * gas):
        ids = _batch(micro_step)
        l1, l2 = _losses(engine, engine.module, ids, reference_through)
        backward_both(engine, l1, l2, path, zero_grad=False)
        engine.step()
        r1, r2 = _losses(reference, reference, ids, reference_through)
        ((r1 + r2) / gas).backward()
        if (micro_step + 1) % gas == 0:
            oracle_optimizer.step()
            oracle_optimizer.zero_grad()


def _assert_adapters_match(engine, reference):
    initial = dict(_lora_llama().named_parameters())
    trained = [(name, param, want) for (name, param), want in zip(engine.module.named_parameters(), reference.parameters())
               if param.requires_grad]
    assert trained and all("lora_" in name for name, _, _ in trained)
    moved = 0.0
    for name, param, want in trained:
        got = safe_get_full_fp32_param(param)
        torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=1e-5, msg=name)
        moved = max(moved, (got - initial[name].detach()).abs().max().item())
    assert moved > 1e-4  # the adapters trained


@pytest.mark.parametrize("reference_through", [None, "engine", "module"], ids=["no_reference", "reference_engine",
                                                                               "reference_module"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lora_adapters_train_like_torch_with_two_backwards(stage, gas, path, reference_through):
    engine, reference, oracle_optimizer = _engine_and_oracle(stage, gas)
    _train(engine, reference, oracle_optimizer, gas, path, reference_through)
    _assert_adapters_match(engine, reference)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lora_adapters_under_activation_checkpointing(stage, gas, path, reentrant, monkeypatch):
    """HF gradient checkpointing over the LoRA model: every trainable param is then inside a
    checkpoint. Reentrant, the outer backward's own graph reaches none of them (each
    checkpoint backwards its recomputed layer as a nested graph task), which install once took
    for a torch.autograd.grad: the adapters moved a tenth of torch's, silently, on every stage
    (ZeRO-3 with one backward too)."""
    if stage == 3 and not reentrant and DS_VERSION in ("0.17.6", "0.18.9"):
        pytest.skip("this DeepSpeed's ZeRO-3 does not gather the frozen base weights in a non-reentrant "
                    "recompute: a plain backward fails, stock too (CheckpointError, checked)")
    lora_llama = _lora_llama

    def checkpointed_lora_llama():
        model = lora_llama()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return model.train()

    monkeypatch.setattr(sys.modules[__name__], "_lora_llama", checkpointed_lora_llama)
    engine, reference, oracle_optimizer = _engine_and_oracle(stage, gas)
    assert engine.module.is_gradient_checkpointing
    _train(engine, reference, oracle_optimizer, gas, path, None)
    _assert_adapters_match(engine, reference)


def test_stock_zero3_fails_on_the_second_backward():
    """Why: the graph saved the frozen base weights, which stock ZeRO-3 released."""
    engine, reference, oracle_optimizer = _engine_and_oracle(3, 1)
    with pytest.raises(RuntimeError, match="size of tensor"):
        _train(engine, reference, oracle_optimizer, 1, "engine", None, install=False)


def _adapter_weights(trainer):
    """The trained params (the frozen base has no fp32 copy in the optimizer)."""
    return {name: safe_get_full_fp32_param(param).detach().clone()
            for name, param in trainer.model_wrapped.module.named_parameters() if param.requires_grad}


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_with_a_lora_model_matches_the_summed_loss(tmp_path, stage):
    """The Trainer's own path: accelerate builds the engine over the PeftModel (GPT-2's Conv1D
    attention, fan_in_fan_out), the callback installs; two backwards per step against stock
    DeepSpeed backwarding the summed loss once."""
    from test_hf_trainer import SummedLossTrainer, _model, _trainer
    from zero_lifetime.integrations.hf_trainer import add_to_trainer

    def lora_gpt2():
        model = get_peft_model(_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                    fan_in_fan_out=True))
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.02, generator=torch.Generator().manual_seed(1))
        return model

    oracle = _trainer(lora_gpt2(), tmp_path / "oracle", stage=stage)
    oracle.__class__ = SummedLossTrainer
    oracle.train()
    want = _adapter_weights(oracle)
    trainer = _trainer(lora_gpt2(), tmp_path / "two", stage=stage)
    assert add_to_trainer(trainer) is not None
    trainer.train()
    got = _adapter_weights(trainer)
    initial = dict(lora_gpt2().named_parameters())
    assert want and all("lora_" in name for name in want)
    assert max((want[n] - initial[n]).abs().max().item() for n in want) > 1e-4
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)
