"""Tiny transformers models of several architectures, with and without Hugging Face gradient
checkpointing, installed, against plain torch (1 rank, stages 1-3): two losses backwarded over
one forward per step (the LM loss, then a loss on the logits).

What each architecture brings: Llama (GQA, rotary buffers, RMSNorm), T5 (encoder-decoder,
relative attention bias read by the first block only, tied embeddings), Mixtral (routed experts,
only some run per token; its router's aux loss), BERT (post-norm, a tied MLM decoder). Gradient
checkpointing (``model.gradient_checkpointing_enable``, the Trainer's ``gradient_checkpointing``)
recomputes each layer inside the backward, where ZeRO-3 gathers its params again; reentrant runs
that recompute as a backward inside the backward. Stock ZeRO-3 fails the second backward of
each (the negative control). Tiny configs, no download. 2 ranks, with the model built inside
zero.Init: the ``llama_ckpt`` scenarios of two_rank_worker.
"""

import copy

import pytest
import torch

pytest.importorskip("transformers")  # installed by scripts/setup_env.sh

import transformers  # noqa: E402

import deepspeed  # noqa: E402
import zero_lifetime  # noqa: E402
from harness import ds_config, full_weights, released_state  # noqa: E402

VOCAB, LR = 40, 0.05
SMALL = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             max_position_embeddings=32)
ARCHITECTURES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=1, **SMALL)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, **SMALL)),
    "bert": lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **SMALL)),
    "t5": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0)),
}
# activation_checkpointing_enable's arguments (gradient_checkpointing_enable's before transformers 5.24).
CHECKPOINTING = {"none": None,
                 "non_reentrant": {"use_reentrant": False},
                 "reentrant": {"use_reentrant": True},
                 "every_other_layer": {"use_reentrant": False, "every_n_layers": 2}}


def _model(architecture, checkpointing):
    torch.manual_seed(0)
    model = ARCHITECTURES[architecture]()
    settings = CHECKPOINTING[checkpointing]
    if settings is not None:
        kwargs = {k: v for k, v in settings.items() if k != "every_n_layers"}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(kwargs, every_n_layers=settings.get("every_n_layers", 1))
        elif "every_n_layers" in settings:
            pytest.skip("every_n_layers came with transformers' activation_checkpointing_enable")
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model.train()


def _batch(architecture, step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, VOCAB, (2, 6), generator=g)
    labels = torch.randint(1, VOCAB, (2, 4), generator=g) if architecture == "t5" else ids.clone()
    return {"input_ids": ids, "labels": labels}


def _losses(out):
    return out.loss, out.logits.pow(2).mean() * 0.1


def _engine(model, stage):
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage, lr=LR), model_parameters=model.parameters())
    return engine


CASES = ([(3, arch, ckpt) for arch in ARCHITECTURES for ckpt in CHECKPOINTING]
         + [(stage, arch, "reentrant") for stage in (1, 2) for arch in ARCHITECTURES])


@pytest.mark.parametrize("stage, architecture, checkpointing", CASES, ids=[f"stage{s}-{a}-{c}" for s, a, c in CASES])
def test_two_losses_per_step_match_torch(stage, architecture, checkpointing):
    model = _model(architecture, checkpointing)
    reference = copy.deepcopy(model)
    engine = _engine(model, stage)
    zero_lifetime.install(engine)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    initial = [p.detach().clone() for p in reference.parameters()]
    for step in range(2):
        batch = _batch(architecture, step)
        for run, backward in ((engine, engine.backward), (reference, torch.Tensor.backward)):
            first, second = _losses(run(**batch))
            backward(first, retain_graph=True)
            backward(second)
        engine.step()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    assert max((p.detach() - p0).abs().max().item() for p, p0 in zip(reference.parameters(), initial)) > 1e-3
    for (name, want), got in zip(reference.named_parameters(), full_weights(engine)):
        torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    if stage == 3:
        assert released_state(engine) == ([], [])


@pytest.mark.parametrize("checkpointing", ["none", "reentrant"])
def test_stock_stage3_fails_the_second_backward(checkpointing):
    """Negative control: the layers outside the checkpoints (embeddings, head, final norm) saved
    their weights, released after the first backward."""
    engine = _engine(_model("llama", checkpointing), 3)
    first, second = _losses(engine(**_batch("llama", 0)))
    engine.backward(first, retain_graph=True)
    with pytest.raises(RuntimeError, match=r"The size of tensor a \(0\) must match"):
        engine.backward(second)
