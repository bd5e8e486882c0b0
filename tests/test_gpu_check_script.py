"""scripts/gpu_check.sh, the GPU session's one command, run here with stand-ins for the GPU tools.

A lent GPU machine gives a session 15 minutes and 10 a command, and returns at most 8 files:
the script must end inside its deadline with every log packed in one archive, and say which
commands were cut or skipped. A broken script would cost a GPU session; CI has no GPU, so this
checks it with a ``compute-sanitizer`` stand-in that hangs.
"""

import json
import os
import re
import subprocess
import tarfile
import time

from profile_rows import profile_row

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stand_in(directory, name, body):
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body + "\n")
    os.chmod(path, 0o755)


def _run_with_sanitizer(tmp_path, sanitizer_body, phases, env):
    """gpu_check.sh PHASES with a compute-sanitizer stand-in running SANITIZER_BODY; $OUT is tmp_path/out."""
    shims = tmp_path / "bin"
    shims.mkdir()
    _stand_in(str(shims), "compute-sanitizer", sanitizer_body)
    env = {**env, "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    return subprocess.run(["bash", "scripts/gpu_check.sh", *phases], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_deadline_cuts_and_skips_and_every_log_is_packed(tmp_path):
    out = tmp_path / "out"
    started = time.monotonic()
    # A sanitizer run that would outlast the call.
    result = _run_with_sanitizer(tmp_path, "exec sleep 120", ["sanitize", "sanitize_tests"],
                                 {**os.environ, "ZL_GPU_DEADLINE_S": "30", "PYTHONPATH": REPO})
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr  # failures reported, not hidden
    assert elapsed < 60, f"{elapsed:.0f}s: the hanging sanitizer (120 s) was not cut at the 30 s deadline"
    summary = (out / "summary.log").read_text()
    # The first sanitizer run is cut at what is left of the deadline (30 s less 15 kept for
    # packing, less the script's own start), the later ones are skipped.
    assert re.search(r"== sanitize_paths_memcheck: rc 124: CUT at 1[0-5]s", summary), summary
    for tool in ("racecheck", "initcheck", "synccheck"):
        assert f"== sanitize_paths_{tool}: SKIPPED" in summary, summary
    assert "== sanitize_memcheck_tests: SKIPPED" in summary, summary
    # Two files come back: the summary and one archive with the log of every command that ran.
    assert sorted(os.listdir(out)) == ["gpu_check.tar.gz", "summary.log"]
    with tarfile.open(out / "gpu_check.tar.gz") as archive:
        logs = sorted(os.path.basename(n) for n in archive.getnames() if n.endswith(".log"))
    assert logs == ["sanitize_paths_memcheck.log"]


def test_scripts_in_subfolders_see_the_repo_root(tmp_path):
    """`python3 tests/kernel_paths.py` puts tests/ on sys.path, not the repo root, and the GPU
    machine has no install of this package: the script must put the root on PYTHONPATH itself
    (the first H200 run lost its sanitizer and profile phases to that import error)."""
    result = _run_with_sanitizer(tmp_path, 'echo "PYTHONPATH=$PYTHONPATH"', ["sanitize"],
                                 {k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert result.returncode == 0, result.stdout + result.stderr
    with tarfile.open(tmp_path / "out" / "gpu_check.tar.gz") as archive:
        log = archive.extractfile("gpu_check/sanitize_paths_memcheck.log").read().decode()
    entries = log.strip().split("=", 1)[1].split(os.pathsep)
    assert os.path.realpath(REPO) in [os.path.realpath(e) for e in entries if e], log


def test_unknown_phase_is_an_error(tmp_path):
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "benchmark"], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "OUT": str(tmp_path)}, timeout=60)
    assert result.returncode == 2
    assert "unknown phase: benchmark" in result.stdout


def _run_route(tmp_path, rows):
    """gpu_check.sh route after a bench phase that left profile_cuda.json with ROWS (None: no file)."""
    work = tmp_path / "out" / "gpu_check"
    work.mkdir(parents=True)
    if rows is not None:
        (work / "profile_cuda.json").write_text(json.dumps({"device": "test", "rows": rows}))
    # One round a case: on a GPU machine the benches really run.
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHONPATH": REPO, "ZL_GPU_DEADLINE_S": "200",
           "ZL_BENCH_REPEATS": "1"}
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "route"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    return result, (tmp_path / "out" / "summary.log").read_text()


def test_route_phase_benches_again_with_the_route_from_where_it_won(tmp_path):
    """One device call brings back the kernel's figures (bench) and the route's (route): here the
    route won from 4 MiB segments, so bench bucket and gather run with it from there. (On this
    machine they stop at --device cuda, with the option on their command line.)"""
    rows = [profile_row("fill 16 x 512K", "direct", 100, 120, 2 << 20),
            profile_row("fill 16 x 512K", "memcpy", 140, 150, 2 << 20),
            profile_row("fill 16 x 1M", "direct", 150, 160, 4 << 20),
            profile_row("fill 16 x 1M", "memcpy", 100, 120, 4 << 20)]
    result, summary = _run_route(tmp_path, rows)
    for bench in ("bucket", "gather"):
        assert re.search(rf"== bench_route_{bench} \(at most \d+s\): python3 -m zero_lifetime.bench {bench} "
                         rf"--device cuda --cuda-memcpy-segment-bytes {4 << 20} ", summary), summary
    if not __import__("torch").cuda.is_available():
        assert result.returncode == 1 and "--device cuda needs a CUDA GPU" in summary, summary


def test_route_phase_runs_nothing_more_when_the_kernel_won(tmp_path):
    rows = [profile_row("fill 16 x 1M", "direct", 100, 120, 4 << 20),
            profile_row("fill 16 x 1M", "memcpy", 140, 150, 4 << 20)]
    result, summary = _run_route(tmp_path, rows)
    assert result.returncode == 0, summary
    assert "== route: the kernel won a case with the largest segments; nothing more to run" in summary
    assert "bench_route" not in summary


def test_route_phase_without_the_bench_phase_says_so(tmp_path):
    result, summary = _run_route(tmp_path, None)
    assert result.returncode == 1
    assert "== route: SKIPPED, no " in summary and "(the bench phase makes it)" in summary
