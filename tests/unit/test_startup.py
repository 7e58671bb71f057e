"""The start-up breakdown and the run's wall-clock figures, from hand-made marks and reports."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from orchestrator.result import run_summary
from orchestrator.startup import STAGES, StartupClock


def test_stages_tile_the_time_to_the_first_step() -> None:
    clock = StartupClock(started_at=100.0)
    clock.marks = {"command": 101.5, "data inspection": 102.0, "tracking": 103.0, "ray start": 107.0,
                   "datasets": 108.0}
    report = {"step": 25, "at/worker": 114.0, "at/loop": 116.5, "at/first_batch": 117.0, "train_loss": 1.0}
    assert clock.take_worker_marks(report)
    assert report["at/worker"] == 114.0 and report["train_loss"] == 1.0  # kept: MLflow leaves `at/*` out
    seconds = clock.seconds()
    assert list(seconds) == list(STAGES)
    assert seconds == pytest.approx({"command": 1.5, "data inspection": 0.5, "tracking": 1.0, "ray start": 4.0,
                                     "datasets": 1.0, "worker group": 6.0, "worker set-up": 2.5, "first batch": 0.5})
    assert clock.line() == ("start-up 17.0 s to the first step: command 1.5 s | data inspection 0.5 s | tracking "
                            "1.0 s | ray start 4.0 s | datasets 1.0 s | worker group 6.0 s | worker set-up 2.5 s | "
                            "first batch 0.5 s")
    assert clock.metrics()["startup/total_s"] == pytest.approx(17.0)
    assert clock.metrics()["startup/worker_set_up_s"] == pytest.approx(2.5)
    # A restarted group's first report brings marks again: start-up was the first one's, and stays so.
    again = {"step": 50, "at/worker": 200.0, "at/loop": 201.0, "at/first_batch": 202.0}
    assert not clock.take_worker_marks(again) and again["at/worker"] == 200.0  # the restart's own timeline
    assert clock.seconds()["worker group"] == pytest.approx(6.0)


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


def test_stages_run_at_once_are_shown_alongside_and_the_parts_still_tile_the_wall_clock() -> None:
    # MLflow's run opened (2.5 s) while Ray started (4.0 s), both from the end of data inspection at 102.0; the
    # driver joined them at 106.1. Ray start is the part the command waited for; tracking ran beside it.
    clock = StartupClock(started_at=100.0)
    clock.marks = {"command": 101.5, "data inspection": 102.0}
    clock.mark_together(began=102.0, ended={"tracking": 104.5, "ray start": 106.0}, now=106.1)
    clock.marks["datasets"] = 107.2
    clock.take_worker_marks({"at/worker": 113.0, "at/loop": 114.0, "at/first_batch": 114.5})
    seconds = clock.seconds()
    assert "tracking" not in seconds and seconds["ray start"] == pytest.approx(4.1)
    assert sum(seconds.values()) == pytest.approx(114.5 - 100.0)  # the series parts tile the wall clock
    assert clock.alongside() == {"tracking": pytest.approx(2.5)}
    assert clock.line() == ("start-up 14.5 s to the first step: command 1.5 s | data inspection 0.5 s | ray start "
                            "4.1 s (tracking 2.5 s alongside) | datasets 1.1 s | worker group 5.8 s | worker set-up "
                            "1.0 s | first batch 0.5 s")
    metrics = clock.metrics()
    assert metrics["startup/total_s"] == pytest.approx(14.5)
    assert metrics["startup/tracking_s"] == pytest.approx(2.5) and metrics["startup/ray_start_s"] == pytest.approx(4.1)


def test_the_stage_that_ended_last_is_the_one_waited_for() -> None:
    # On a running cluster joining takes 0.8 s and MLflow 2.5 s: the command waited for tracking.
    clock = StartupClock(started_at=100.0)
    clock.marks = {"command": 101.0, "data inspection": 102.0}
    clock.mark_together(began=102.0, ended={"tracking": 104.5, "ray start": 102.8}, now=104.5)
    assert clock.seconds() == pytest.approx({"command": 1.0, "data inspection": 1.0, "tracking": 2.5})
    assert clock.alongside() == {"ray start": pytest.approx(0.8)}
    assert "tracking 2.5 s (ray start 0.8 s alongside)" in clock.line()


def test_the_command_starts_when_a_stopwatch_around_it_starts() -> None:
    """The start every printed wall clock counts from (start-up, cost, ETTR) is the process's own start: after a
    stopwatch started just before the command and before the command's first line runs. The kernel's boot time is
    kept in whole seconds, so a start taken from it can be up to a second early: every figure that long."""
    began = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; from orchestrator.startup import process_started_at; "
                          "print(process_started_at(), time.time())"], capture_output=True, text=True, check=True)
    started, running = map(float, out.stdout.split())
    assert began - 0.02 <= started <= running, (started - began, running - began)  # a clock tick of slack
