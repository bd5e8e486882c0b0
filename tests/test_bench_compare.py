"""`python -m zero_lifetime.bench compare`: two runs' JSON files, judged against each run's own noise.

The verdicts are checked on runs built here with known per-round ratios (timings of real runs
are never asserted); one real `--quick` run checks that every benchmark's JSON is read.
"""

import json

import pytest

from test_bench_cli import run_cli
from zero_lifetime.bench import cli, compare

ENV = {"device": "cpu", "device_name": "Some CPU", "ranks": 1, "torch_threads": 2, "torch": "2.x",
       "deepspeed": "0.x", "fused_ops": "compiled", "git_commit": "abc", "date": "2026-11-26",
       "command": "python3 -m zero_lifetime.bench bucket --json /tmp/one.json"}


def case(name, fused_ratios, stock_ratio=40.0, roofline_ms=1.0):
    """A kernel-level case whose fused method takes fused_ratios[i] x the roofline in round i."""
    rounds = len(fused_ratios)
    roof = [roofline_ms * (1 + 0.3 * i) for i in range(rounds)]  # drift: absolute times move, ratios do not
    return {"bench": "bucket", "case": name, "ours": "fused", "stock": "loop", "roofline": "roofline",
            "samples": {"fused": [r * t for r, t in zip(fused_ratios, roof)],
                        "loop": [stock_ratio * t for t in roof], "roofline": roof}}


def run_file(tmp_path, name, results, targets=(("fill within 1.2x", True),), **env):
    path = tmp_path / name
    payload = {"environment": {**ENV, **env}, "results": results,
               "targets": [{"target": t, "measured": "x", "met": met} for t, met in targets]}
    path.write_text(json.dumps(payload))
    return str(path)


def compared(tmp_path, first, second, capsys, *extra):
    status = cli.main(["compare", first, second, *extra])
    return status, capsys.readouterr().out


def row(out, case_name, method):
    return next(line for line in out.splitlines() if line.startswith(f"| {case_name} | {method} |"))


def test_the_same_ratios_under_drift_agree(tmp_path, capsys):
    ratios = [1.10, 1.12, 1.08, 1.11, 1.09]
    first = run_file(tmp_path, "a.json", [case("8192 x 1K", ratios)])
    # Every absolute time doubled (a slower machine state), the same ratios round by round.
    second = run_file(tmp_path, "b.json", [case("8192 x 1K", ratios, roofline_ms=2.0)],
                      command="python3 -m zero_lifetime.bench bucket --json=/tmp/two.json")
    status, out = compared(tmp_path, first, second, capsys)
    assert status == 0, out
    assert row(out, "8192 x 1K", "fused").endswith("| +0.0% | same |")
    assert "WARNING" not in out  # only the output path differs
    assert "ratios of the zero_lifetime way (what the targets judge): 1 of 1 with overlapping IQRs" in out


def test_a_ratio_that_moved_beyond_both_runs_noise_fails(tmp_path, capsys):
    first = run_file(tmp_path, "a.json", [case("8192 x 1K", [1.10, 1.12, 1.08, 1.11, 1.09])])
    second = run_file(tmp_path, "b.json", [case("8192 x 1K", [1.50, 1.52, 1.49, 1.51, 1.48])])
    status, out = compared(tmp_path, first, second, capsys)
    assert status == 1
    fused = row(out, "8192 x 1K", "fused")
    assert "1.100x [1.090, 1.110]" in fused and "1.500x [1.490, 1.510]" in fused
    assert fused.endswith("| +36.4% | MOVED |")
    assert row(out, "8192 x 1K", "loop").endswith("| same |")  # the stock loop's ratio did not move


def test_tolerance_decides_between_separate_but_close_spreads(tmp_path, capsys):
    first = run_file(tmp_path, "a.json", [case("2000 x 4K", [1.00, 1.01, 1.00, 1.01, 1.00])])
    second = run_file(tmp_path, "b.json", [case("2000 x 4K", [1.05, 1.06, 1.05, 1.06, 1.05])])
    status, out = compared(tmp_path, first, second, capsys)
    assert status == 0 and row(out, "2000 x 4K", "fused").endswith("| within tolerance |"), out
    status, out = compared(tmp_path, first, second, capsys, "--tolerance", "0")
    assert status == 1 and row(out, "2000 x 4K", "fused").endswith("| MOVED |"), out
    status, out = compared(tmp_path, first, second, capsys, "--tolerance", "0.04")
    assert status == 1, out


def test_a_changed_target_verdict_fails_even_when_ratios_agree(tmp_path, capsys):
    results = [case("8192 x 1K", [1.19, 1.20, 1.21])]
    first = run_file(tmp_path, "a.json", results, targets=[("fill within 1.2x", True)])
    second = run_file(tmp_path, "b.json", results, targets=[("fill within 1.2x", False)])
    status, out = compared(tmp_path, first, second, capsys)
    assert status == 1
    assert "[CHANGED] fill within 1.2x: met (x) / MISSED (x)" in out
    assert "target verdicts: 1 of 1 changed" in out


def test_cases_of_one_run_only_and_other_experiments_are_reported(tmp_path, capsys):
    first = run_file(tmp_path, "a.json", [case("A", [1.0, 1.0]), case("B", [1.0, 1.0])])
    second = run_file(tmp_path, "b.json", [case("A", [1.0, 1.0]), case("C", [1.0, 1.0])],
                      device_name="Another CPU", command="python3 -m zero_lifetime.bench bucket --quick")
    status, out = compared(tmp_path, first, second, capsys)
    assert status == 0
    assert "only in the first run: B" in out and "only in the second run: C" in out
    assert "WARNING: different experiments, device_name: Some CPU vs Another CPU" in out
    assert "WARNING: different experiments, command: " in out


def test_a_different_cuda_memcpy_route_makes_a_different_experiment(tmp_path, capsys):
    """The same command measures another copy path when the compiled default route changed
    between the runs; a run recorded before the route existed never took it."""
    from zero_lifetime.ops import CUDA_MEMCPY_NEVER
    cuda = {"device": "cuda", "device_name": "Some GPU"}
    results = [case("A", [1.0, 1.0])]
    older = run_file(tmp_path, "older.json", results, **cuda)  # no route field: before the route
    never = run_file(tmp_path, "never.json", results, cuda_memcpy_segment_bytes=CUDA_MEMCPY_NEVER, **cuda)
    routed = run_file(tmp_path, "routed.json", results, cuda_memcpy_segment_bytes=1 << 20, **cuda)
    status, out = compared(tmp_path, older, never, capsys)
    assert status == 0 and "WARNING" not in out, out
    status, out = compared(tmp_path, older, routed, capsys)
    assert status == 0  # still compared, with the warning
    assert "WARNING: different experiments, cudaMemcpyAsync route: never vs from 1048576 B segments" in out
    # On the CPU the route takes no part: its recorded setting does not tell runs apart.
    cpu_never = run_file(tmp_path, "cpu_never.json", results, cuda_memcpy_segment_bytes=CUDA_MEMCPY_NEVER)
    cpu_routed = run_file(tmp_path, "cpu_routed.json", results, cuda_memcpy_segment_bytes=1 << 20)
    status, out = compared(tmp_path, cpu_never, cpu_routed, capsys)
    assert status == 0 and "WARNING" not in out, out


@pytest.mark.parametrize("content, message", [
    ("not json", "cannot read a benchmark JSON"),
    ('{"rows": []}', "expected the keys environment, results, targets"),
])
def test_a_file_that_is_not_a_run_exits_2(tmp_path, capsys, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    good = run_file(tmp_path, "a.json", [case("A", [1.0])])
    with pytest.raises(SystemExit) as exc:
        cli.main(["compare", good, str(bad)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_unpaired_rounds_are_refused():
    result = case("A", [1.0, 1.0, 1.0])
    result["samples"]["fused"].pop()
    with pytest.raises(compare.BenchFileError, match="not positive times paired round by round"):
        compare.compare_ratios({"results": [result]}, {"results": [result]})


def test_a_real_run_compared_with_itself_reads_every_benchmark(tmp_path, capsys):
    """Each benchmark's JSON as written, step and its peak bytes included: all cases agree with themselves."""
    out = tmp_path / "all.json"
    proc = run_cli("all", "--quick", "--repeats", "2", "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    status, printed = compared(tmp_path, str(out), str(out), capsys)
    assert status == 0, printed
    payload = json.loads(out.read_text())
    assert {r["bench"] for r in payload["results"]} == {"release", "gather", "bucket", "step"}
    for result in payload["results"]:
        assert f"| {result['case']} | " in printed, result["case"]
    assert "peak gathered, regather, retained two backwards: " in printed
    assert " 0 moved" in printed and "MOVED" not in printed


def test_a_changed_peak_of_gathered_bytes_fails(tmp_path, capsys):
    def retained(peak):
        result = case("retained step", [1.5, 1.5, 1.5])
        result.update(bench="step", ours=None, roofline=None,
                      peak_gathered_bytes={"stock, single backward": 1 << 20, "regather": peak})
        return [result]

    first = run_file(tmp_path, "a.json", retained(1 << 20))
    status, out = compared(tmp_path, first, run_file(tmp_path, "b.json", retained(1 << 20)), capsys)
    assert status == 0 and "[same   ] peak gathered, regather: 1.00 / 1.00 MiB" in out, out
    status, out = compared(tmp_path, first, run_file(tmp_path, "c.json", retained(3 << 20)), capsys)
    assert status == 1 and "[CHANGED] peak gathered, regather: 1.00 / 3.00 MiB" in out, out
