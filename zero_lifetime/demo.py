"""The main job: show the ZeRO-3 retain_graph failure and its fix, on the CPU.

    python -m zero_lifetime.demo

Builds two identical ZeRO-3 engines (1 rank, gloo), runs a two-loss retained
backward on each: stock DeepSpeed fails on the second backward, the installed one
passes and its weights equal plain torch's. Prints stats() along the way, and ends
with a short ``python -m zero_lifetime.bench all --quick`` summary (stock vs installed,
side by side; the full tables come from that command).
"""

import copy

from .single_rank import single_rank_env


def main() -> int:
    single_rank_env()
    import torch
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    import zero_lifetime

    from .bench.engines import quiet_deepspeed

    quiet_deepspeed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                                torch.nn.Linear(32, 8))
    reference = copy.deepcopy(model)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    x = torch.randn(4, 16)

    def two_losses(out):
        return out.pow(2).mean(), out.abs().sum()

    print("== stock DeepSpeed ZeRO-3: two losses, backward(retain_graph=True) then backward")
    stock, *_ = deepspeed.initialize(model=copy.deepcopy(model), config=config)
    l1, l2 = two_losses(stock(x))
    stock.backward(l1, retain_graph=True)
    stock.zero_grad()
    try:
        stock.backward(l2)
        print("   unexpected: stock passed")
        stock_failed = False
    except RuntimeError as exc:
        print(f"   fails as reported upstream: RuntimeError: {str(exc).splitlines()[0]}")
        stock_failed = True

    print("== with zero_lifetime.install(engine)")
    engine, *_ = deepspeed.initialize(model=copy.deepcopy(model), config=config)
    zero_lifetime.install(engine)  # policy="regather": memory like stock ZeRO-3
    out = engine(x)
    print(f"   after forward: {zero_lifetime.stats(engine)}")
    l1, l2 = two_losses(out)
    engine.backward(l1, retain_graph=True)
    engine.zero_grad()
    engine.backward(l2)
    engine.step()
    del out, l1, l2
    stats = zero_lifetime.stats(engine)
    print(f"   after step:    {stats}")

    # Oracle: plain torch, same schedule (zero_grad between: only the second loss counts).
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    r1, r2 = two_losses(reference(x))
    r1.backward(retain_graph=True)
    optimizer.zero_grad()
    r2.backward()
    optimizer.step()
    worst = max((safe_get_full_fp32_param(p).detach() - q.detach()).abs().max().item()
                for p, q in zip(engine.module.parameters(), reference.parameters()))
    print(f"   max |weight - plain torch weight| after the step: {worst:.2e}")
    ok = stock_failed and worst < 1e-5 and stats["pinned_params"] == 0 and stats["live_handles"] == 0
    bench_summary()
    print("DEMO PASSED" if ok else "DEMO FAILED")
    return 0 if ok else 1


def bench_summary() -> None:
    """`bench all --quick` in a few lines: tiny sizes, so ratios are indicative only."""
    import io
    from contextlib import redirect_stdout

    from .bench import cli

    print("== python -m zero_lifetime.bench all --quick (tiny sizes, 1 rank; ratios are time / stock time;")
    print("   too small and few rounds to judge the targets: full-size figures in docs/benchmarks.md)")
    tables = io.StringIO()
    with redirect_stdout(tables):  # the full tables are the CLI's job; keep the demo short
        results, targets = cli.collect(cli.build_parser().parse_args(["all", "--quick"]))
    for line in cli.summary_lines(results):
        print(f"   {line}")
    # A met/missed mark on 3-5 rounds of tiny cases would be noise read as a verdict.
    print("   the targets, measured on these tiny cases (verdicts: docs/benchmarks.md):")
    for target, measured, _ in targets:
        print(f"   - {target}: {measured}")


if __name__ == "__main__":
    raise SystemExit(main())
