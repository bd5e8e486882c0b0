"""python -m zero_lifetime.bench {release,gather,bucket,step,all} [options]
python -m zero_lifetime.bench compare FIRST.json SECOND.json

Each sub-command runs the stock DeepSpeed way and the zero_lifetime way side by side in
one process (interleaved rounds), and prints medians, ratios and issue 4's targets.
`compare` says whether two runs' JSON files agree within each run's own noise.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

from . import bucket, compare, gather, release, step
from .report import Progress, print_results, print_targets, write_json, write_plot

BENCHES = {  # name -> (module, title)
    "release": (release, "Release of a module's params after its backward (ZeRO-3)"),
    "gather": (gather, "ZeRO-3 gather copy-out (and with --ranks 2, the real all-gather)"),
    "bucket": (bucket, "Gradient bucket fill (ZeRO-1/2/3)"),
    "step": (step, "Training step, stock vs install (and with --ranks 2, on 2 ranks too)"),
}
RANKED = ("gather", "step")  # the benchmarks that take --ranks
DEFAULT_REPEATS = {"step": (3, 20), "release": (5, 15), "gather": (5, 15), "bucket": (5, 15)}  # (quick, full)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where tensors live (default cpu)")
    common.add_argument("--ranks", type=int, choices=[1, 2], default=1,
                        help="processes for `gather` and `step` (2: also the real coalesced all-gather and the "
                             "steps on 2 ranks, gloo on CPU); default 1")
    common.add_argument("--quick", action="store_true", help="tiny sizes and few rounds (CI, the demo)")
    common.add_argument("--repeats", type=_int_at_least(1), default=None,
                        help="timed rounds per case (default: 15, step 20; --quick: 5, step 3)")
    common.add_argument("--json", metavar="PATH", help="write every raw sample and the environment here")
    common.add_argument("--plot", metavar="PATH", help="write a PNG: bandwidth vs size per method, roofline drawn")
    common.add_argument("--cuda-memcpy-segment-bytes", metavar="N", type=_int_at_least(0), default=None,
                        help="with --device cuda: fused copies without a cast or scale whose segments all hold "
                             ">= N bytes run as cudaMemcpyAsync calls (ops.set_cuda_memcpy_segment_bytes; "
                             "default: the library's)")
    parser = argparse.ArgumentParser(prog="python -m zero_lifetime.bench", description=__doc__.split("\n\n")[1])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{release,gather,bucket,step,all,compare}")
    for name, (module, title) in BENCHES.items():
        sub.add_parser(name, parents=[common], help=title, description=(module.__doc__ or title).strip())
    sub.add_parser("all", parents=[common], help="every benchmark, sizes sweeping many small -> few large")
    compare_parser = sub.add_parser("compare", help="whether two --json runs agree within noise",
                                    description=compare.__doc__.strip(),
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    compare_parser.add_argument("first", metavar="FIRST.json")
    compare_parser.add_argument("second", metavar="SECOND.json")
    compare_parser.add_argument("--tolerance", type=_fraction, default=compare.DEFAULT_TOLERANCE,
                                help="relative change of a median ratio still counted as the same "
                                     f"(default {compare.DEFAULT_TOLERANCE}; 0: overlapping IQRs only)")
    return parser


def deepspeed_problem() -> Optional[str]:
    """Why the benchmarks cannot run on the installed DeepSpeed, or None. Read from the package
    metadata: importing deepspeed here would pick its accelerator before the bench sets it."""
    from importlib import metadata
    from ..adapters.errors import SUPPORTED_DEEPSPEED_VERSIONS
    supported = ", ".join(SUPPORTED_DEEPSPEED_VERSIONS)
    try:
        version = metadata.version("deepspeed").split("+")[0]
    except metadata.PackageNotFoundError:
        return f"DeepSpeed is not installed; the benchmarks run its own code paths (supported: {supported})"
    if version not in SUPPORTED_DEEPSPEED_VERSIONS:
        return (f"DeepSpeed {version} is not supported: the stock baselines call its internal methods, "
                f"checked on {supported} only")
    return None


def _int_at_least(low: int):
    """An argparse type: an int of at least ``low``."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _cases(name: str, args) -> int:
    module = BENCHES[name][0]
    if name == "gather":
        return module.cases(args.quick, args.ranks, args.device)
    if name == "step":
        return module.cases(args.quick, args.ranks)
    return module.cases(args.quick, args.device) if name == "bucket" else module.cases(args.quick)


def run(args) -> int:
    from .env import environment
    env = environment(args.device, args.ranks)
    all_results, all_targets = collect(args, env)
    from ..single_rank import ports_chosen
    env["own_master_ports"] = ports_chosen()  # its DeepSpeed runs, whose /dev/shm buffers it removed
    if args.json:
        write_json(args.json, env, all_results, all_targets)
        print(f"\nraw samples and environment: {args.json}")
    if args.plot:
        if write_plot(args.plot, all_results, env):
            print(f"plot: {args.plot}")
        else:
            print(f"plot: nothing to plot for `{args.command}` (bandwidth plots come from gather and bucket)")
    return 0


def collect(args, env=None):
    """Run the chosen benchmarks, printing each table as it completes; (results, targets)."""
    from .env import describe, environment
    env = env or environment(args.device, args.ranks)
    names = list(BENCHES) if args.command == "all" else [args.command]
    print(describe(env))
    if args.ranks > 1 and any(n not in RANKED for n in names):
        print(f"# --ranks {args.ranks} applies to `gather` and `step`; the other benchmarks run on 1 rank",
              file=sys.stderr)
    progress = Progress(sum(_cases(n, args) for n in names))
    all_results, all_targets = [], []
    for name in names:
        module, title = BENCHES[name]
        repeats = args.repeats or DEFAULT_REPEATS[name][0 if args.quick else 1]
        if name in RANKED:
            results = module.run(args.device, repeats, args.quick, args.ranks, progress=progress)
        else:
            results = module.run(args.device, repeats, args.quick, progress=progress)
        targets = module.targets(results, args.device)
        print_results(f"{title}, median of {repeats} interleaved rounds", results)
        print_targets(targets)
        all_results += results
        all_targets += targets
    return all_results, all_targets


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "compare":
        try:
            return compare.report(args.first, args.second, args.tolerance)
        except compare.BenchFileError as error:
            parser.exit(2, f"{parser.prog} compare: error: {error}\n")
    problem = deepspeed_problem()
    if problem:
        parser.exit(2, f"{parser.prog} {args.command}: error: {problem}\n")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            parser.exit(2, f"{parser.prog} {args.command}: error: --device cuda needs a CUDA GPU, and this "
                           f"torch ({torch.__version__}) sees none; run with --device cpu\n")
    if args.cuda_memcpy_segment_bytes is not None:
        problem = _memcpy_route_problem(args.device)
        if problem:
            parser.exit(2, f"{parser.prog} {args.command}: error: --cuda-memcpy-segment-bytes {problem}\n")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.exit(2, f"{parser.prog}: error: --plot needs matplotlib (pip install matplotlib, or "
                           "bash scripts/setup_env.sh)\n")
    if args.cuda_memcpy_segment_bytes is None:
        return run(args)
    from .. import ops
    # For this run only (rank workers get it too); a caller of main() keeps its own setting.
    with ops.cuda_memcpy_route(args.cuda_memcpy_segment_bytes):
        return run(args)


def _memcpy_route_problem(device: str) -> Optional[str]:
    if device != "cuda":
        return "applies to --device cuda only: CPU copies have no such route"
    from .. import ops
    if not ops.native_available():
        return "needs the compiled ops, which are not loaded (python -m zero_lifetime.env_report)"
    return None


def summary_lines(results: List[dict]) -> List[str]:
    """One line per case, for the demo: ours vs stock and vs the roofline."""
    from .report import summarize
    lines = []
    for result in results:
        rows = {row["method"]: row for row in summarize(result)}
        ours = rows.get(result.get("ours"))
        if ours is None:
            continue
        text = f"{result['case']}: {ours['vs_stock']:.2f}x stock time"
        if ours["vs_roofline"] is not None:
            text += f", {ours['vs_roofline']:.2f}x roofline"
        lines.append(text)
    return lines
