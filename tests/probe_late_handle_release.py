"""How often, and for how long, a dropped graph's saved-param handles outlive the drop on 2 ranks.

The figures behind docs/reliability.md's "Random programs on 2 ranks" section: random programs
of one case (default: ZeRO-3 "pin", CPU optimizer offload, GAS 2, ckpt_nonreentrant, where it
was seen), repeated, each check after the last graph was dropped timing how long the live
handles took to reach 0 (lifetime_programs waits up to a second on several ranks), with the
Python threads and the process's native threads then. Not collected
by pytest; run it as a script (about 4 minutes for the defaults):

    DS_ACCELERATOR=cpu python3 tests/probe_late_handle_release.py [case-id-prefix] [reps] [seeds]
"""

import json
import os
import sys
import tempfile
import time

_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TESTS, os.path.dirname(_TESTS)]  # the tests' helpers, and zero_lifetime itself

import two_rank_programs_worker as worker  # noqa: E402
import two_rank_worker  # noqa: E402

LATE = []  # per rank process: seconds each late release took


def _native_thread_names():
    """Every thread of this process as the kernel names it (Python's, gloo's, torch's)."""
    tasks = "/proc/self/task"
    names = []
    for task in os.listdir(tasks):
        with open(os.path.join(tasks, task, "comm")) as comm:
            names.append(comm.read().strip())
    return sorted(names)


def _timed_run(case, rank):
    import threading

    import lifetime_programs
    if not LATE:
        LATE.append(None)  # patched once per process
        wait = lifetime_programs.ProgramRunner._gathered_once_other_threads_let_go

        def timed(self):
            started = time.perf_counter()
            gathered = wait(self)
            LATE.append((round(time.perf_counter() - started, 4), [t.name for t in threading.enumerate()],
                         _native_thread_names()))
            return gathered
        lifetime_programs.ProgramRunner._gathered_once_other_threads_let_go = timed
    before = len(LATE)
    record = worker._run_case(case, rank)
    record["late"] = LATE[before:]
    return record


def _main(rank, out_dir, port, cases):
    two_rank_worker.run_rank(rank, out_dir, port, cases, _timed_run)


def main():
    from harness import DS_VERSION, MODELS
    from rank_spawn import spawn_ranks
    prefix = sys.argv[1] if len(sys.argv) > 1 else "gas2_offload-stage3-pin-ckpt_nonreentrant"
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    seeds = range(int(sys.argv[3]) if len(sys.argv) > 3 else 15)
    chosen = [c for c in worker.cases(sorted(MODELS), seeds, 40, DS_VERSION) if c["id"].startswith(prefix)]
    cases = [dict(c, id=f"{c['id']}#{rep}") for rep in range(reps) for c in chosen]
    with tempfile.TemporaryDirectory() as out:
        results = spawn_ranks(_main, out, 2, 3000, cases)
    late = [(sid, rank, r["late"]) for sid, by_rank in results.by_id.items() for rank, r in by_rank.items()
            if r.get("late")]
    failed = {f"{sid} rank {rank}": r["error"].strip().splitlines()[-12:]
              for sid, by_rank in results.by_id.items() for rank, r in by_rank.items() if r["error"]}
    print(json.dumps({"programs": len(cases), "spawn_failure": results.failure, "failed": len(failed),
                      "first_failures": dict(list(failed.items())[:2]), "late_releases": late}, indent=1))


if __name__ == "__main__":
    main()
