"""engine.backward's division by gradient_accumulation_steps where nothing passes engine(...)'s
outputs (not run in CI): the figures behind docs/reliability.md, "DeepSpeed 0.18.9:
engine.backward divides the loss".

tests/harness's MLPNorm, GAS 2, two windows of one backward per micro step, SGD, against torch's
``(loss / 2).backward()``; stock and installed, stages 1-3. The largest weight difference
from torch, or the error:

- "module": ``engine.backward(loss)`` over ``engine.module(x)``;
- "functional_call": the same over ``torch.func.functional_call(engine.module, params, (x,))``;
- "penalty": ``engine.backward(loss + gradient penalty)`` over ``engine(x)``, the penalty loss of
  tests/test_retain_graph.py (``test_gradient_penalty_with_gradient_accumulation``);
- "plain_after_unscaled": a window of ``engine.backward(loss / 2, scale_wrt_gas=False)`` (the
  transformers Trainer's call), then one of plain ``loss.backward()`` over ``engine(x)``
  (0.17.6 has no plain backward: skipped).

Run it with each release's python (README, "Other DeepSpeed releases"):

    DS_ACCELERATOR=cpu python3 -m benchmarks.experiments.engine_backward_division
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29634"), RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0")

GAS = 2
CASES = ("module", "functional_call", "penalty", "plain_after_unscaled")


def _loss(case, forward, x):
    """The case's loss over ``forward`` (the engine, or the torch reference)."""
    from harness import losses
    from test_retain_graph import _penalty_loss
    return _penalty_loss(forward, x) if case == "penalty" else sum(losses(forward(x)))


def _micro_step(engine, case, window, x):
    module = engine.module
    forward = {"module": module,
               "functional_call": lambda x: torch.func.functional_call(module, dict(module.named_parameters()), (x,))}
    loss = _loss(case, forward.get(case, engine), x)
    if case != "plain_after_unscaled":
        engine.backward(loss)
    elif window == 0:
        engine.backward(loss / GAS, scale_wrt_gas=False)
    else:
        loss.backward()


def _train(case, stage, install):
    import zero_lifetime
    from harness import full_weights, make_input, make_pair
    engine, reference, ref_opt = make_pair("mlp_norm", stage, gas=GAS,
                                           config={"optimizer": {"type": "SGD", "params": {"lr": 0.01}}})
    if install:
        zero_lifetime.install(engine)
    for window in range(2):
        for micro in range(GAS):
            x = make_input("mlp_norm", 10 * window + micro)
            _micro_step(engine, case, window, x)
            engine.step()
            (_loss(case, reference, x) / GAS).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return max((got - want.detach()).abs().max().item() for got, want in zip(full_weights(engine), reference.parameters()))


def main():
    import deepspeed
    from harness import TORCH_STYLE_BACKWARD
    deepspeed.init_distributed("gloo")
    print(f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}, GAS {GAS}, 2 windows, max |w - torch|")
    for case in CASES:
        if case == "plain_after_unscaled" and not TORCH_STYLE_BACKWARD:
            print(f"{case:22s} skipped: this DeepSpeed has no plain loss.backward() path")
            continue
        for stage in (1, 2, 3):
            row = []
            for install in (False, True):
                try:
                    row.append(f"{_train(case, stage, install):.2e}")
                except Exception as error:  # noqa: BLE001 - the point is to print what stock raises
                    row.append(f"{type(error).__name__}: {str(error)[:70]}")
            print(f"{case:22s} stage {stage}  stock {row[0]:12s} installed {row[1]}", flush=True)


if __name__ == "__main__":
    main()
