"""checkpoint.every=auto's bounds and its measured cost (training/checkpoint_interval.py, cadence.py, loop.py):
checkpoint.every_minutes caps the interval in minutes and, above the formula's value, leaves the formula's value;
the user's cap wins over the 3% cost floor; and the cost the interval is computed from is what a checkpoint blocks
training for, writing it and registering it, measured end to end through the loop."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
from test_checkpoint_interval import Clock
from test_loop import Recorder, batches, config, dataset, make_parts

from orchestrator.config import load_config
from orchestrator.training import loop
from orchestrator.training.cadence import Cadence
from orchestrator.training.checkpoint import Progress
from orchestrator.training.checkpoint_interval import auto_interval


def test_the_cap_is_in_minutes_and_a_cap_above_the_formula_leaves_the_formula() -> None:
    # C = 2 s, MTBF = 1 h: sqrt(2 x 2 x 3600) = 120 s.
    formula = math.sqrt(2 * 2.0 * 3600.0)
    above = auto_interval(2.0, 3600.0, 5.0)  # 5 minutes = 300 s, above 120 s: the formula's value stands
    assert (above.seconds, above.bound) == (pytest.approx(formula), None)
    assert "capped" not in above.why()
    under = auto_interval(2.0, 3600.0, 1.5)  # 1.5 minutes = 90 s, under 120 s: 90 s
    assert (under.seconds, under.bound) == (90.0, "cap")
    assert under.why().endswith("= 120 s, capped by checkpoint.every_minutes")
    # The cap is the user's: it wins over the cost floor where they cross (C = 10 s: the floor 10 / 0.03 = 333 s).
    crossed = auto_interval(10.0, 100.0, 2.0)
    assert (crossed.seconds, crossed.bound) == (120.0, "cap")
    floor = auto_interval(10.0, 100.0, 10.0)  # a cap above the floor leaves the floor
    assert (floor.seconds, floor.bound) == (pytest.approx(10.0 / 0.03), "cost")


@pytest.mark.parametrize(("minutes", "interval"), [(5.0, math.sqrt(2 * 2.0 * 3600.0)), (1.5, 90.0)])
def test_the_cadence_saves_at_the_capped_interval_in_minutes(minutes: float, interval: float) -> None:
    cfg = load_config(None, ["checkpoint.every=auto", f"checkpoint.every_minutes={minutes}",
                             "failure.mtbf_minutes=60", "train.max_steps=1000", "train.log_every=10",
                             "train.eval_every=null", "data.val=null"])
    clock, progress = Clock(), Progress(checkpoint_cost_s=2.0)
    cadence = Cadence(cfg, False, None, torch.device("cpu"), progress, clock)
    assert cadence.figures()["checkpoint/interval_s"] == pytest.approx(interval)
    clock.now += interval - 1
    assert not cadence.at(10).checkpoint  # type: ignore[union-attr]
    clock.now += 2
    assert cadence.at(20).checkpoint  # type: ignore[union-attr]


def _costs(monkeypatch: pytest.MonkeyPatch, write_s: float, register_s: float) -> list[dict[str, Any]]:
    """A checkpoint.every=auto run whose checkpoint's write (save_state) and registration (the reporter's
    checkpoint call) take at least `write_s` and `register_s`; its reports' checkpoint figures."""
    real = loop.save_state

    def slow_save(directory: str, state: dict[str, Any]) -> None:
        real(directory, state)
        time.sleep(write_s)

    class Registering(Recorder):
        def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
            super().checkpoint(metrics, checkpoint_dir)
            time.sleep(register_s)

    monkeypatch.setattr(loop, "save_state", slow_save)
    cfg = config("checkpoint.every=auto", "failure.mtbf_minutes=60", "train.max_steps=12", "train.log_every=4",
                 "train.eval_every=null", "data.val=null")
    x, y = dataset(256)
    recorder = Registering()
    loop.run(cfg, make_parts(cfg), loop.Data(lambda epoch: batches(x, y, cfg.train.micro_batch_size)), recorder)
    return [m for m, _ in recorder.reports if "checkpoint/cost_s" in m]


def test_the_measured_checkpoint_cost_includes_the_write_and_the_registration(
        monkeypatch: pytest.MonkeyPatch) -> None:
    quick = _costs(monkeypatch, 0.0, 0.0)
    slow = _costs(monkeypatch, 0.3, 0.2)
    # The first report saves (no cost measured yet); the later ones carry its cost and the interval from it.
    assert [m["step"] for m in slow] == [8, 12] and [m["step"] for m in quick] == [8, 12]
    cost = slow[0]["checkpoint/cost_s"]
    assert cost >= 0.3 + 0.2, slow[0]  # writing it and registering it both blocked training
    assert cost > quick[0]["checkpoint/cost_s"] + 0.4
    # A slower checkpoint is saved less often: the interval from Young's formula on that cost (MTBF 1 h).
    assert slow[0]["checkpoint/interval_s"] == pytest.approx(max(math.sqrt(2 * cost * 3600), cost / 0.03))
    assert slow[0]["checkpoint/interval_s"] > quick[0]["checkpoint/interval_s"]
