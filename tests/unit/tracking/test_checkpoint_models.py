"""Committed checkpoints as MLflow 3 LoggedModels of their run (orchestrator/tracking/checkpoint_models.py, through the
tracker), against a real SQLite store and without Ray: the driver's side of what a training run does when Ray
Train commits a checkpoint (tests/integration/test_tracking.py checks it on a real run)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import TrackingConfig
from orchestrator.tracking.client import MlflowTracker
from orchestrator.tracking.view import chart_key, mlflow_key

# Four reports, each with a checkpoint: validation loss, accuracy and training loss; step 20 is the best.
REPORTS = {10: {"train_loss": 1.2, "val_loss": 0.9, "val_accuracy": 0.5},
           20: {"train_loss": 0.8, "val_loss": 0.4, "val_accuracy": 0.85},
           30: {"train_loss": 0.6, "val_loss": 0.6, "val_accuracy": 0.8},
           40: {"train_loss": 0.5, "val_loss": 0.7, "val_accuracy": 0.75}}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlruns.db"


@pytest.fixture(scope="module")
def infos(digits_dir: str) -> dict[str, Any]:
    from orchestrator import load_config
    from pipelines.datasets import inspect_datasets

    return inspect_datasets(load_config(None, [f"data.train={digits_dir}/train", f"data.val={digits_dir}/val"]).data)


def test_each_checkpoint_is_a_logged_model_with_its_steps_metrics_and_the_best_is_found(
        store: str, infos: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mlflow.tracking import MlflowClient

    from orchestrator.tracking.lineage import dataset_entity

    tracker = MlflowTracker(TrackingConfig(uri=store, experiment="checkpoints"), "ckpt-run", headline="val_accuracy")
    tracker.log_datasets(infos)
    capsys.readouterr()
    paths = {step: str(tmp_path / f"checkpoint_{step:08d}_abcdef") for step in REPORTS}
    # The driver learns of a report and of its checkpoint's commit in either order: report first at steps 10 and
    # 30, the commit first at step 20 (an async upload registers later, a fast controller earlier).
    tracker.log_metrics(REPORTS[10], step=10)
    tracker.log_checkpoint(10, paths[10])
    tracker.log_checkpoint(20, paths[20])
    tracker.log_metrics(REPORTS[20], step=20)
    tracker.log_metrics(REPORTS[30], step=30)
    tracker.log_checkpoint(30, paths[30])
    tracker.log_metrics(REPORTS[40], step=40)  # its checkpoint's commit never reaches this driver: it dies
    tracker.finish("KILLED")
    assert "warning" not in capsys.readouterr().err

    client = MlflowClient(tracker.uri)
    run = client.get_run(tracker.run_id)
    models = client.search_logged_models([run.info.experiment_id],
                                         filter_string=f"source_run_id = '{tracker.run_id}'")
    by_step = {int(m.params["step"]): m for m in models}
    assert sorted(by_step) == [10, 20, 30]  # one model per checkpoint whose commit the driver heard of
    assert_linked(client, tracker.run_id, by_step, paths, dataset_entity(infos["val"]))
    # Linking logged no second point: one per report.
    assert [m.step for m in client.get_metric_history(tracker.run_id, "val/loss")] == [10, 20, 30, 40]
    # The run's outputs name each model with its step.
    outputs = {o.model_id: o.step for o in run.outputs.model_outputs}
    assert {outputs[m.model_id] for m in models} == {10, 20, 30}

    best = client.search_logged_models([run.info.experiment_id], max_results=1,
                                       order_by=[{"field_name": "metrics.val/loss", "ascending": True}])
    assert int(best[0].params["step"]) == 20
    best = client.search_logged_models([run.info.experiment_id], max_results=1, order_by=[
        {"field_name": "metrics.headline/val_accuracy", "ascending": False}])
    assert int(best[0].params["step"]) == 20

    # The resumed run ends with checkpoints 20, 30 and 40 in storage (retention deleted 10): 10's model goes, and
    # 40 (committed while the first driver died) gets one, with the first attempt's points of its step linked.
    again = MlflowTracker(TrackingConfig(uri=store, experiment="checkpoints"), "ckpt-run", run_id=tracker.run_id)
    again.log_datasets(infos)
    paths[40] = str(tmp_path / "checkpoint_00000040_abcdef")
    again.keep_checkpoints({paths[20]: 20, paths[30]: 30, paths[40]: 40})
    again.finish("FINISHED")
    left = client.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{tracker.run_id}'")
    by_step = {int(m.params["step"]): m for m in left}
    assert sorted(by_step) == [20, 30, 40]
    assert_linked(client, tracker.run_id, by_step, paths, dataset_entity(infos["val"]))
    assert [m.step for m in client.get_metric_history(tracker.run_id, "val/loss")] == [10, 20, 30, 40]


def assert_linked(client: Any, run_id: str, by_step: dict[int, Any], paths: dict[int, str], val: Any) -> None:
    """Each model is the external one of its checkpoint, READY, with the run's own points of its step linked."""
    from mlflow.entities import LoggedModelStatus

    for step, model in by_step.items():
        assert model.name == Path(paths[step]).name and model.status == LoggedModelStatus.READY
        assert model.tags["mlflow.model.isExternal"] == "true" and model.tags["orchestrator.checkpoint"] == paths[step]
        assert client.list_logged_model_artifacts(model.model_id) == []  # external: nothing was uploaded
        linked = {m.key: m for m in model.metrics}
        # Each linked value is the run's own point at that step, under the key the run charts it by.
        for name, value in REPORTS[step].items():
            key = chart_key(mlflow_key(name), "val_accuracy")
            (point,) = [m for m in client.get_metric_history(run_id, key) if m.step == step]
            assert linked[key].value == point.value == value and linked[key].step == step
        assert (linked["val/loss"].dataset_name, linked["val/loss"].dataset_digest) == (val.name, val.digest)


def test_a_store_that_stops_answering_costs_a_checkpoint_model_one_warning_not_the_run(
        store: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    tracker = MlflowTracker(TrackingConfig(uri=store, experiment="checkpoints-outage"), "outage-run")
    capsys.readouterr()
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tracker._client = MlflowClient(f"http://127.0.0.1:{port}")  # the store goes away mid-run
    tracker.log_checkpoint(10, "/runs/checkpoint_00000010_abcdef")  # never raises
    tracker.log_metrics(REPORTS[10], step=10)
    tracker.keep_checkpoints({})
    lines = [line for line in capsys.readouterr().err.splitlines() if "MLflow" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: MLflow tracking at ") and "log_checkpoint" in lines[0]


def test_a_model_made_by_a_driver_killed_before_it_linked_its_step_is_linked_by_the_resumed_run(
        store: str, infos: dict[str, Any], tmp_path: Path) -> None:
    """A driver SIGKILLed between a checkpoint model's creation and the linking of its step's points leaves a model
    without metrics beside the run's points of that step: the attempt that finishes the run links them."""
    from mlflow.tracking import MlflowClient

    from orchestrator.tracking.checkpoint_models import create_checkpoint_model
    from orchestrator.tracking.lineage import dataset_entity

    tracker = MlflowTracker(TrackingConfig(uri=store, experiment="checkpoints-killed"), "killed-run",
                            headline="val_accuracy")
    tracker.log_datasets(infos)
    paths = {step: str(tmp_path / f"checkpoint_{step:08d}_abcdef") for step in (10, 20)}
    tracker.log_metrics(REPORTS[10], step=10)
    tracker.log_checkpoint(10, paths[10])
    tracker.log_metrics(REPORTS[20], step=20)
    client = MlflowClient(tracker.uri)
    create_checkpoint_model(client, tracker.experiment_id, tracker.run_id, 20, paths[20])  # then the kill
    tracker.finish("KILLED")

    again = MlflowTracker(TrackingConfig(uri=store, experiment="checkpoints-killed"), "killed-run",
                          run_id=tracker.run_id)
    again.log_datasets(infos)
    again.keep_checkpoints({paths[10]: 10, paths[20]: 20})
    again.finish("FINISHED")
    models = client.search_logged_models([tracker.experiment_id], filter_string=f"source_run_id = '{tracker.run_id}'")
    by_step = {int(m.params["step"]): m for m in models}
    assert sorted(by_step) == [10, 20]  # no second model of step 20
    assert_linked(client, tracker.run_id, by_step, paths, dataset_entity(infos["val"]))
    assert [m.step for m in client.get_metric_history(tracker.run_id, "val/loss")] == [10, 20]
