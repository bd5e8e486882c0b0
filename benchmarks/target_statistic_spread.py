"""How much two statistics of one benchmark case move from run to run.

    python benchmarks/target_statistic_spread.py RUN1.json RUN2.json ...   (`bench ... --json` files)

For every kernel-level copy case (ours / roofline) and every single-backward step case
(installed / stock) in the files: the ratio of the two methods' medians, and the median of
the per-round ratios (what `bench compare` uses); the lowest and highest of each over the
runs, and their spread. Cases are matched by name (model details dropped; 2-rank steps apart).
"""

import json
import statistics
import sys

from zero_lifetime.bench.timing import paired_ratios


def ratios(result, ours, reference):
    samples = result["samples"]
    of_medians = statistics.median(samples[ours]) / statistics.median(samples[reference])
    per_round = statistics.median(paired_ratios(samples, ours, reference))  # what the step target judges
    return of_medians, per_round


def main(paths):
    cases = {}
    for path in paths:
        with open(path) as f:
            results = json.load(f)["results"]
        for r in results:
            if r.get("path") == "deepspeed" or r.get("ranks", 1) > 1 and r["bench"] != "step":
                continue
            if r["bench"] in ("bucket", "gather") and r.get("roofline") in r["samples"]:
                pair = ratios(r, r["ours"], r["roofline"])
            elif r["bench"] == "step" and "single-backward" in r["case"]:
                pair = ratios(r, "installed", "stock")
            else:
                continue
            name = r["case"].split(", ")[0] + (f", {r['ranks']} ranks" if r.get("ranks", 1) > 1 else "")
            cases.setdefault(name, []).append(pair)
    print(f"{'case':56s} {'runs':>4s}  {'ratio of medians':>24s}  {'median of per-round ratios':>26s}")
    for case, pairs in cases.items():
        cells = []
        for values in zip(*pairs):
            cells.append(f"{min(values):.3f}-{max(values):.3f} ({max(values) - min(values):.3f})")
        print(f"{case:56s} {len(pairs):4d}  {cells[0]:>24s}  {cells[1]:>26s}")


if __name__ == "__main__":
    main(sys.argv[1:])
