"""`python -m zero_lifetime.bench`: every sub-command runs on tiny sizes, its outputs are well formed.

Timings are never asserted: only that the benchmarks run, report and record what they measured.
"""

import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

from compiled import compiled_ops_or_skip
from rank_spawn import env_for_own_rank0
from zero_lifetime.bench import cli, ds_paths, sizes
from zero_lifetime.single_rank import shm_buffer_paths

REPO_ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(*args, timeout=120):
    # DeepSpeed benchmarks initialise torch.distributed: a subprocess keeps pytest's process clean.
    return subprocess.run([sys.executable, "-m", "zero_lifetime.bench", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env_for_own_rank0())


def load(path):
    payload = json.loads(Path(path).read_text())
    env = payload["environment"]
    for key in ("device", "torch", "deepspeed", "git_commit", "date", "ranks"):
        assert key in env, key
    assert env["device"] == "cpu"
    return payload


DS_PATH_METHODS = {"bucket": {ds_paths.BUCKET_STOCK, ds_paths.BUCKET_OURS, ds_paths.ROOFLINE},
                   "gather": {ds_paths.GATHER_STOCK, ds_paths.GATHER_OURS, ds_paths.ROOFLINE}}


def assert_deepspeed_path_rows(payload, command):
    """One DeepSpeed-path case per quick shape: DeepSpeed's own method vs ours, positive samples, a speedup note."""
    cases = [r for r in payload["results"] if r.get("path") == "deepspeed"]
    assert [(r["n"], r["numel"]) for r in cases] == [tuple(s) for s in sizes.QUICK]
    for result in cases:
        assert set(result["samples"]) == DS_PATH_METHODS[command]
        assert all(s and all(t > 0 for t in s) for s in result["samples"].values()), result["case"]
        assert any(note.startswith("DeepSpeed-path speedup (stock / ours): ") for note in result["notes"])


@pytest.mark.parametrize("command, extra, methods", [
    ("release", [], {"stock coordinator.release_sub_module", "pin: last handle dies -> release"}),
    ("step", ["--ranks", "2", "--repeats", "2"], {"stock", "installed", "regather, retained two backwards"}),
    ("gather", ["--ranks", "2", "--repeats", "2"], {"stock all_gather_coalesced + per-param cat",
                                                    "fused gather_copy_out"}),
])
def test_deepspeed_subcommands_run_and_record_samples(tmp_path, command, extra, methods):
    out = tmp_path / "bench.json"
    proc = run_cli(command, "--quick", "--json", str(out), *extra)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "| case | method |" in proc.stdout
    payload = load(out)
    # DeepSpeed never unlinks its CPU all-reduce buffers (66 MB of RAM each): the bench's own runs
    # must. Only its own ports are looked at, so other jobs of this user cannot fail the test.
    ports = payload["environment"]["own_master_ports"]
    assert len(ports) == (2 if "--ranks" in extra else 1), ports
    assert [path for port in ports for path in shm_buffer_paths(port, addr="*")] == []
    seen = set()
    for result in payload["results"]:
        assert result["bench"] == command
        for method, samples in result["samples"].items():
            assert samples and all(s > 0 for s in samples), method
            seen.add(method)
        assert len(result["summary"]) == len(result["samples"])
    assert methods <= seen, seen
    if command == "gather":  # the 2-rank all-gather ran, and its installed engine took the fused path
        assert_deepspeed_path_rows(payload, "gather")
        two_ranks = [r for r in payload["results"] if r.get("ranks") == 2]
        assert two_ranks and all("installed: fused copy-out wait" in r["samples"] for r in two_ranks)
    if command == "step":
        assert_step_rows(payload)


def assert_step_rows(payload):
    """The steps ran on 1 rank and on 2, and on 2 ranks the installed engines took the paths
    that only run there: fused ZeRO-3 gathers and the ZeRO-1/2 bucket-layout check."""
    by_ranks = {1: [], 2: []}
    for result in payload["results"]:
        by_ranks[result.get("ranks", 1)].append(result)
    for ranks, results in by_ranks.items():
        assert [r["stage"] for r in results] == [3, 2, 3], (ranks, [r["case"] for r in results])
        retained = results[2]
        assert all(v > 0 for v in retained["peak_gathered_bytes"].values()), retained["peak_gathered_bytes"]
        zero3, zero2 = results[0]["fused_work"], results[1]["fused_work"]
        # Only 0.18.9 builds the flat buffers in grad mode; its stock step needs them detached.
        detached = any("detached from autograd" in note for note in results[1]["notes"])
        assert detached == (payload["environment"]["deepspeed"] == "0.18.9"), results[1]["notes"]
        assert zero3["bucket_fills"] > 0 and zero2["bucket_fills"] > 0
        if ranks == 2:
            assert zero3["fused_gathers"] > 0 and zero3["stock_gathers"] == 0, zero3
            assert zero2["bucket_order_checks"] > 0, zero2
        else:  # one rank gathers nothing and has no one to compare layouts with
            assert zero3["fused_gathers"] == 0 and zero2["bucket_order_checks"] == 0
    targets = [t["target"] for t in payload["targets"]]
    for stage in (3, 2):
        assert f"install overhead on a ZeRO-{stage} step under 3% (cpu)" in targets
        assert f"install overhead on a ZeRO-{stage} step under 3% (cpu, 2 ranks)" in targets
    assert sum(t.startswith("regather peak") for t in targets) == 2


def test_bucket_in_process_json_plot_and_targets(tmp_path, capsys):
    out, png = tmp_path / "bucket.json", tmp_path / "bucket.png"
    assert cli.main(["bucket", "--quick", "--repeats", "2", "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr()
    assert "within 1.2x of the roofline (CPU)" in printed.out
    assert "] 6/6 " in printed.err  # the progress bar went to stderr
    assert "DeepSpeed-path speedup (stock / ours): " in printed.out
    payload = load(out)
    assert {r["bench"] for r in payload["results"]} == {"bucket"}
    assert all(len(s) == 2 for r in payload["results"] for s in r["samples"].values())
    assert_deepspeed_path_rows(payload, "bucket")
    assert png.read_bytes()[:8] == PNG_MAGIC


def engines_alive() -> int:
    from deepspeed.runtime.engine import DeepSpeedEngine
    gc.collect()
    return sum(isinstance(obj, DeepSpeedEngine) for obj in gc.get_objects())


def test_gather_one_rank_in_process(tmp_path):
    out, png = tmp_path / "gather.json", tmp_path / "gather.png"
    before = engines_alive()
    assert cli.main(["gather", "--quick", "--repeats", "2", "--json", str(out), "--plot", str(png)]) == 0
    assert engines_alive() == before  # its ZeRO-3 engines (installed) were let go of
    assert_deepspeed_path_rows(load(out), "gather")
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("installed", [False, True], ids=["stock", "installed"])
@pytest.mark.parametrize("stage", [3, 2])
def test_discarded_bench_engines_are_freed(stage, installed):
    """The bench builds engine after engine in one process, and stock DeepSpeed keeps each
    destroyed ZeRO-3 engine and its model alive to the process's end: discard() lets go of
    stock and installed engines alike, after a training step."""
    import torch

    import zero_lifetime
    from zero_lifetime.bench.engines import ParamBlock, discard, make_engine
    engine = make_engine(ParamBlock(3, 16), stage)
    if installed:
        zero_lifetime.install(engine)
    engine.backward(engine(torch.ones(8)).sum())
    engine.step()
    engine_alive, model_alive = weakref.ref(engine), weakref.ref(engine.module)
    discard(engine)
    del engine
    gc.collect()
    assert engine_alive() is None and model_alive() is None


def test_peak_probe_lets_go_of_its_engine_when_left():
    """The step bench's probe hooks every param's gradient, and a hook reaching its engine is a
    cycle through torch's C++ side that gc cannot break: leaving the probe must remove them."""
    import torch

    from zero_lifetime.bench.engines import ParamBlock, discard, make_engine
    from zero_lifetime.bench.step import PeakGathered
    engine = make_engine(ParamBlock(3, 16), 3)
    with PeakGathered(engine) as probe:
        engine.backward(engine(torch.ones(8)).sum())
        engine.step()
    assert probe.peak > 0 and probe.handles == []
    engine_alive = weakref.ref(engine)
    discard(engine)
    del engine, probe
    gc.collect()
    assert engine_alive() is None


@pytest.mark.parametrize("argv", [[], ["nope"], ["bucket", "--repeats", "0"], ["bucket", "--ranks", "3"],
                                  ["gather", "--device", "tpu"]])
def test_bad_arguments_exit_2_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("installed, expected", [("0.16.9", "DeepSpeed 0.16.9 is not supported"),
                                                  (None, "DeepSpeed is not installed")])
def test_unsupported_deepspeed_is_a_clear_error_before_any_run(monkeypatch, capsys, installed, expected):
    from importlib import metadata

    def version(package):
        if installed is None:
            raise metadata.PackageNotFoundError(package)
        return installed
    monkeypatch.setattr(metadata, "version", version)
    with pytest.raises(SystemExit) as exc:
        cli.main(["release", "--quick"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "0.17.6, 0.18.9, 0.19.8" in err, err


def test_cuda_without_gpu_is_a_clear_error_not_a_traceback():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = run_cli("gather", "--quick", "--device", "cuda", timeout=60)
    assert proc.returncode == 2
    assert "--device cuda needs a CUDA GPU" in proc.stderr
    assert "Traceback" not in proc.stderr


def _copy_result(n, numel, nbytes, ours, stock, roofline):
    return {"case": f"{n} x {numel}", "n": n, "numel": numel, "bytes": nbytes,
            "samples": {"ours": [ours], "stock": [stock], "roofline": [roofline]}}


def test_gpu_copy_targets_judge_the_worst_case_and_say_when_absent():
    """The CUDA branch of the copy targets, judged here on given medians (CI has no GPU)."""
    from zero_lifetime.bench.targets import copy_targets
    at_shape = _copy_result(2000, 4096, 2 * 2000 * 4096 * 4, ours=1.0, stock=10.0, roofline=0.5)
    large = [_copy_result(16, 1 << 20, 2 * (64 << 20), ours=0.07, stock=0.1, roofline=0.06),
             _copy_result(16, 1 << 22, 2 * (256 << 20), ours=0.2, stock=0.3, roofline=0.19)]
    (bandwidth, speed) = copy_targets("fill", [at_shape, *large], "cuda", "ours", "stock", "roofline")
    assert bandwidth[1:] == ("worst 86% over 2 cases", False)  # 0.06 / 0.07: the worst of the two
    assert speed[1:] == ("worst 10.0x", True)
    (bandwidth, speed) = copy_targets("fill", [at_shape], "cuda", "ours", "stock", "roofline")
    assert bandwidth[2] is None and "no case of 64 MB" in bandwidth[1]
    (bandwidth, speed) = copy_targets("fill", large, "cuda", "ours", "stock", "roofline")
    assert speed[2] is None and bandwidth[2] is False


def test_step_overhead_is_judged_round_by_round():
    """The load moved up before round 3's installed step ran: the ratio of the medians would
    call that +102%; the rounds' own ratios say +1% (stock and installed of a round share it)."""
    from zero_lifetime.bench import step
    result = {"case": "ZeRO-3 single-backward step, tiny", "stage": 3,
              "samples": {step.STOCK: [100.0, 100.0, 100.0, 200.0, 200.0],
                          step.INSTALLED: [101.0, 101.0, 202.0, 202.0, 202.0]}}
    ((name, measured, met), ) = step.targets([result], "cpu")
    assert name == "install overhead on a ZeRO-3 step under 3% (cpu)"
    assert measured.startswith("+1.00% ") and met is True
    assert "too few for a 95% interval" in measured
    ((name, measured, met), ) = step.targets([dict(result, ranks=2)], "cuda")
    assert name == "install overhead on a ZeRO-3 step under 1% (cuda, 2 ranks)" and met is False


@pytest.mark.parametrize("installed, noise", [
    # 20 rounds of 100 ms stock; the 95% interval of the median is the 6th..15th ratio.
    ([100.0 + 0.1 * i for i in range(20)], False),                  # interval +0.5% to +1.4%: below 3%
    ([90.0 + i for i in range(20)], True),                          # interval -5% to +4%: spans 3%
])
def test_step_overhead_says_when_its_verdict_is_noise(installed, noise):
    from zero_lifetime.bench import step
    result = {"case": "ZeRO-2 single-backward step, tiny", "stage": 2,
              "samples": {step.STOCK: [100.0] * 20, step.INSTALLED: installed}}
    ((_, measured, _), ) = step.targets([result], "cpu")
    low, high = sorted(installed)[5] / 100 - 1, sorted(installed)[14] / 100 - 1
    assert f"95% interval {low:+.2%} to {high:+.2%}" in measured
    assert ("within noise, rerun with more --repeats" in measured) is noise


@pytest.mark.parametrize("argv, expected", [
    (["bucket", "--quick", "--cuda-memcpy-segment-bytes", "0"], "applies to --device cuda only"),
    (["bucket", "--quick", "--cuda-memcpy-segment-bytes", "-1"], "must be at least 0, got -1"),
])
def test_memcpy_route_option_is_refused_where_it_cannot_apply(argv, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err


def test_memcpy_route_option_is_refused_without_the_compiled_ops(monkeypatch, capsys):
    """The pure-torch fallback has no such route: the option is refused, not ignored."""
    from zero_lifetime import ops
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(ops, "native_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        cli.main(["bucket", "--quick", "--device", "cuda", "--cuda-memcpy-segment-bytes", "4096"])
    assert exc.value.code == 2
    assert "--cuda-memcpy-segment-bytes needs the compiled ops, which are not loaded" in capsys.readouterr().err


@pytest.mark.parametrize("run_fails", [False, True])
def test_memcpy_route_option_holds_for_the_run_only(run_fails, monkeypatch):
    """The option is the run's setting, not the caller's: cli.main([...]) from Python leaves the
    route as it found it, also when the run raises. The GPU is stood in for (torch sees one, the
    run records the route it saw); the real CUDA run is the GPU-only test below."""
    compiled_ops_or_skip()
    from zero_lifetime import ops
    seen = []

    def fake_run(args):
        seen.append(ops.cuda_memcpy_segment_bytes())
        if run_fails:
            raise RuntimeError("run failed")
        return 0

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(cli, "run", fake_run)
    before = ops.cuda_memcpy_segment_bytes()
    argv = ["bucket", "--quick", "--device", "cuda", "--cuda-memcpy-segment-bytes", "4096"]
    if run_fails:
        with pytest.raises(RuntimeError, match="run failed"):
            cli.main(argv)
    else:
        assert cli.main(argv) == 0
    assert seen == [4096]
    assert ops.cuda_memcpy_segment_bytes() == before != 4096


def test_rank_workers_copy_with_the_launchers_memcpy_route(tmp_path, monkeypatch):
    """bench --cuda-memcpy-segment-bytes sets the route in the launching process; the ranks of
    `gather --ranks 2` and `step --ranks 2` are processes of their own and must get it too."""
    compiled_ops_or_skip()
    from zero_lifetime import ops
    from zero_lifetime.bench.rank_launch import run_worker
    (tmp_path / "route_probe_worker.py").write_text(
        "import torch.distributed as dist\n"
        "from zero_lifetime import ops\n"
        "from zero_lifetime.bench.rank_launch import worker_main\n"
        "def work(spec):\n"
        "    dist.init_process_group('gloo')\n"
        "    return [{'case': 'probe', 'route': ops.cuda_memcpy_segment_bytes(), 'spec': sorted(spec)}]\n"
        "worker_main(work)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{REPO_ROOT}")
    with ops.cuda_memcpy_route(123457):
        results = run_worker("route_probe_worker", {"device": "cpu"}, 2, "cpu", 120, "probe")
    assert results == [{"case": "probe", "route": 123457, "spec": ["device"]}]


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no GPU")
def test_cuda_bench_records_the_memcpy_route_it_ran_with(tmp_path):
    out = tmp_path / "bucket.json"
    proc = run_cli("bucket", "--quick", "--repeats", "2", "--device", "cuda", "--cuda-memcpy-segment-bytes", "4096",
                   "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "cudaMemcpyAsync route from 4096 B segments" in proc.stdout
    assert json.loads(out.read_text())["environment"]["cuda_memcpy_segment_bytes"] == 4096


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no GPU")
def test_cuda_bench_run_in_process_gives_the_memcpy_route_back(tmp_path):
    """The option is the run's setting, not the caller's: cli.main([...]) from Python leaves
    the route as it found it."""
    from zero_lifetime import ops
    before = ops.cuda_memcpy_segment_bytes()
    assert cli.main(["bucket", "--quick", "--repeats", "1", "--device", "cuda", "--cuda-memcpy-segment-bytes",
                     "4096", "--json", str(tmp_path / "bucket.json")]) == 0
    assert json.loads((tmp_path / "bucket.json").read_text())["environment"]["cuda_memcpy_segment_bytes"] == 4096
    assert ops.cuda_memcpy_segment_bytes() == before
