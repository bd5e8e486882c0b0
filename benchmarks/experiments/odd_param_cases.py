"""Zero-size and 0-dim params, custom autograd Functions that keep weights, embedding variants
(not run in CI): the figures behind docs/reliability.md, "Zero-size and 0-dim params, custom
autograd Functions".

1. tests/test_user_patterns.ContrastiveTowers trained stock (install=False) as its tests
   train it, each Function, GAS 1 and 2: the largest weight difference from plain torch, or
   the error.
2. What deepspeed.initialize and a first step make, stock, of a zero-size param registered
   first or after other params, of a module whose only param is zero-size (ZeRO-3), and of a
   0-dim param: "ok" or the error. Run it with each release's python (README, "Other DeepSpeed
   releases").
3. The same, 2 gloo ranks, ZeRO-3, harness.DeviceMarkedMLPNorm (a zero-size param beside
   others): "ok" or the error, stock.
4. tests/test_user_patterns.EmbeddingHead trained stock as test_embedding_variants trains it
   (two retained backwards), and nn.Embedding(max_norm=1.0) with ONE backward per step, stock:
   the largest weight difference from torch, and the largest embedding row norm on each side.

    DS_ACCELERATOR=cpu python3 -m benchmarks.experiments.odd_param_cases
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29632"), RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0")


def _outcome(run) -> str:
    """"ok", the largest weight difference from torch where ``run()`` returns (engine,
    reference), or the error."""
    try:
        trained = run()
    except Exception as error:  # noqa: BLE001 - the point is to print what stock raises
        return f"{type(error).__name__}: {str(error)[:100]}"
    if trained is None:
        return "ok"
    from harness import full_weights
    engine, reference = trained
    diff = max((got - want.detach()).abs().max().item() if got.numel() else 0.0
               for got, want in zip(full_weights(engine), reference.parameters()))
    return f"{diff:.3g} off torch"


def stock_contrastive_towers():
    import test_user_patterns as cases
    for stage in (1, 2, 3):
        for function in sorted(cases.CUSTOM_FUNCTIONS):
            for gas in (1, 2):
                result = _outcome(lambda: cases._train_contrastive_towers(stage, None, gas, install=False,
                                                                          function=function))
                print(f"stock stage {stage} {function:17} GAS {gas}: {result}")


def stock_embeddings():
    import copy

    import deepspeed
    import test_user_patterns as cases
    from harness import ds_config, full_weights
    for stage in (1, 2, 3):
        for kind in sorted(cases.EMBEDDING_KINDS):
            result = _outcome(lambda: cases._train_embedding_head(stage, kind, install=False))
            print(f"stock stage {stage} {kind:18} two backwards: {result}")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(11, 8, max_norm=1.0), torch.nn.Flatten(), torch.nn.Linear(40, 3))
        reference = copy.deepcopy(model)
        engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage, lr=0.05), model_parameters=model.parameters())
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
        for step in range(3):
            tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(step))
            engine.backward(engine(tokens).pow(2).mean())
            engine.step()
            reference(tokens).pow(2).mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
        got = full_weights(engine)
        want = reference[0].weight
        print(f"stock stage {stage} Embedding(max_norm=1.0), one backward: {(got[0] - want).abs().max():.3g} off torch; "
              f"largest row norm {got[0].norm(dim=1).max():.3g} (torch {want.norm(dim=1).max():.3g})")


class _Marked(torch.nn.Module):
    def __init__(self, marker_first, other_root_param, zero_dim=False):
        super().__init__()
        if marker_first:
            self.marker = torch.nn.Parameter(torch.empty(0))
        self.linear = torch.nn.Linear(4, 4)
        if other_root_param:
            self.scale = torch.nn.Parameter(torch.ones(() if zero_dim else (4,)))
        if not marker_first:
            self.marker = torch.nn.Parameter(torch.empty(0))

    def forward(self, x):
        return self.linear(x) * (self.scale if hasattr(self, "scale") else 1)


def stock_initialize_and_step():
    import deepspeed
    from harness import ds_config
    layouts = {"zero-size param first": dict(marker_first=True, other_root_param=True),
               "zero-size param after others": dict(marker_first=False, other_root_param=True),
               "zero-size param the root's only one": dict(marker_first=True, other_root_param=False),
               "0-dim param": dict(marker_first=True, other_root_param=True, zero_dim=True)}
    for stage in (1, 2, 3):
        for name, layout in layouts.items():
            def run():
                model = _Marked(**layout)
                engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage), model_parameters=model.parameters())
                engine.backward(engine(torch.randn(4, 4)).sum())
                engine.step()
            print(f"DeepSpeed {deepspeed.__version__} stage {stage} {name:36}: {_outcome(run)}")


def _stock_zero3_two_ranks(rank, out_dir, port):
    os.environ.update(MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    import deepspeed
    from harness import DeviceMarkedMLPNorm, ds_config
    deepspeed.init_distributed("gloo")

    def run():
        model = DeviceMarkedMLPNorm()
        engine, *_ = deepspeed.initialize(model=model, config=ds_config(3), model_parameters=model.parameters())
        engine.backward(engine(torch.randn(4, 8)).sum())
        engine.step()
    result = _outcome(run)
    if rank == 0:
        print(f"DeepSpeed {deepspeed.__version__} stage 3, 2 ranks, zero-size param beside others: {result}")


def stock_zero3_two_ranks():
    import tempfile

    from rank_spawn import spawn_ranks
    spawn_ranks(_stock_zero3_two_ranks, tempfile.mkdtemp(), 2, 300)


if __name__ == "__main__":
    import logging

    import deepspeed
    deepspeed.init_distributed("gloo")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    stock_contrastive_towers()
    stock_initialize_and_step()
    stock_zero3_two_ranks()
    stock_embeddings()
