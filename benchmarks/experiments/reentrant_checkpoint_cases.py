"""Every trainable param inside reentrant checkpoints (not run in CI): the figures behind the
fix of stop 65 (docs/reliability.md, "LoRA under reentrant gradient checkpointing").

1. harness.AdaptersInsideCheckpoints on 1 gloo rank, stages 1-3, stock and installed, one
   backward of both losses or two retained ones per step, 3 steps at GAS 1: the largest weight
   difference from plain torch. (Run it on the commit before 7b2e150 for the "before" figures.)
2. What install's search for a reentrant checkpoint costs: one walk of a 12,500-node graph
   with none, timed in a hook on its output during a plain backward (median of 5).

    DS_ACCELERATOR=cpu python3 -m benchmarks.experiments.reentrant_checkpoint_cases
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29631"), RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0")


def weight_differences():
    import copy

    import deepspeed
    import zero_lifetime
    from harness import AdaptersInsideCheckpoints, ds_config, full_weights, losses, make_input
    deepspeed.init_distributed("gloo")
    for stage in (1, 2, 3):
        for install in (False, True):
            for backwards in (1, 2):
                if backwards == 2 and not install and stage == 3:
                    print(f"stage {stage} stock     {backwards} backwards: fails (released params)")
                    continue
                torch.manual_seed(0)
                model = AdaptersInsideCheckpoints()
                reference = copy.deepcopy(model)
                engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage, lr=0.05),
                                                  model_parameters=[p for p in model.parameters() if p.requires_grad])
                if install:
                    zero_lifetime.install(engine)
                optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.05)
                for step in range(3):
                    x = make_input("mlp_norm", step)
                    first, second = losses(engine(x))
                    if backwards == 1:
                        engine.backward(first + second)
                    else:
                        engine.backward(first, retain_graph=True)
                        engine.backward(second)
                    engine.step()
                    sum(losses(reference(x))).backward()
                    optimizer.step()
                    optimizer.zero_grad()
                worst = max((got - want.detach()).abs().max().item()
                            for got, want in zip(full_weights(engine), reference.parameters()))
                print(f"stage {stage} {'installed' if install else 'stock    '} {backwards} backwards: "
                      f"{worst:.2e} off torch")
                engine.destroy()


def search_cost():
    from zero_lifetime.install import _reentrant_checkpoint_below
    x = torch.randn(4, 8, requires_grad=True)
    hidden = x
    for weight in [torch.randn(8, 8, requires_grad=True) for _ in range(2500)]:
        hidden = torch.tanh(hidden @ weight) + hidden * 0.5
    out = hidden.sum()
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(n for n, _ in node.next_functions)
    times = []

    def timed(grad):
        start = time.perf_counter()
        found = _reentrant_checkpoint_below()
        times.append((time.perf_counter() - start, found))

    hidden.register_hook(timed)
    for _ in range(5):  # a plain backward: under autograd.grad install skips the walk
        out.backward(retain_graph=True)
    seconds = statistics.median(t for t, _ in times)
    print(f"search: {len(seen)} nodes, {seconds * 1e3:.1f} ms (median of 5), found a checkpoint: {times[0][1]}")


if __name__ == "__main__":
    weight_differences()
    search_cost()
