"""Ctrl+C while MLflow's run is still being opened beside the worker group's start (orchestrator/run/alongside.py): the
user is told what the wait is for and how to skip it, and the run, once open, ends KILLED, never left RUNNING."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from orchestrator.config import TrackingConfig
from orchestrator.run.alongside import Alongside, ended_on_error
from orchestrator.tracking.client import MlflowTracker


def test_ctrl_c_while_mlflow_opens_says_why_it_waits_and_ends_the_run_killed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"

    def slow_opening() -> MlflowTracker:
        time.sleep(1.0)  # a slow tracking server; a new SQLite store takes about as long to create here
        return MlflowTracker(TrackingConfig(uri=uri, experiment="interrupted"), "run")

    opening = Alongside(slow_opening)
    with pytest.raises(KeyboardInterrupt), ended_on_error(opening):
        raise KeyboardInterrupt  # Ctrl+C while the worker group starts, the run not open yet
    err = capsys.readouterr().err
    assert "interrupted: waiting for the MLflow run being opened, to end it as KILLED" in err
    assert "Ctrl+C again to leave without waiting" in err
    runs = MlflowClient(tracking_uri=uri).search_runs([opening.result().experiment_id])
    assert [run.info.status for run in runs] == ["KILLED"]


def test_ctrl_c_after_mlflow_opened_ends_the_run_killed_without_a_word(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    opening = Alongside(lambda: MlflowTracker(TrackingConfig(uri=uri, experiment="interrupted"), "run"))
    opening.result()
    with pytest.raises(KeyboardInterrupt), ended_on_error(opening):
        raise KeyboardInterrupt
    assert "waiting for the MLflow run" not in capsys.readouterr().err
    runs = MlflowClient(tracking_uri=uri).search_runs([opening.result().experiment_id])
    assert [run.info.status for run in runs] == ["KILLED"]
