"""Issue 4's targets, judged on the medians measured side by side (never asserted in tests)."""

from __future__ import annotations

import statistics
from typing import List, Optional, Tuple

Target = Tuple[str, str, Optional[bool]]

CPU_ROOFLINE_RATIO = 1.2
GPU_ROOFLINE_FRACTION, GPU_LARGE_BYTES = 0.9, 64 << 20
GPU_SPEEDUP_VS_LOOP, GPU_SPEEDUP_SHAPE = 5.0, (2000, 4096)
STEP_OVERHEAD = {"cpu": 0.03, "cuda": 0.01}
RETAINED_PEAK_OVER_STOCK = 0.05


def _median(result, method):
    return statistics.median(result["samples"][method])


def copy_targets(what: str, results, device: str, ours: str, stock: str, roofline: str) -> List[Target]:
    if not results:
        return []
    if device != "cuda":
        ratios = [(_median(r, ours) / _median(r, roofline), r["case"]) for r in results]
        worst, case = max(ratios)
        within = sum(ratio <= CPU_ROOFLINE_RATIO for ratio, _ in ratios)
        return [(f"{what} within {CPU_ROOFLINE_RATIO}x of the roofline (CPU)",
                 f"{within}/{len(ratios)} cases; worst {worst:.2f}x ({case})", within == len(ratios))]
    large = [r for r in results if r["bytes"] // 2 >= GPU_LARGE_BYTES]
    fractions = [_median(r, roofline) / _median(r, ours) for r in large]
    at_shape = [r for r in results if (r.get("n"), r.get("numel")) == GPU_SPEEDUP_SHAPE]
    speedups = [_median(r, stock) / _median(r, ours) for r in at_shape]
    return [
        _judged(f"{what} >= {GPU_ROOFLINE_FRACTION:.0%} of roofline bandwidth for >= 64 MB (GPU)",
                fractions, GPU_ROOFLINE_FRACTION, lambda worst: f"worst {worst:.0%} over {len(large)} cases",
                "no case of 64 MB or more in this run"),
        _judged(f"{what} >= {GPU_SPEEDUP_VS_LOOP:.0f}x faster than the per-param loop at 2000 x 4K (GPU)",
                speedups, GPU_SPEEDUP_VS_LOOP, lambda worst: f"worst {worst:.1f}x",
                "2000 x 4K not in this run (drop --quick)"),
    ]


def _judged(name: str, values, floor: float, describe, when_absent: str) -> Target:
    """A target met when the worst (smallest) value reaches ``floor``; unjudged without values."""
    if not values:
        return (name, when_absent, None)
    worst = min(values)
    return (name, describe(worst), worst >= floor)
