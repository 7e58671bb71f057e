"""checkpoint.every=auto (training/checkpoint_interval.py, training/cadence.py): the interval is sqrt(2 x C x MTBF)
computed here independently, clamped as documented, decided on rank 0's clock at report steps, and its inputs are
carried in the progress across a restart."""

from __future__ import annotations

import math

import pytest
import torch

from orchestrator.config import load_config
from orchestrator.training.cadence import Cadence
from orchestrator.training.checkpoint import Progress
from orchestrator.training.checkpoint_interval import auto_interval, mtbf_s


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
    # The MTBF: the user's, else the run's seconds per interruption, the next counted as due now.
    assert mtbf_s(600.0, 2, 30.0) == 1800.0 and mtbf_s(600.0, 2, None) == 200.0 and mtbf_s(600.0, 0, None) == 600.0


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
