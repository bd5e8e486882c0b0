"""Spawn the rank processes of a multi-rank test and collect what each rank wrote.

Each rank writes one JSON line per scenario to ``<out_dir>/rank<r>.jsonl`` and its log
to ``rank<r>.log`` (see two_rank_worker.run_rank). A hang is killed at the deadline and a
dead rank is reported; the records written until then are kept either way.
"""

import json
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from zero_lifetime.single_rank import exit_without_finalizing, free_port


def env_for_own_rank0() -> dict:
    """os.environ for a subprocess that sets up its own rank 0: without pytest's MASTER_PORT,
    which an engine test that ran earlier in this process still listens on."""
    return {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}


class RankResults:

    def __init__(self, out_dir: str, world: int, failure):
        self.world, self.failure = world, failure
        self.by_id, self.logs = {}, {}
        for rank in range(world):
            path = os.path.join(out_dir, f"rank{rank}.jsonl")
            if os.path.exists(path):
                with open(path) as f:
                    for line in f:
                        record = json.loads(line)
                        self.by_id.setdefault(record["id"], {})[rank] = record
            path = os.path.join(out_dir, f"rank{rank}.log")
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    self.logs[rank] = f.read()[-3000:]

    def assert_finished(self, expected_ids):
        """Every rank ended before the deadline and wrote each expected scenario, no other."""
        assert self.failure is None, f"{self.failure}; log tails: {self.logs}"
        assert sorted(self.by_id) == sorted(expected_ids)

    def records(self, sid):
        """Every rank's record of one scenario; fails the test when one is missing or raised."""
        per_rank = self.by_id.get(sid, {})
        for rank, record in sorted(per_rank.items()):
            assert record["error"] is None, f"{sid} raised on rank {rank}:\n{record['error']}"
        if len(per_rank) != self.world:
            last_line = (self.failure or "").strip().splitlines()[-1:]
            pytest.fail(f"{sid}: no result from ranks {sorted(set(range(self.world)) - set(per_rank))} "
                        f"(spawn: {last_line}; see the test that checks the ranks finished)")
        return [per_rank[rank] for rank in range(self.world)]


def assert_same_weights(got: dict, want: dict, rank: int, atol: float, rtol: float):
    """Two records' ``weights`` (param name -> values as lists) hold the same params, each
    equal within tolerance: an installed run held to another run of the same model."""
    assert sorted(got) == sorted(want), f"rank {rank}: different params {sorted(got)} vs {sorted(want)}"
    for name in want:
        torch.testing.assert_close(torch.tensor(got[name]), torch.tensor(want[name]), atol=atol, rtol=rtol,
                                   msg=lambda m: f"rank {rank} {name}: {m}")


def _run_rank_then_exit(rank, main, *args):
    """One rank's ``main``, then the end of its process without finalizing the interpreter
    (torch issue 117762: single_rank.exit_without_finalizing). An exception still goes to mp's
    own handler, which reports it."""
    main(rank, *args)
    exit_without_finalizing()


def spawn_ranks(main, out_dir: str, world: int, deadline_s: float, *extra_args) -> RankResults:
    """Run ``main(rank, out_dir, port, *extra_args)`` in ``world`` spawned processes."""
    ctx = mp.start_processes(_run_rank_then_exit, args=(main, out_dir, int(free_port()), *extra_args),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    failure = None
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                failure = f"ranks still running after {deadline_s} s: killed"
                break
    except Exception as exc:  # a rank raised or died: report it, keep what was written
        failure = f"{type(exc).__name__}: {exc}"
    finally:
        for process in ctx.processes:  # only the rank processes started above
            if process.is_alive():
                process.kill()
                process.join()
    return RankResults(out_dir, world, failure)
