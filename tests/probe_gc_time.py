"""The figures behind docs/reliability.md's "what each test leaves alive" section: time the
test process spends in garbage collection, per test. A pytest plugin, not a test file:

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$HOME/.cache/torch_extensions/deepspeed-0.17.6 \\
      ZL_GC_LOG=/tmp/gc.tsv PYTHONPATH=.:tests .venv-ds0176/bin/python -m pytest -q -p no:cacheprovider \\
      -p probe_gc_time tests/test_accumulation_boundary_by_hand.py ... tests/test_install_api.py

One line per test: node id, seconds (the whole protocol, the conftest's collection after it
included), seconds in gc, collections, full collections, tracked objects outside the frozen
set at the first test of each file. The totals are printed at the end of the session.
"""

import gc
import os
import time

import pytest

_totals = {"test_s": 0.0, "gc_s": 0.0}
_in_gc = {"started": 0.0, "seconds": 0.0, "collections": 0, "full": 0}


def _time_collection(phase, info):
    if phase == "start":
        _in_gc["started"] = time.perf_counter()
        return
    _in_gc["seconds"] += time.perf_counter() - _in_gc["started"]
    _in_gc["collections"] += 1
    _in_gc["full"] += info["generation"] == 2


def pytest_configure(config):
    config._zl_gc_log = open(os.environ.get("ZL_GC_LOG", "gc_time.tsv"), "w", buffering=1)
    config._zl_gc_last_file = None
    gc.callbacks.append(_time_collection)


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: it times the conftest's collection too
def pytest_runtest_protocol(item, nextitem):
    before = dict(_in_gc)
    started = time.perf_counter()
    reports = yield
    seconds = time.perf_counter() - started
    config = item.config
    test_file = item.nodeid.split("::")[0]
    tracked = len(gc.get_objects()) if test_file != config._zl_gc_last_file else ""
    config._zl_gc_last_file = test_file
    in_gc = _in_gc["seconds"] - before["seconds"]
    _totals["test_s"] += seconds
    _totals["gc_s"] += in_gc
    config._zl_gc_log.write(f"{item.nodeid}\t{seconds:.2f}\t{in_gc:.2f}\t{_in_gc['collections'] - before['collections']}"
                            f"\t{_in_gc['full'] - before['full']}\t{tracked}\n")
    return reports


def pytest_unconfigure(config):
    gc.callbacks.remove(_time_collection)
    config._zl_gc_log.close()
    print(f"\nprobe_gc_time: {_totals['test_s']:.1f} s in tests, {_totals['gc_s']:.1f} s of it in gc")
