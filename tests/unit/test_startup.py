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
    clock.marks = {"command": 101.5, "data inspection": 102.0, "ray start": 106.0, "tracking": 107.0,
                   "datasets": 108.0}
    report = {"step": 25, "at/worker": 114.0, "at/loop": 116.5, "at/first_batch": 117.0, "train_loss": 1.0}
    assert clock.take_worker_marks(report)
    assert report["at/worker"] == 114.0 and report["train_loss"] == 1.0  # kept: MLflow leaves `at/*` out
    seconds = clock.seconds()
    assert list(seconds) == list(STAGES)
    assert seconds == pytest.approx({"command": 1.5, "data inspection": 0.5, "ray start": 4.0, "tracking": 1.0,
                                     "datasets": 1.0, "worker group": 6.0, "worker set-up": 2.5, "first batch": 0.5})
    assert clock.line() == ("start-up 17.0 s to the first step: command 1.5 s | data inspection 0.5 s | ray start "
                            "4.0 s | tracking 1.0 s | datasets 1.0 s | worker group 6.0 s | worker set-up 2.5 s | "
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
    # datasets were built after Ray, to 107.2, and the driver joined at 107.3. Tracking ended within Ray's start.
    clock = StartupClock(started_at=100.0)
    clock.marks = {"command": 101.5, "data inspection": 102.0}
    clock.mark_beside([("ray start", 106.0), ("datasets", 107.2)], ("tracking", 102.0, 104.5), now=107.3)
    clock.take_worker_marks({"at/worker": 113.0, "at/loop": 114.0, "at/first_batch": 114.5})
    seconds = clock.seconds()
    assert "tracking" not in seconds and seconds["ray start"] == pytest.approx(4.0)
    assert sum(seconds.values()) == pytest.approx(114.5 - 100.0)  # the series parts tile the wall clock
    assert clock.alongside() == {"tracking": pytest.approx(2.5)}
    assert clock.line() == ("start-up 14.5 s to the first step: command 1.5 s | data inspection 0.5 s | ray start "
                            "4.0 s (tracking 2.5 s alongside) | datasets 1.3 s | worker group 5.7 s | worker set-up "
                            "1.0 s | first batch 0.5 s")
    metrics = clock.metrics()
    assert metrics["startup/total_s"] == pytest.approx(14.5)
    assert metrics["startup/tracking_s"] == pytest.approx(2.5) and metrics["startup/ray_start_s"] == pytest.approx(4.0)


@pytest.mark.parametrize(("datasets_ended", "line"), [
    # Joining takes 0.8 s and MLflow 2.5 s; the datasets take 3.2 s from the join: tracking ended within them.
    (106.0, "ray start 0.8 s | datasets 3.2 s (tracking 2.5 s alongside)"),
    # The datasets take 1.1 s: the command waited for tracking after them, its part from the datasets' start.
    (103.9, "ray start 0.8 s | tracking 1.7 s (datasets 1.1 s alongside)"),
])
def test_on_a_joined_cluster_the_datasets_do_not_wait_for_tracking(datasets_ended: float, line: str) -> None:
    clock = StartupClock(started_at=100.0)
    clock.marks = {"command": 101.0, "data inspection": 102.0}
    clock.mark_beside([("ray start", 102.8), ("datasets", datasets_ended)], ("tracking", 102.0, 104.5),
                      now=max(datasets_ended, 104.5))
    assert clock.line().endswith(line), clock.line()
    assert sum(clock.seconds().values()) == pytest.approx(max(datasets_ended, 104.5) - 100.0)


def test_the_command_starts_when_a_stopwatch_around_it_starts() -> None:
    """The start every printed wall clock counts from (start-up, cost, ETTR) is the process's own start: after a
    stopwatch started just before the command and before the command's first line runs. The kernel's boot time is
    kept in whole seconds, so a start taken from it can be up to a second early: every figure that long."""
    began = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; from orchestrator.startup import process_started_at; "
                          "print(process_started_at(), time.time())"], capture_output=True, text=True, check=True)
    started, running = map(float, out.stdout.split())
    assert began - 0.02 <= started <= running, (started - began, running - began)  # a clock tick of slack
