"""Logs through DeepSpeed's logger (rank 0 by default); stats() through DeepSpeed's monitor."""

import csv
import logging

import pytest

import deepspeed
import zero_lifetime
from harness import MODELS, ds_config, losses, make_input
from zero_lifetime import reporting


def test_stats_reach_the_deepspeed_monitor(tmp_path):
    model = MODELS["mlp_norm"]()
    cfg = ds_config(3)
    cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    zero_lifetime.install(engine, policy="pin")
    for step in range(2):
        l1, l2 = losses(engine(make_input("mlp_norm", step)))
        engine.backward(l1, retain_graph=True)
        engine.backward(l2)
        engine.step()
    files = {p.name: p for p in tmp_path.rglob("zero_lifetime_*.csv")}
    assert "zero_lifetime_peak_pinned_bytes.csv" in files and "zero_lifetime_bucket_fills.csv" in files, files
    assert "zero_lifetime_stage.csv" not in files and "zero_lifetime_policy.csv" not in files
    with open(files["zero_lifetime_peak_pinned_bytes.csv"]) as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "peak_pinned_bytes"] and len(rows) == 3, rows
    assert int(float(rows[-1][1])) == zero_lifetime.stats(engine)["peak_pinned_bytes"] > 0


def test_no_monitor_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = MODELS["mlp_norm"]()
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(2), model_parameters=model.parameters())
    zero_lifetime.install(engine)
    engine.backward(losses(engine(make_input("mlp_norm", 0)))[0])
    engine.step()
    assert not list(tmp_path.rglob("*.csv"))


@pytest.mark.parametrize("rank,all_ranks,logged", [(0, False, True), (1, False, False), (1, True, True)])
def test_logs_go_to_deepspeed_logger_from_rank_zero(monkeypatch, caplog, rank, all_ranks, logged):
    monkeypatch.setattr(reporting, "_rank", lambda: rank)
    if all_ranks:
        monkeypatch.setenv(reporting.ALL_RANKS_ENV, "1")
    logger = reporting.get_logger()
    assert logger.parent is logging.getLogger("DeepSpeed")  # DeepSpeed's handler and format
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=reporting.LOGGER_NAME):
            logger.info("hello from zero_lifetime")
    finally:
        logger.removeHandler(caplog.handler)
    assert any("hello from zero_lifetime" in r.message for r in caplog.records) == logged
