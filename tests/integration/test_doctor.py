"""`orchestrator doctor` and the cost ledger on a real run: prefetch disabled and a slowed reader (a user transform
that sleeps on every block, re-read every epoch with the cache off), so the loop mostly waits for data; doctor must
name the data pipeline, and, this run being 40 steps, its start-up. The same run's MLflow record carries the cost
metrics and the start-up breakdown, and the summary prints the ledger."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator import load_config, train
from orchestrator.cli import main
from orchestrator.launch import summary

pytestmark = pytest.mark.slow


def test_doctor_names_the_data_pipeline_and_start_up_and_the_run_has_a_cost(
        ray_cluster: None, tmp_path: Path, digits_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlruns.db"
    result = train(load_config(None, [
        f"data.train={digits_dir}/train", f"data.val={digits_dir}/val", f"storage.path={tmp_path}/runs",
        f"tracking.uri={uri}", "tracking.experiment=tests", "scaling.num_workers=2", "train.max_steps=40",
        "train.log_every=10", "train.eval_every=40", "checkpoint.every=40", "data.prefetch_batches=0",
        "data.cache=none", "data.transforms=[{call: {fn: 'slow_reader:slow', kwargs: {seconds: 0.1}}}]",
        "cost.price_per_hour=3.6",
    ]), verbose=False)
    assert result.run_id is not None

    metrics = MlflowClient(uri).get_run(result.run_id).data.metrics
    assert metrics["cost/usd"] == pytest.approx(metrics["cost/node_hours"] * 3.6)
    assert metrics["cost/productive_usd"] + metrics["cost/overhead_usd"] == pytest.approx(metrics["cost/usd"])
    assert metrics["cost/startup_frac"] > 0 and metrics["cost/productive_frac"] < 1
    assert "cost: $" in summary(result)

    assert main(["doctor", result.run_id, "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    # Ray forwards raylet warnings to the driver's stdout at any moment, so find the report by its header.
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("doctor: run "))
    findings = [line for line in lines[header + 1:] if line[:1].isdigit()]
    assert [f.split("] ")[1].split(":")[0] for f in findings] == ["start-up", "data pipeline"], out
    assert "--set data.prefetch_batches=4" in out and "--set data.cache=memory" in out
    # The start-up breakdown is in the run: its stages add up to the time before the first step.
    stages = {k: v for k, v in metrics.items() if k.startswith("startup/") and k != "startup/total_s"}
    assert len(stages) == 8 and sum(stages.values()) == pytest.approx(metrics["startup/total_s"])
    assert f"slowest: {max(stages, key=stages.__getitem__)[8:-2].replace('_', ' ')}" in findings[0]


def test_doctor_on_an_unknown_run_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "0123456789abcdef", "--tracking-uri", f"sqlite:///{tmp_path}/empty.db"]) == 2
    assert "error: MLflow run '0123456789abcdef' not found" in capsys.readouterr().err
