"""Terminal tables, the progress bar, the JSON file and the bandwidth plot."""

from __future__ import annotations

import json
import statistics
import sys
from typing import Dict, List, Sequence, Tuple

Result = Dict[str, object]


class Progress:
    """A one-line bar on stderr: sweeps take minutes and stdout stays a clean table."""

    def __init__(self, total: int, width: int = 24):
        self.total, self.done, self.width = max(total, 1), 0, width

    def step(self, label: str) -> None:
        self.done += 1
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        end = "\n" if self.done >= self.total else ""
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {label[:60]:60s}{end}")
        sys.stderr.flush()


def keep(results: List[Result], result: Result, progress: "Progress | None") -> None:
    """Add a case's result to the sweep's and move the bar on, when there is one."""
    results.append(result)
    if progress:
        progress.step(result["case"])


def summarize(result: Result) -> List[Dict[str, object]]:
    """Median, bandwidth and ratios (to the stock way, to the roofline) of each method of a case."""
    samples = result["samples"]
    medians = {m: statistics.median(t) for m, t in samples.items()}
    stock = medians.get(result.get("stock"))
    roof = medians.get(result.get("roofline"))
    per = result.get("per")
    rows = []
    for method, median in medians.items():
        rows.append({
            "case": result["case"], "method": method, "median_ms": median * 1e3,
            "per_item_us": median * 1e6 / per if per else None,
            "gb_per_s": result["bytes"] / median / 1e9 if result.get("bytes") else None,
            "vs_stock": median / stock if stock else None,
            "vs_roofline": median / roof if roof else None,
        })
    return rows


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def print_results(title: str, results: Sequence[Result], out=None) -> None:
    if not results:
        return
    out = out or sys.stdout  # looked up per call: tests and callers may redirect it
    per_label = results[0].get("per_label", "per item")
    print(f"\n## {title}", file=out)
    print(f"| case | method | median | {per_label} | GB/s | vs stock | vs roofline |", file=out)
    print("|---|---|---:|---:|---:|---:|---:|", file=out)
    for result in results:
        for row in summarize(result):
            print(f"| {row['case']} | {row['method']} | {row['median_ms']:.3f} ms | "
                  f"{_fmt(row['per_item_us'], '.3f', ' us')} | {_fmt(row['gb_per_s'], '.1f')} | "
                  f"{_fmt(row['vs_stock'], '.2f', 'x')} | {_fmt(row['vs_roofline'], '.2f', 'x')} |", file=out)
        for line in result.get("notes", []):
            print(f"|   | {line} | | | | | |", file=out)


def print_targets(targets: Sequence[Tuple[str, str, bool]], out=None) -> None:
    """(target, measured, met) lines, printed next to the figures they judge."""
    if not targets:
        return
    out = out or sys.stdout
    print("\nTargets:", file=out)
    for target, measured, met in targets:
        mark = "met" if met else ("n/a" if met is None else "MISSED")
        print(f"  [{mark:6s}] {target}: {measured}", file=out)


def write_json(path: str, environment: Dict[str, object], results: Sequence[Result],
               targets: Sequence[Tuple[str, str, bool]]) -> None:
    payload = {
        "environment": environment,
        "results": [{**r, "summary": summarize(r)} for r in results],
        "targets": [{"target": t, "measured": m, "met": ok} for t, m, ok in targets],
    }
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


def write_plot(path: str, results: Sequence[Result], environment: Dict[str, object]) -> bool:
    """Bandwidth vs bytes per tensor, one line per method, the roofline dashed; False if nothing to plot."""
    series: Dict[str, List[Result]] = {}
    for r in results:
        if r.get("bytes") and r.get("roofline") and r.get("series"):
            series.setdefault(r["series"], []).append(r)
    if not series:
        return False
    import matplotlib
    matplotlib.use("Agg")  # no display on the machines these run on
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.6), squeeze=False)
    for ax, (name, group) in zip(axes[0], series.items()):
        group = sorted(group, key=lambda r: r["x"])
        xs = [r["x"] for r in group]
        for method in group[0]["samples"]:
            ys = [r["bytes"] / statistics.median(r["samples"][method]) / 1e9 for r in group]
            is_roof = method == group[0]["roofline"]
            ax.plot(xs, ys, "k--" if is_roof else "-o", label=method, linewidth=2 if is_roof else 1.2,
                    markersize=3)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per tensor")
        ax.set_ylabel("GB/s (read + write)")
        ax.set_title(name, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(f"{environment['device']} ({environment['device_name']}), torch {environment['torch']}, "
                 f"{environment['date'][:10]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True
