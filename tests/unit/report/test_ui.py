"""What a user sees of a run in the MLflow UI, without Ray: the headline charts (loss, the task's validation metric,
samples/s) in the section that sorts first, run-level figures in a rounded, grouped summary table and the run's
description instead of single-point metrics, constants kept out of the charts by their values, params without
nulls or the study's keys, the datasets as run inputs, short run names, and URLs that open the training view.
One real SQLite store, read back through MlflowClient."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from orchestrator.config import load_config
from orchestrator.tracking.client import MlflowTracker
from orchestrator.tracking.context import config_params
from orchestrator.tracking.links import experiment_url, run_url, ui_command
from orchestrator.tracking.read import read_metrics, read_summary
from orchestrator.tracking.view import HEADLINE, chart_key, mlflow_key
from pipelines.datasets import inspect_datasets

NOTE = "mlflow.note.content"


@pytest.fixture()
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    return f"sqlite:///{tmp_path}/mlruns.db"


def _reports(steps: int = 4) -> list[dict[str, float]]:
    """What rank 0 reports on a 5-class run of one worker: comm bytes 0 and top-5 accuracy 1.0 every time."""
    return [{"step": 10 * (i + 1), "train_loss": 2.0 / (i + 1), "lr": 1e-3 * (i + 1), "samples_per_s": 900.0 + i,
             "train_samples_per_s": 1000.0 + i, "comm_bytes_per_sample": 0.0, "val_loss": 1.5 / (i + 1),
             "val_accuracy": 0.5 + 0.1 * i, "val_top5_accuracy": 1.0, "world_size": 1} for i in range(steps)]


def test_charts_hold_the_series_that_change_and_the_headline_sorts_first(store: str) -> None:
    from mlflow.tracking import MlflowClient

    config = load_config(None, [f"tracking.uri={store}", "tracking.experiment=view"])
    tracker = MlflowTracker(config.tracking, "view", headline=config.tune.metric)
    for report in _reports():
        tracker.log_metrics(report, step=int(report["step"]))
    tracker.log_metrics({"val_f1": 0.4}, step=40)  # reported once: one point, not known to be a constant
    tracker.log_metrics({"summary/samples_per_s": 912.345678, "summary/val_accuracy": 0.8, "cost/wall_s": 20.123456,
                         "cost/productive_frac": 0.41234567, "startup/total_s": 9.87654321}, step=40)
    tracker.finish("FINISHED")

    client = MlflowClient(store)
    run = client.get_run(tracker.run_id)
    metrics = set(run.data.metrics)
    # The three a user looks for first, in the one section that sorts before every other.
    headline = {f"{HEADLINE}train_loss", f"{HEADLINE}val_accuracy", f"{HEADLINE}train_samples_per_s"}
    assert headline <= metrics
    assert sorted(k.split("/")[0] for k in metrics)[:3] == [HEADLINE.rstrip("/")] * 3
    assert "train/lr" in metrics and "val/loss" in metrics
    # No single-point run-level figure and no constant is charted.
    assert not [k for k in metrics if k.startswith(("final/", "cost/", "startup/"))], metrics
    assert not {"perf/comm_bytes_per_sample", "val/top5_accuracy", "train/world_size"} & metrics
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "val/f1")] == [(40, 0.4)]
    history = client.get_metric_history(tracker.run_id, f"{HEADLINE}val_accuracy")
    assert [m.step for m in history] == [10, 20, 30, 40]  # every point, none held back
    # Constants and run-level figures are rows of the summary table, rounded to 4 significant digits.
    table = read_summary(client, tracker.run_id)
    assert table["perf/comm_bytes_per_sample"] == 0.0 and table["val/top5_accuracy"] == 1.0
    assert table["final/perf/samples_per_s"] == 912.3 and table["cost/productive_frac"] == 0.4123
    assert table["startup/total_s"] == 9.877
    raw = json.loads(Path(client.download_artifacts(tracker.run_id, "summary.json", ".")).read_text())
    assert raw["columns"] == ["section", "figure", "value"]
    sections = [row[0] for row in raw["data"]]
    assert sections[:2] == ["final", "final"] and sections == sorted(sections, key=sections.index)  # grouped
    # Readers see one key per figure, whatever section charts it.
    assert read_metrics(client, tracker.run_id)["train/loss"] == [2.0, 1.0, 2.0 / 3, 0.5]
    # The description: the headline figures in one short paragraph.
    note = run.data.tags[NOTE]
    assert "val_accuracy 0.8" in note and "912 samples/s" in note and "start-up 9.9 s" in note
    assert "productive 41%" in note and len(note) < 400 and "\n" not in note


def test_the_headline_is_charted_from_its_first_report_even_if_the_driver_dies(store: str) -> None:
    """A driver killed after one report (the run is resumed later) must not lose the headline's first points: they
    are charted as they come, not held back until the series changes."""
    from mlflow.tracking import MlflowClient

    config = load_config(None, [f"tracking.uri={store}", "tracking.experiment=killed"])
    tracker = MlflowTracker(config.tracking, "killed", headline=config.tune.metric)
    tracker.log_metrics(_reports(1)[0], step=10)  # no finish(): the driver died here
    tracker.flush()  # what the writer's thread does within a second: only what was queued, nothing held back
    client = MlflowClient(store)
    for name in ("train_loss", "val_accuracy", "train_samples_per_s"):
        key = chart_key(mlflow_key(name), "val_accuracy")
        assert [m.step for m in client.get_metric_history(tracker.run_id, key)] == [10], name


def test_params_leave_out_nulls_and_the_study_on_a_train_run() -> None:
    config = load_config(None, [])
    params = config_params(config)
    assert params and all(value is not None for value in params.values())
    assert not [k for k in params if k.startswith("tune.")]
    assert config_params(config, study=True)["tune.num_samples"] == config.tune.num_samples


def test_the_datasets_are_run_inputs(store: str, digits_dir: str) -> None:
    from mlflow.tracking import MlflowClient

    config = load_config(None, [f"tracking.uri={store}", f"data.train={digits_dir}/train",
                                f"data.val={digits_dir}/val"])
    infos = inspect_datasets(config.data)
    tracker = MlflowTracker(config.tracking, "inputs")
    tracker.log_datasets(infos)
    tracker.finish("FINISHED")
    inputs = MlflowClient(store).get_run(tracker.run_id).inputs.dataset_inputs
    found = {i.tags[0].value: i.dataset for i in inputs}
    assert set(found) == {"training", "validation"}
    train = found["training"]
    assert json.loads(train.profile)["num_rows"] == infos["train"].num_rows
    assert json.loads(train.source)["uri"] == infos["train"].path and train.source_type == "local"
    columns = [c["name"] for c in json.loads(train.schema)["mlflow_colspec"]]
    assert columns == infos["train"].schema.names
    assert len(train.digest) == 8 and train.digest != found["validation"].digest


def test_urls_open_the_training_view_on_the_ui_the_product_starts(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/m.db"
    url = run_url(uri, "abc", "7")
    assert url is not None and ":5000" not in url
    assert url.endswith("/#/experiments/7/runs/abc/model-metrics?workflowType=machine_learning")
    assert experiment_url(uri, "7").endswith(
        "/#/experiments/7/runs?workflowType=machine_learning&viewStateShareKey=orchestrator-runs")
    assert run_url("http://mlflow.internal:5000/", "abc", "7") == (
        "http://mlflow.internal:5000/#/experiments/7/runs/abc/model-metrics?workflowType=machine_learning")
    # A command that works in a new shell: the venv's own `orchestrator ui`, not `mlflow` from PATH.
    command = ui_command(uri)
    program = command.split()[0]
    assert command.split()[1:4] == ["ui", "--tracking-uri", uri]
    assert ui_command(uri, "digits").endswith(" --experiment digits")
    assert Path(program).name == "orchestrator" and Path(os.path.abspath(program)).parent == Path(sys.executable).parent


def test_orchestrator_ui_refuses_a_store_that_is_not_there_and_finds_a_free_port(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from orchestrator.cli import main
    from orchestrator.report.ui import free_port

    assert main(["ui", "--tracking-uri", f"sqlite:///{tmp_path}/missing.db"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: no MLflow store at {tmp_path}/missing.db"), err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        other = free_port(busy)
        assert other != busy and other > 0


def test_the_ui_starts_without_mlflows_job_runner_unless_the_user_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.report.ui import ui_environment

    monkeypatch.delenv("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///kept.db")
    monkeypatch.setenv("MLFLOW_BACKEND_STORE_URI", "sqlite:///exported.db")
    env = ui_environment("sqlite:///served.db")
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false" and env["MLFLOW_TRACKING_URI"] == "sqlite:///kept.db"
    assert env["MLFLOW_BACKEND_STORE_URI"] == "sqlite:///served.db"  # the store asked for, over an exported one
    monkeypatch.setenv("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "true")  # exported: the user's choice stands
    assert ui_environment("sqlite:///served.db")["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "true"


def test_the_runs_table_opens_with_the_headline_metrics_as_columns(store: str) -> None:
    """MLflow shows no metric column until the user picks one; its shared views (an experiment tag the UI reads when
    the URL names its key) are how a table opens with some. Every tracked run's experiment holds the product's view:
    its task's validation metric, the loss and samples/s as columns ahead of the Source (widened: the command whole),
    and a second task's metric joins the first's rather than replacing it."""
    from mlflow.tracking import MlflowClient

    from orchestrator.tracking.links import RUNS_VIEW_KEY, RUNS_VIEW_TAG

    MlflowTracker(load_config(None, [f"tracking.uri={store}"]).tracking, "a", headline="val_accuracy").finish(
        "FINISHED")
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name(load_config(None, []).tracking.experiment)
    saved = json.loads(experiment.tags[RUNS_VIEW_TAG])  # MLflow's envelope: the Views menu lists it by name
    assert saved["name"] == "Training runs" and isinstance(saved["createdAt"], int)
    view = json.loads(saved["state"])
    metrics = ["metrics.`headline/val_accuracy`", "metrics.`headline/train_loss`",
               "metrics.`headline/train_samples_per_s`"]
    assert view["selectedColumns"][:3] == metrics
    assert {"attributes.`Source`", "attributes.`Dataset`"} <= set(view["selectedColumns"])
    assert view["columnOrder"][:5] == ["attributes.`Run Name`", "attributes.`Created`", *metrics]
    assert view["columnWidths"]["attributes.`Source`"] >= 400
    url = experiment_url(store, experiment.experiment_id)
    assert url.endswith(f"/runs?workflowType=machine_learning&viewStateShareKey={RUNS_VIEW_KEY}")
    # A regression run in the same experiment: its metric is added, the classifier's kept.
    second = MlflowTracker(load_config(None, [f"tracking.uri={store}"]).tracking, "b", headline="val_rmse",
                           tags={"orchestrator.role": "trial"})
    second.finish("FINISHED")
    assert client.get_run(second.run_id).data.tags["orchestrator.role"] == "trial"  # the run's tags, not the view's
    view = json.loads(json.loads(client.get_experiment(experiment.experiment_id).tags[RUNS_VIEW_TAG])["state"])
    assert view["selectedColumns"][:4] == [*metrics, "metrics.`headline/val_rmse`"]
    again = client.get_experiment(experiment.experiment_id).tags[RUNS_VIEW_TAG]
    MlflowTracker(load_config(None, [f"tracking.uri={store}"]).tracking, "c", headline="val_rmse").finish("FINISHED")
    assert client.get_experiment(experiment.experiment_id).tags[RUNS_VIEW_TAG] == again  # unchanged: not rewritten
    # An experiment the product never tracked into has no view: its URL does not name one (the UI would say
    # "share key does not exist").
    assert experiment_url(store, "0", view=False).endswith("/runs?workflowType=machine_learning")
