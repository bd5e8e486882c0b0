"""zero_lifetime.bench.memcpy_route: the segment size from which a GPU run says the cudaMemcpyAsync
route beats the fused kernel. Fed rows in profile_ops.py's JSON shape (the GPU run's output)."""

import json
import subprocess
import sys

import pytest

from profile_rows import profile_row
from zero_lifetime.bench.memcpy_route import threshold


def _rows(*cases):
    """cases: (segment bytes, (direct device us, wall us), (memcpy device us, wall us) or None)."""
    rows = []
    for segment_bytes, direct, memcpy in cases:
        case = f"fill 16 x {segment_bytes // 4} float32"
        ways = {"direct": direct, "roofline": (1.0, 1.0), **({"memcpy": memcpy} if memcpy else {})}
        rows += [profile_row(case, way, kernel_us, wall_us, segment_bytes)
                 for way, (kernel_us, wall_us) in ways.items()]
    return rows


WIN, LOSS, NARROW_WALL_LOSS = (100.0, 120.0), (140.0, 150.0), (99.0, 121.0)


@pytest.mark.parametrize("cases, expected", [
    # The route wins from 4 MB up: the smallest winning size above the last loss.
    ([(2 << 20, (100.0, 120.0), LOSS), (4 << 20, (150.0, 160.0), WIN), (16 << 20, (150.0, 160.0), WIN)], 4 << 20),
    # It wins everywhere: from the smallest size measured.
    ([(2 << 20, (150.0, 160.0), WIN), (16 << 20, (150.0, 160.0), WIN)], 2 << 20),
    # It loses the largest case: never, whatever it won below.
    ([(2 << 20, (150.0, 160.0), WIN), (16 << 20, (100.0, 120.0), LOSS)], None),
    # Less device time but more wall time (its host calls) is not a win.
    ([(2 << 20, (100.0, 120.0), NARROW_WALL_LOSS), (16 << 20, (150.0, 160.0), WIN)], 16 << 20),
    # A win below a loss does not count: the route would run at the losing size too.
    ([(2 << 20, (150.0, 160.0), WIN), (4 << 20, (100.0, 120.0), LOSS), (16 << 20, (150.0, 160.0), WIN)], 16 << 20),
    # Cases without the route (cast, too many segments) are not evidence either way.
    ([(2 << 20, (100.0, 120.0), None), (16 << 20, (150.0, 160.0), WIN)], 16 << 20),
    ([(2 << 20, (100.0, 120.0), None)], None),
])
def test_threshold_is_the_smallest_size_from_which_the_route_won_every_case(cases, expected):
    assert threshold(_rows(*cases)) == expected


def test_a_case_the_profiler_missed_counts_as_lost():
    rows = _rows((16 << 20, (150.0, 160.0), WIN))
    for row in rows:
        if row["way"] == "memcpy":
            row["kernel_s"] = float("nan")  # profile_ops' kernel time when the profiler recorded nothing
    assert threshold(rows) is None


@pytest.mark.parametrize("cases, printed", [
    ([(2 << 20, (100.0, 120.0), LOSS), (4 << 20, (150.0, 160.0), WIN)], str(4 << 20)),
    ([(4 << 20, (100.0, 120.0), LOSS)], "never"),
])
def test_command_prints_the_threshold_alone_on_its_last_line(tmp_path, cases, printed):
    """scripts/gpu_check.sh's route phase reads the last line of its output."""
    profile = tmp_path / "profile_cuda.json"
    profile.write_text(json.dumps({"device": "test", "torch": "x", "rows": _rows(*cases)}))
    proc = subprocess.run([sys.executable, "-m", "zero_lifetime.bench.memcpy_route", str(profile)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [printed]
    assert "kernel wins" in proc.stderr
