"""The driver's handlers of the run's queue (orchestrator/report/handlers.py), fed the entries rank 0 and Ray Train's
controller put there (training/reporting.py, report/callbacks.py), in the order a run sends them: what MLflow gets,
what the terminal shows, what the attempt's record keeps, and when the run is stopped for a failure every restart
would repeat. No Ray, no MLflow: a tracker that records its calls."""

from __future__ import annotations

import time
from typing import Any

import pytest

from orchestrator.report.handlers import AutopilotTable, Console, FailureCounter, RunReports
from orchestrator.report.progress import ProgressLines
from orchestrator.report.startup import StartupClock


class _Tracker:
    def __init__(self) -> None:
        self.metrics: list[tuple[int, dict[str, Any]]] = []
        self.tags: dict[str, str] = {}
        self.checkpoints: list[tuple[int, str]] = []

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        self.metrics.append((step, dict(metrics)))

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags |= tags

    def log_checkpoint(self, step: int, uri: str) -> None:
        self.checkpoints.append((step, uri))


class _Record:
    def __init__(self) -> None:
        self.saved: list[int] = []

    def save(self, history: list[dict[str, Any]], force: bool = False) -> None:
        self.saved.append(len(history))


def _handlers(storage: str = "/runs", private_cluster: bool = True, closed: bool = False
              ) -> tuple[RunReports, _Tracker, _Record, list[int]]:
    tracker, record, started = _Tracker(), _Record(), []
    console = Console(True, ProgressLines(100, 32, None, ""), 1000)
    handle = RunReports(lambda: tracker, lambda: closed, StartupClock(time.time()), [], record,  # type: ignore[arg-type]
                        console, storage, first_step=lambda: started.append(1),
                        failures=FailureCounter(private_cluster), autopilot=AutopilotTable(True))
    return handle, tracker, record, started


def _report(step: int, world: int = 2, **more: Any) -> dict[str, Any]:
    return {"step": step, "train_loss": 1.0 / step, "lr": 0.1, "samples_per_s": 100.0, "world_size": world,
            "interval_s": 0.5, "data_wait_frac": 0.01} | more


SETUP = {"event": "setup", "params": 1000, "precision": "fp32", "workers": 2, "device": "cpu", "micro_batch": 16,
         "grad_accum_steps": 1, "global_batch": 32, "max_steps": 100}


def test_each_entry_reaches_its_handler_in_a_runs_order(capsys: pytest.CaptureFixture[str]) -> None:
    handle, tracker, record, started = _handlers(storage="s3://bucket/runs")
    handle(SETUP)
    handle(dict(SETUP))  # a restarted group that runs the same: not shown again
    handle(_report(25))
    handle({"event": "checkpoint", "step": 25, "path": "bucket/runs/r/checkpoint_000000"})
    handle(SETUP | {"workers": 1, "global_batch": 32, "grad_accum_steps": 2})  # resized: shown
    handle(_report(50, world=1, global_batch=32, grad_accum_steps=2, drain_checkpoint=True))
    out, err = capsys.readouterr()
    assert [line.split(" | ")[2] for line in out.splitlines() if line.startswith("run: ")] == ["2 x cpu", "1 x cpu"]
    assert [line.split(" |")[0] for line in out.splitlines() if line.startswith("step ")] == ["step 25/100",
                                                                                             "step 50/100"]
    # Ray keeps an S3 checkpoint's path without its scheme; the LoggedModel names it as the user does.
    assert tracker.checkpoints == [(25, "s3://bucket/runs/r/checkpoint_000000")]
    assert tracker.tags == {
        "orchestrator.resize.1": "step 50: 2 -> 1 workers, global batch 32 (accumulation 2)",
        "orchestrator.drain.1": "step 50: a node is being drained; checkpoint saved"}
    assert "worker group resized at step 50: 2 -> 1 workers" in err and "a node is being drained" in err
    # Every report kept, stamped with its arrival, saved in the attempt's record as it came, tracked at its step.
    assert [r["step"] for r in handle.history] == [25, 50] and all("elapsed_s" in r for r in handle.history)
    assert record.saved == [1, 2] and [step for step, _ in tracker.metrics] == [25, 50]
    assert len(started) == 2  # the end's warm-up is asked to start at each report (it starts once)


def test_a_failure_every_restart_would_repeat_stops_a_private_run_only_before_its_first_report(
        capsys: pytest.CaptureFixture[str]) -> None:
    failure = {"event": "worker_failure", "rank": 1, "error": "NameError: name 'x' is not defined",
               "repeats": True, "at": "model.py:3"}
    handle, tracker, _, _ = _handlers()
    handle(failure)
    assert handle.failures.doomed == ["NameError: name 'x' is not defined (at model.py:3)"]
    assert tracker.tags == {"orchestrator.failure.1": "after step 0: NameError: name 'x' is not defined"}
    # After a report, or on a cluster the run joined (its restarts are the cluster's): counted, retried.
    for private, reports in ((True, [_report(25)]), (False, [])):
        handle, tracker, _, _ = _handlers(private_cluster=private)
        for report in reports:
            handle(report)
        handle(failure)
        handle(failure | {"repeats": False, "rank": 0})
        assert handle.failures.doomed == [] and len(handle.failures.times) == 2
        assert sorted(tracker.tags) == ["orchestrator.failure.1", "orchestrator.failure.2"]
    assert capsys.readouterr().err.count("(restarting from the last checkpoint)") == 4


def test_nothing_is_handled_once_mlflows_run_failed_to_open() -> None:
    handle, tracker, record, started = _handlers(closed=True)
    for entry in (SETUP, _report(25), {"event": "checkpoint", "step": 25, "path": "/runs/c"}):
        handle(entry)
    assert (tracker.metrics, tracker.checkpoints, record.saved, started, handle.history) == ([], [], [], [], [])
