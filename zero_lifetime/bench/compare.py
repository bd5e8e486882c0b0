"""`compare`: are two runs of the same benchmark command the same within noise?

    python -m zero_lifetime.bench compare FIRST.json SECOND.json [--tolerance 0.10]

Reads two ``--json`` files. For every case in both, each method's time is taken relative to
the case's reference (the roofline where the case has one, else the stock way) round by
round: the methods of a round ran back to back, so their ratio cancels the drift that moves
absolute times between runs. A run's own noise is the spread of those per-round ratios, its
interquartile range (IQR). Two runs agree on a ratio when their IQRs overlap, or when their
medians differ by at most ``--tolerance`` (relative; default 10%): a new process also gets a
new heap layout and page placement, which moves ratios by more than one run's rounds scatter
(measured in docs/benchmarks.md); ``--tolerance 0`` asks for the IQRs alone. Target verdicts
(met / MISSED) are compared too, and peak gathered bytes (the same within the tolerance).

Exit status: 0 when every ratio, target verdict and peak agrees, 1 otherwise, 2
when a file cannot be read as a benchmark's JSON. Runs on different devices or commands, or
CUDA runs whose fused copies took the cudaMemcpyAsync route from different segment sizes, are
still compared, with a warning: that is not a reproducibility check.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .timing import paired_ratios

# Environment fields that make two runs the same experiment; git commit and date may differ.
SAME_EXPERIMENT = ("device", "device_name", "ranks", "torch_threads", "torch", "deepspeed", "fused_ops")
# Arguments that name output files, not what was measured.
OUTPUT_OPTIONS = ("--json", "--plot")


class BenchFileError(ValueError):
    """A file that is not a benchmark run's JSON."""


@dataclass(frozen=True)
class RatioSpread:
    median: float
    low: float   # first quartile of the per-round ratios
    high: float  # third quartile

    def overlaps(self, other: "RatioSpread") -> bool:
        return self.low <= other.high and other.low <= self.high


@dataclass(frozen=True)
class RatioComparison:
    case: str
    method: str
    reference: str  # "roofline" or "stock"
    first: RatioSpread
    second: RatioSpread
    is_ours: bool  # the zero_lifetime way, whose ratios the targets judge

    @property
    def change(self) -> float:
        """Relative change of the median ratio from the first run to the second."""
        return self.second.median / self.first.median - 1

    def agrees(self, tolerance: float) -> bool:
        return self.first.overlaps(self.second) or abs(self.change) <= tolerance


def load_run(path: str) -> dict:
    try:
        with open(path) as f:
            payload = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise BenchFileError(f"{path}: cannot read a benchmark JSON ({error})") from error
    if not isinstance(payload, dict) or not {"environment", "results", "targets"} <= payload.keys():
        raise BenchFileError(f"{path}: not written by `python -m zero_lifetime.bench ... --json` "
                             "(expected the keys environment, results, targets)")
    return payload


def per_round_ratios(samples: Dict[str, List[float]], method: str, reference: str) -> List[float]:
    """Method time / reference time of each round (the rounds interleave the methods)."""
    ours, ref = samples[method], samples[reference]
    if not ours or len(ours) != len(ref) or min(ref) <= 0:
        raise BenchFileError(f"{method!r} ({len(ours)} rounds) and {reference!r} ({len(ref)} rounds) are "
                             "not positive times paired round by round")
    return paired_ratios(samples, method, reference)


def spread(ratios: Sequence[float]) -> RatioSpread:
    if len(ratios) < 2:
        value = ratios[0]
        return RatioSpread(value, value, value)
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return RatioSpread(statistics.median(ratios), low, high)


def reference_of(result: dict) -> Optional[Tuple[str, str]]:
    """("roofline" or "stock", its method name) the case's ratios are taken against."""
    for kind in ("roofline", "stock"):
        if result.get(kind) in result["samples"]:
            return kind, result[kind]
    return None


def _key(result: dict) -> Tuple[str, str]:
    return result.get("bench", ""), result["case"]


def compare_ratios(first: dict, second: dict) -> Tuple[List[RatioComparison], List[str]]:
    """Ratio comparisons of the cases both runs hold; and the cases only one of them holds."""
    by_key = {_key(r): r for r in second["results"]}
    comparisons, unmatched = [], []
    seen = set()
    for result in first["results"]:
        key = _key(result)
        seen.add(key)
        other = by_key.get(key)
        if other is None:
            unmatched.append(f"only in the first run: {result['case']}")
            continue
        reference = reference_of(result)
        if reference is None or reference_of(other) != reference:
            unmatched.append(f"no common reference to take ratios against: {result['case']}")
            continue
        kind, reference = reference
        for method in result["samples"]:
            if method == reference or method not in other["samples"]:
                continue
            comparisons.append(RatioComparison(
                result["case"], method, kind,
                spread(per_round_ratios(result["samples"], method, reference)),
                spread(per_round_ratios(other["samples"], method, reference)),
                method == result.get("ours")))
    unmatched += [f"only in the second run: {r['case']}" for r in second["results"] if _key(r) not in seen]
    return comparisons, unmatched


def compare_targets(first: dict, second: dict) -> List[Tuple[str, Optional[bool], Optional[bool], str, str]]:
    """(target, verdict 1, verdict 2, measured 1, measured 2) for every target in either run."""
    one = {t["target"]: t for t in first["targets"]}
    two = {t["target"]: t for t in second["targets"]}
    rows = []
    for name in list(one) + [n for n in two if n not in one]:
        a, b = one.get(name, {}), two.get(name, {})
        rows.append((name, a.get("met"), b.get("met"), a.get("measured", "absent"), b.get("measured", "absent")))
    return rows


def compare_peaks(first: dict, second: dict) -> List[Tuple[str, str, int, int]]:
    """(case, engine, bytes 1, bytes 2) of the peak gathered bytes both runs recorded."""
    by_key = {_key(r): r for r in second["results"]}
    rows = []
    for result in first["results"]:
        other = by_key.get(_key(result))
        peaks, other_peaks = result.get("peak_gathered_bytes"), (other or {}).get("peak_gathered_bytes")
        if not peaks or not other_peaks:
            continue
        rows += [(result["case"], name, peaks[name], other_peaks[name]) for name in peaks if name in other_peaks]
    return rows


def experiment_differences(first: dict, second: dict) -> List[str]:
    """What makes the two runs different experiments (device, versions, command), if anything."""
    env1, env2 = first["environment"], second["environment"]
    out = [f"{key}: {env1.get(key)} vs {env2.get(key)}" for key in SAME_EXPERIMENT if env1.get(key) != env2.get(key)]
    if env1.get("device") == env2.get("device") == "cuda":  # the route changes what a CUDA run measures only
        route1, route2 = _cuda_memcpy_route(env1), _cuda_memcpy_route(env2)
        if route1 != route2:
            out.append(f"cudaMemcpyAsync route: {route1} vs {route2}")
    cmd1, cmd2 = _measured_command(env1.get("command", "")), _measured_command(env2.get("command", ""))
    if cmd1 != cmd2:
        out.append(f"command: {' '.join(cmd1)} vs {' '.join(cmd2)}")
    return out


def _cuda_memcpy_route(env: dict) -> str:
    """From which segment size a CUDA run's fused copies took cudaMemcpyAsync. Runs recorded
    before the route existed, and runs without the compiled ops, never took it."""
    from ..ops import CUDA_MEMCPY_NEVER
    segment_bytes = env.get("cuda_memcpy_segment_bytes")
    if segment_bytes is None or segment_bytes >= CUDA_MEMCPY_NEVER:
        return "never"
    return f"from {segment_bytes} B segments"


def _measured_command(command: str) -> List[str]:
    words, out, skip = command.split(), [], False
    for word in words:
        if skip:
            skip = False
        elif word in OUTPUT_OPTIONS:
            skip = True
        elif not any(word.startswith(option + "=") for option in OUTPUT_OPTIONS):
            out.append(word)
    return out


def _verdict(met: Optional[bool]) -> str:
    return "absent" if met is None else ("met" if met else "MISSED")


DEFAULT_TOLERANCE = 0.10


def report(first_path: str, second_path: str, tolerance: float = DEFAULT_TOLERANCE, out=None) -> int:
    """Print the comparison; the exit status described in the module's docstring."""
    out = out or sys.stdout
    first, second = load_run(first_path), load_run(second_path)
    for name, payload in ((first_path, first), (second_path, second)):
        env = payload["environment"]
        print(f"# {name}: {env.get('date')}, {env.get('device')} ({env.get('device_name')}), "
              f"commit {(env.get('git_commit') or 'unknown')[:10]}: {env.get('command')}", file=out)
    for line in experiment_differences(first, second):
        print(f"WARNING: different experiments, {line}", file=out)

    comparisons, unmatched = compare_ratios(first, second)
    print("\n| case | method | vs | first run: median [IQR] | second run: median [IQR] | change | |", file=out)
    print("|---|---|---|---:|---:|---:|---|", file=out)
    for c in comparisons:
        verdict = "same" if c.first.overlaps(c.second) else ("within tolerance" if c.agrees(tolerance) else "MOVED")
        print(f"| {c.case} | {c.method} | {c.reference} | {_spread(c.first)} | {_spread(c.second)} | "
              f"{100 * c.change:+.1f}% | {verdict} |", file=out)
    for line in unmatched:
        print(f"  {line}", file=out)

    targets = compare_targets(first, second)
    if targets:
        print("\nTargets:", file=out)
    for name, a, b, measured1, measured2 in targets:
        mark = "same" if a == b else "CHANGED"
        print(f"  [{mark:7s}] {name}: {_verdict(a)} ({measured1}) / {_verdict(b)} ({measured2})", file=out)

    peaks = compare_peaks(first, second)
    peaks_changed = 0
    for case, name, a, b in peaks:
        same = abs(b - a) <= tolerance * max(a, b)  # bytes, not times: no rounds to scatter
        peaks_changed += not same
        print(f"  [{'same' if same else 'CHANGED':7s}] peak gathered, {name}: {a / 2**20:.2f} / "
              f"{b / 2**20:.2f} MiB ({case})", file=out)

    moved = sum(not c.agrees(tolerance) for c in comparisons)
    changed = sum(a != b for _, a, b, _, _ in targets)
    print("", file=out)
    print(_ratio_summary("ratios of every method", comparisons, tolerance), file=out)
    print(_ratio_summary("ratios of the zero_lifetime way (what the targets judge)",
                         [c for c in comparisons if c.is_ours], tolerance), file=out)
    print(f"target verdicts: {changed} of {len(targets)} changed; peak gathered bytes: {peaks_changed} of "
          f"{len(peaks)} changed", file=out)
    return 0 if moved == 0 and changed == 0 and peaks_changed == 0 else 1


def _ratio_summary(what: str, comparisons: Sequence[RatioComparison], tolerance: float) -> str:
    overlapping = sum(c.first.overlaps(c.second) for c in comparisons)
    moved = sum(not c.agrees(tolerance) for c in comparisons)
    text = (f"{what}: {overlapping} of {len(comparisons)} with overlapping IQRs, "
            f"{len(comparisons) - overlapping - moved} more within {100 * tolerance:.0f}%, {moved} moved")
    if comparisons:
        worst = max(comparisons, key=lambda c: abs(c.change))
        text += f"; largest change {100 * worst.change:+.1f}% ({worst.method}, {worst.case})"
    return text


def _spread(s: RatioSpread) -> str:
    return f"{s.median:.3f}x [{s.low:.3f}, {s.high:.3f}]"
