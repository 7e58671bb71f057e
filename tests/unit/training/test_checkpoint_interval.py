"""checkpoint.every=auto (training/checkpoint_interval.py, training/cadence.py): the interval is sqrt(2 x C x MTBF)
computed here independently, clamped as documented, decided on rank 0's clock at report steps, and its inputs are
carried in the progress across a restart."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from orchestrator.config import load_config
from orchestrator.config.reference import description
from orchestrator.run.result import checkpoint_interval_line
from orchestrator.training.cadence import Cadence, Notices
from orchestrator.training.checkpoint import Progress
from orchestrator.training.checkpoint_interval import STAND_IN_MTBF_MINUTES, auto_interval, mtbf_s


def test_the_interval_is_youngs_formula_clamped_by_the_cost_floor_and_the_cap() -> None:
    # C = 2 s, MTBF = 1 h: sqrt(2 x 2 x 3600) = 120 s, above the floor 2 / 0.03 = 66.7 s.
    assert auto_interval(2.0, 3600.0, None).seconds == pytest.approx(math.sqrt(2 * 2.0 * 3600.0))
    assert auto_interval(2.0, 3600.0, None).bound is None
    # MTBF = 100 s: sqrt(400) = 20 s would block 10% of the time; raised to 66.7 s (3%).
    low = auto_interval(2.0, 100.0, None)
    assert (low.seconds, low.bound) == (pytest.approx(2.0 / 0.03), "cost")
    # checkpoint.every_minutes=1 caps the 120 s.
    capped = auto_interval(2.0, 3600.0, 1.0)
    assert (capped.seconds, capped.bound) == (60.0, "cap")
    # The MTBF: the user's, else the run's seconds per interruption, the next counted as due now; before the first
    # interruption a stand-in, whatever the run's length, so identical runs checkpoint at the same interval.
    assert mtbf_s(600.0, 2, 30.0) == 1800.0 and mtbf_s(600.0, 2, None) == 200.0
    assert mtbf_s(600.0, 0, None) == mtbf_s(2.0, 0, None) == STAND_IN_MTBF_MINUTES * 60
    stand_in = f"{STAND_IN_MTBF_MINUTES:g} minutes"  # as the config reference states it (config is a leaf)
    assert stand_in in description("failure.mtbf_minutes") and stand_in in description("checkpoint.every")


def summary_line(overrides: list[str], report: dict[str, float]) -> str | None:
    history = [{"step": 300, "samples_per_s": 12_800.0, **report}]
    return checkpoint_interval_line(load_config(None, overrides), history)


def test_the_summary_line_says_where_each_number_comes_from() -> None:
    # No interruption yet: the stand-in, said to be one, and the key that sets it.
    mtbf = STAND_IN_MTBF_MINUTES * 60
    line = summary_line([], {"checkpoint/interval_s": 7.2, "checkpoint/cost_s": 0.0072,
                             "checkpoint/mtbf_s": mtbf, "checkpoint/interruptions": 0})
    seconds = math.sqrt(2 * 0.0072 * mtbf)
    assert line == (f"checkpoint interval: auto, {seconds:.1f} s (about {seconds * 100:,.0f} steps): "
                    f"sqrt(2 x 0.0072 s a checkpoint x {mtbf:,.0f} s between interruptions); {mtbf:,.0f} s assumed "
                    "(none yet): set failure.mtbf_minutes"), line
    assert len(line) <= 170  # a wide terminal line, not a paragraph (it was 330)
    # The user's MTBF, named with its value; the run's own after interruptions, with the seconds it divides.
    known = summary_line(["failure.mtbf_minutes=30"], {"checkpoint/interval_s": 15.0, "checkpoint/cost_s": 0.05,
                                                       "checkpoint/mtbf_s": 1800.0, "checkpoint/interruptions": 1})
    assert known is not None and known.endswith("between interruptions); 1,800 s: failure.mtbf_minutes=30"), known
    own = summary_line([], {"checkpoint/interval_s": 66.7, "checkpoint/cost_s": 2.0, "checkpoint/mtbf_s": 200.0,
                            "checkpoint/interruptions": 2})
    assert own is not None and own.endswith("; 200 s: the run's 600 s of training / (2 interruptions + the next)")
    assert "raised so checkpoints block at most 3% of the time" in own  # the cost floor, where it binds


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_cadence_saves_once_the_interval_passed_and_carries_its_inputs_across_a_restart() -> None:
    cfg = load_config(None, ["checkpoint.every=auto", "failure.mtbf_minutes=60", "train.max_steps=1000",
                             "train.log_every=10", "train.eval_every=null", "data.val=null"])
    clock, progress = Clock(), Progress()
    cadence = Cadence(cfg, False, None, torch.device("cpu"), progress, clock)
    assert cadence.at(5) is None  # not a report step
    first = cadence.at(10)
    assert first is not None and first.checkpoint  # no cost measured yet: the first report saves one
    progress.checkpoint_cost_s = 2.0  # what _report measures
    interval = math.sqrt(2 * 2.0 * 3600.0)  # 120 s
    clock.now += interval - 1
    assert not cadence.at(20).checkpoint  # type: ignore[union-attr]
    clock.now += 2
    assert cadence.at(30).checkpoint  # type: ignore[union-attr]
    assert progress.run_s == pytest.approx(interval + 1)
    assert cadence.figures()["checkpoint/interval_s"] == pytest.approx(interval)
    # A restart from that checkpoint: one interruption, the clock goes on from the saved seconds.
    progress.step = 30
    restarted = Cadence(cfg, False, None, torch.device("cpu"), progress, clock)
    assert progress.interruptions == 1 and restarted.run_s == pytest.approx(interval + 1)
    # Without a known MTBF the run's own: (run seconds) / (interruptions + 1), after a second restart.
    own = cfg.model_copy(update={"failure": cfg.failure.model_copy(update={"mtbf_minutes": None})})
    figures = Cadence(own, False, None, torch.device("cpu"), progress, clock).figures()
    assert progress.interruptions == 2 and figures["checkpoint/mtbf_s"] == pytest.approx((interval + 1) / 3)


def test_a_users_stop_saves_at_the_next_report_and_a_resume_from_it_is_no_interruption() -> None:
    """Ctrl+C asks rank 0 to stop: the next report step saves (whatever the auto interval says), and the resume of
    that checkpoint is the user's choice, not a failure: the auto interval's MTBF does not count it."""
    cfg = load_config(None, ["checkpoint.every=auto", "train.max_steps=1000", "train.log_every=10",
                             "train.eval_every=null", "data.val=null"])
    clock, progress, asked = Clock(), Progress(), [False]
    cadence = Cadence(cfg, False, Notices(stop_requested=lambda: asked[0]), torch.device("cpu"), progress, clock)
    assert cadence.at(10).checkpoint  # type: ignore[union-attr]  # the first report saves (no cost measured)
    progress.checkpoint_cost_s = 2.0
    clock.now += 1
    assert not cadence.at(20).checkpoint  # type: ignore[union-attr]  # the interval has not come round
    asked[0] = True
    assert cadence.at(25) is None  # still only at report steps
    due = cadence.at(30)
    assert due is not None and due.checkpoint and cadence.stopped
    progress.step = 30
    Cadence(cfg, False, None, torch.device("cpu"), progress, clock)  # `--resume` from the step-30 checkpoint
    assert progress.interruptions == 0
    progress.step = 40  # ...whose later checkpoint a failure resumes: that restart counts
    Cadence(cfg, False, None, torch.device("cpu"), progress, clock)
    assert progress.interruptions == 1


def test_rank_0_sees_the_drivers_stop_request_in_the_runs_storage(tmp_path: Path) -> None:
    """The driver's Ctrl+C writes the request file beside the run's checkpoints (run/interrupts.py); rank 0's
    watcher reads it from the run's storage within a poll, and only once it is there."""
    from orchestrator.training.stop import STOP_FILE, StopWatch
    from pipelines.storage import open_storage

    storage = open_storage(str(tmp_path))
    watch = StopWatch(storage, storage.join("run", STOP_FILE), every_s=0.02)
    time.sleep(0.1)
    assert not watch()  # nothing asked
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / STOP_FILE).write_text("1\n")
    assert watch.seen.wait(5.0) and watch()
