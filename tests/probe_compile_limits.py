"""The one-rank measurements behind the README's `torch.compile` limits that no test asserts
(DeepSpeed's own, stock included). Not collected by pytest; run with the release's Python:

    DS_ACCELERATOR=cpu python3 tests/probe_compile_limits.py

Each case runs stock (no install) and installed, with one backward per step so that stock
can pass, then prints what each raised (or "ok", with the weights against plain torch):

* compile_before_initialize: torch.compile(model) handed to deepspeed.initialize, ZeRO-3;
* compiled_autograd: engine.compile(compiled_autograd_enabled=True) (0.18+), ZeRO-3 and ZeRO-2;
* tied_weights: engine.compile() with a param read in its parent's forward (harness.TiedLM), ZeRO-3;
* retained_donated: the HF test's Trainer (GPT-2, two backwards of one forward, compiled),
  ZeRO-2 and ZeRO-3, torch's donated buffers on and off.
"""

import copy
import inspect
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zero_lifetime.single_rank as single_rank  # noqa: E402

single_rank.single_rank_env()

import deepspeed  # noqa: E402
import torch  # noqa: E402

import zero_lifetime  # noqa: E402
from harness import MODELS, assert_weights_match, ds_config, losses, make_input  # noqa: E402

BACKEND = "aot_eager"


def _outcome(run) -> str:
    torch._dynamo.reset()
    try:
        run()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the outcome is what is printed
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:110]}"


def _train(model_name, stage, install, prepare, compile_kwargs=None):
    """Three one-backward steps against plain torch; ``prepare(model)`` may wrap the model."""
    torch.manual_seed(0)
    model = MODELS[model_name]()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=prepare(model), config=ds_config(stage),
                                      model_parameters=model.parameters())
    if compile_kwargs is not None:
        engine.compile(backend=BACKEND, **compile_kwargs)
    if install:
        zero_lifetime.install(engine)
    for step in range(3):
        x = make_input(model_name, step)
        engine.backward(losses(engine(x))[0])
        engine.step()
        losses(reference(x))[0].backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_weights_match(engine, reference)


def _report(case, run):
    for install in (False, True):
        print(f"{case:<40} {'installed' if install else 'stock':<9} {_outcome(lambda: run(install))}", flush=True)


def main():
    print(f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}, backend {BACKEND}")
    _report("compile_before_initialize stage 3",
            lambda install: _train("mlp_norm", 3, install, lambda m: torch.compile(m, backend=BACKEND)))
    if "compiled_autograd_enabled" in inspect.signature(deepspeed.DeepSpeedEngine.compile).parameters:
        for stage in (3, 2):
            _report(f"compiled_autograd stage {stage}",
                    lambda install, stage=stage: _train("mlp_norm", stage, install, lambda m: m,
                                                        {"compiled_autograd_enabled": True}))
    _report("tied_weights stage 3", lambda install: _train("tied_lm", 3, install, lambda m: m, {}))
    import test_hf_trainer as hf
    from zero_lifetime.integrations.hf_trainer import add_to_trainer
    for stage in (2, 3):
        for donated in (True, False):
            for install in (False, True):
                def run(install=install, stage=stage):
                    trainer = hf._trainer(hf._model(), tempfile.mkdtemp(), BACKEND, stage)
                    if install:
                        add_to_trainer(trainer)
                    trainer.train()
                with torch._functorch.config.patch(donated_buffer=donated):
                    case = f"retained_donated stage {stage} donated={donated}"
                    print(f"{case:<40} {'installed' if install else 'stock':<9} {_outcome(run)}", flush=True)


if __name__ == "__main__":
    main()
