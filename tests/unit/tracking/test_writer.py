"""MLflow writes off the report path (orchestrator/tracking/writer.py), against a real SQLite store: a store held by a
real lock does not hold the reports (counted in calls, not timed), every point lands in order once it answers, Ctrl+C
writes what was queued before the run ends KILLED, a superseded attempt's queued points never land, and a store that
leaves too much waiting drops the oldest with one line, never silently."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import TrackingConfig
from orchestrator.run.alongside import Alongside, ended_on_error
from orchestrator.tracking import client as client_module
from orchestrator.tracking.client import MlflowTracker
from orchestrator.tracking.tracker import FencedTracker
from orchestrator.tracking.view import chart_key, mlflow_key

LOSS = chart_key(mlflow_key("train_loss"), None)  # headline/train_loss


def report(step: int) -> dict[str, float]:
    return {"step": step, "train_loss": 1.0 / step, "lr": 1e-3 * step}


def history(tracker: MlflowTracker, key: str = LOSS) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return [(m.step, m.value) for m in MlflowClient(tracker.uri).get_metric_history(tracker.run_id, key)]


class Counted:
    """The tracker's client's log_batch, counting the calls begun and ended (and telling when one began)."""

    def __init__(self, tracker: MlflowTracker) -> None:
        self.inner, self.begun, self.ended, self.entered = tracker._client.log_batch, 0, 0, threading.Event()
        tracker._client.log_batch = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.begun += 1
        self.entered.set()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.ended += 1


def test_a_held_store_does_not_hold_the_reports_and_gets_every_point_in_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "OUTAGE_RETRY_S", 0.2)  # a lock held past SQLite's wait: tried again soon
    tracker = MlflowTracker(TrackingConfig(uri=f"sqlite:///{tmp_path}/m.db", experiment="held"), "held-run")
    calls = Counted(tracker)
    lock = sqlite3.connect(tmp_path / "m.db", isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")  # a real lock: every write of the store waits for it (a slow store)
    try:
        tracker.log_metrics(report(1), step=1)
        assert calls.entered.wait(60), "the writer never tried the store"
        for step in range(2, 302):  # 300 reports while the writer's one call waits on the lock
            tracker.log_metrics(report(step), step=step)
        assert calls.begun == 1  # none of the 300 reports made a call of its own
        assert tracker.writer.pending() >= 300  # kept, not skipped
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    tracker.finish("FINISHED")
    assert history(tracker) == [(step, 1.0 / step) for step in range(1, 302)]
    assert history(tracker, mlflow_key("lr"))[-1] == (301, 1e-3 * 301)
    print(f"{calls.begun} log_batch calls for 301 reports")
    assert calls.begun < 301 // 10  # batched: a handful of calls, not one per report


def test_ctrl_c_writes_what_was_queued_before_the_run_ends_killed(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    tracker = MlflowTracker(TrackingConfig(uri=f"sqlite:///{tmp_path}/m.db", experiment="ctrl-c"), "run")
    tracker.writer.every_s = 3600.0  # nothing written on the cadence: only the Ctrl+C path can write them
    opening = Alongside(lambda: tracker)
    opening.result()
    with pytest.raises(KeyboardInterrupt), ended_on_error(opening):
        for step in range(1, 41):
            tracker.log_metrics(report(step), step=step)
        tracker.set_tags({"orchestrator.precision": "fp32"})
        raise KeyboardInterrupt
    run = MlflowClient(tracker.uri).get_run(tracker.run_id)
    assert run.info.status == "KILLED"
    assert [step for step, _ in history(tracker)] == list(range(1, 41))
    assert run.data.tags["orchestrator.precision"] == "fp32"


def test_a_superseded_attempt_lands_nothing_it_queued(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    inner = MlflowTracker(TrackingConfig(uri=f"sqlite:///{tmp_path}/m.db", experiment="fenced"), "run")
    inner.writer.every_s = 3600.0
    newer = threading.Event()  # a newer attempt claimed the run
    tracker = FencedTracker(inner, newer.is_set)
    tracker.log_metrics(report(1), step=1)
    inner.flush()
    for step in range(2, 11):  # queued before the refusal, not written yet
        tracker.log_metrics(report(step), step=step)
    newer.set()
    tracker.log_metrics(report(11), step=11)  # refused at the door
    tracker.finish("FINISHED")  # refused: the newer attempt ends the run
    inner.flush()  # the writer, asked again (as at the process' exit), still writes none of it
    assert history(inner) == [(1, 1.0)]
    assert MlflowClient(inner.uri).get_run(inner.run_id).info.status == "RUNNING"


def test_a_store_that_leaves_too_much_waiting_drops_the_oldest_and_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tracker = MlflowTracker(TrackingConfig(uri=f"sqlite:///{tmp_path}/m.db", experiment="bounded"), "run")
    tracker.writer.every_s, tracker.writer.limit = 3600.0, 60  # 2 points a report (step is not one): 30 reports
    capsys.readouterr()
    for step in range(1, 41):
        tracker.log_metrics(report(step), step=step)
    tracker.finish("FINISHED")
    assert [step for step, _ in history(tracker)] == list(range(11, 41))  # the newest 30 reports
    lines = [line for line in capsys.readouterr().err.splitlines() if "MLflow" in line]
    assert len(lines) == 2, lines  # when it began dropping, and how many at the end
    assert "the oldest beyond the last 60 are dropped" in lines[0]
    assert lines[1].startswith("warning: 20 metric points and tags of this run were not written")
