"""Re-run a few two-rank scenarios many times, to chase a result that does not come back.

    python tests/repeat_two_ranks.py SCENARIO_ID [--around 4] [--reps 30] [--max-seconds 1320]

Runs SCENARIO_ID and its neighbours in spawn order (``--around`` before it, ``--around`` - 1
after it) in one two-rank spawn per repetition, and prints per repetition every record of
either rank whose weights are outside the tests' tolerance of DDP (``bad=[]``: none).
Run it with the Python of the DeepSpeed release under test (e.g. ``.venv-ds0176/bin/python``).
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import two_rank_worker as worker  # noqa: E402
from rank_spawn import spawn_ranks  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario")
    parser.add_argument("--around", type=int, default=4)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--max-seconds", type=float, default=1320)
    args = parser.parse_args()
    ids = [sc["id"] for sc in worker.SCENARIOS]
    at = ids.index(args.scenario)
    only = ids[max(0, at - args.around):at + args.around]
    stop_at = time.monotonic() + args.max_seconds
    for rep in range(args.reps):
        if time.monotonic() > stop_at:
            break
        started = time.monotonic()
        results = spawn_ranks(worker.main, tempfile.mkdtemp(prefix="repeat_two_ranks_"), worker.WORLD, 600, only)
        bad = []
        for sid in only:
            for rank, record in enumerate(results.records(sid)):
                excess = [n for n, e in record.get("tol_excess", {}).items() if not e <= worker.ATOL]
                if excess:
                    bad.append((sid, rank, {n: record["abs_diff"][n] for n in excess}))
        print(f"rep {rep} {time.monotonic() - started:.0f}s failure={results.failure} "
              f"found={len(results.by_id)} bad={bad}", flush=True)


if __name__ == "__main__":
    main()
