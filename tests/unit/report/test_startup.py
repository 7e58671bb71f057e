"""The start-up breakdown and the run's wall-clock figures, from hand-made marks and reports."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from orchestrator.report.startup import STAGES, StartupClock
from orchestrator.run.result import run_summary


def test_stages_tile_the_time_to_the_first_step() -> None:
    clock = StartupClock(started_at=100.0)
    clock.marks = {"command": 101.5, "data inspection": 101.7, "checks": 102.0, "ray start": 106.0, "datasets": 107.0}
    clock.mark_beside("tracking", 107.0, 109.0)  # MLflow's run opened while the worker group started
    report = {"step": 25, "at/worker": 114.0, "at/loop": 116.5, "at/first_batch": 117.0, "train_loss": 1.0}
    assert clock.take_worker_marks(report)
    assert report["at/worker"] == 114.0 and report["train_loss"] == 1.0  # kept: MLflow leaves `at/*` out
    seconds = clock.seconds()
    assert list(seconds) == [stage for stage in STAGES if stage != "tracking"]
    assert seconds == pytest.approx({"command": 1.5, "data inspection": 0.2, "checks": 0.3, "ray start": 4.0,
                                     "datasets": 1.0, "worker group": 7.0, "worker set-up": 2.5, "first batch": 0.5})
    assert clock.line() == ("start-up 17.0 s to the first step: command 1.5 s | data inspection 0.2 s | checks 0.3 s "
                            "| ray start 4.0 s | datasets 1.0 s | worker group 7.0 s (tracking 2.0 s alongside) "
                            "| worker set-up 2.5 s | first batch 0.5 s")
    metrics = clock.metrics()
    assert metrics["startup/total_s"] == pytest.approx(17.0)  # the series only: tracking ran beside it
    assert metrics["startup/worker_set_up_s"] == pytest.approx(2.5) and metrics["startup/tracking_s"] == 2.0
    # A restarted group's first report brings marks again: start-up was the first one's, and stays so.
    again = {"step": 50, "at/worker": 200.0, "at/loop": 201.0, "at/first_batch": 202.0}
    assert not clock.take_worker_marks(again) and again["at/worker"] == 200.0  # the restart's own timeline
    assert clock.seconds()["worker group"] == pytest.approx(7.0)


def test_a_worker_clock_behind_the_drivers_counts_no_negative_stage() -> None:
    clock = StartupClock(started_at=100.0)
    clock.marks = {"datasets": 108.0}
    clock.take_worker_marks({"at/worker": 107.9, "at/loop": 109.0, "at/first_batch": 109.5})
    assert min(clock.seconds().values()) >= 0.0
    assert sum(clock.seconds().values()) == pytest.approx(9.5)


def test_run_throughput_is_samples_over_the_training_wall_clock() -> None:
    # Two 10 s intervals at 1,000 and 3,000 samples/s: 40,000 samples in 20 s. Step 20 was redone after a
    # restart: the kept report of a step is its last.
    history = [{"step": 10, "interval_s": 10.0, "samples_per_s": 1000.0, "time/compute_frac": 0.5},
               {"step": 20, "interval_s": 99.0, "samples_per_s": 1.0, "time/compute_frac": 0.1},
               {"step": 20, "interval_s": 10.0, "samples_per_s": 3000.0, "time/compute_frac": 0.9}]
    summary = run_summary(history)
    assert summary["summary/samples_per_s"] == pytest.approx(2000.0)
    assert summary["summary/time/compute_frac"] == pytest.approx(0.7)
    history.append({"step": 30, "interval_s": 20.0, "samples_per_s": 500.0, "time/compute_frac": 0.2})
    # 50,000 samples in 40 s: 1,250 samples/s, where the median of the rates would say 1,000.
    assert run_summary(history)["summary/samples_per_s"] == pytest.approx((10_000 + 30_000 + 10_000) / 40)


def test_a_stage_beside_the_series_is_shown_with_the_part_it_ended_in_and_never_counted() -> None:
    # MLflow's remote server took 12 s: the workers took their first step before it was open (their reports
    # waited for it instead). It is shown beside the last part; the parts still tile the wall clock.
    clock = StartupClock(started_at=100.0)
    clock.marks = {"command": 101.5, "data inspection": 102.0, "ray start": 106.0, "datasets": 106.5}
    clock.mark_beside("tracking", 106.5, 118.5)
    clock.take_worker_marks({"at/worker": 113.0, "at/loop": 114.0, "at/first_batch": 114.5})
    seconds = clock.seconds()
    assert "tracking" not in seconds and sum(seconds.values()) == pytest.approx(114.5 - 100.0)
    assert clock.alongside() == {"tracking": pytest.approx(12.0)} and clock.beside() == {"tracking": "first batch"}
    assert clock.line().endswith("worker set-up 1.0 s | first batch 0.5 s (tracking 12.0 s alongside)")
    assert clock.metrics()["startup/total_s"] == pytest.approx(14.5)


def test_the_command_starts_when_a_stopwatch_around_it_starts() -> None:
    """The start every printed wall clock counts from (start-up, cost, ETTR) is the process's own start: after a
    stopwatch started just before the command and before the command's first line runs. The kernel's boot time is
    kept in whole seconds, so a start taken from it can be up to a second early: every figure that long."""
    began = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; "
                          "from orchestrator.report.startup import process_started_at; "
                          "print(process_started_at(), time.time())"], capture_output=True, text=True, check=True)
    started, running = map(float, out.stdout.split())
    assert began - 0.02 <= started <= running, (started - began, running - began)  # a clock tick of slack
