"""A study's terminal: one trial table redrawn in place while the study runs (a terminal), or one line per trial
that ends (a pipe or a log), never the table reprinted again and again; trials named by their values."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from orchestrator.tuning.trials import StudyCallback


@dataclass
class FakeTrial:
    """What the callback reads of a Ray Tune Trial: its id, name (str), status, config and last result."""

    trial_id: str
    name: str
    config: dict[str, Any]
    status: str = "RUNNING"
    last_result: dict[str, Any] = field(default_factory=dict)
    error_file: str | None = None

    def __str__(self) -> str:
        return self.name


def _study(callback: StudyCallback) -> list[FakeTrial]:
    """4 trials: each starts, reports 3 times, then ends (one stopped early at step 20)."""
    trials = [FakeTrial(f"t_{i:05d}", f"lr={lr:.1e}", {"optim.lr": lr}) for i, lr in enumerate((1e-3, 3e-3, 1e-2,
                                                                                                 3e-2))]
    for trial in trials:
        callback.on_trial_start(0, trials, trial)
    for step in (10, 20, 30):
        for trial in trials:
            if trial.status != "RUNNING":
                continue
            trial.last_result = {"step": step, "val_accuracy": 0.5 + step / 100, "done": False}
            callback.on_trial_result(0, trials, trial, trial.last_result)
            if trial is trials[3] and step == 20:
                trial.last_result["done"], trial.status = True, "TERMINATED"
                callback.on_trial_complete(0, trials, trial)
    for trial in trials[:3]:
        trial.last_result["done"], trial.status = True, "TERMINATED"
        callback.on_trial_complete(0, trials, trial)
    return trials


def _callback(live: bool) -> StudyCallback:
    return StudyCallback("digits-tune", {}, ["optim.lr"], "val_accuracy", 30, None, None, verbose=True,
                         table_every_s=0.0, live=live)


def test_a_terminal_gets_one_table_redrawn_in_place(capsys: pytest.CaptureFixture[str]) -> None:
    _study(_callback(live=True))
    out = capsys.readouterr().out
    draws = out.split("[")[1:]  # each draw starts with its `[m:ss] study:` line (after the cursor moves)
    assert len(re.findall(r"^trial\s+status", out, re.MULTILINE)) == len(re.findall(r"\[\d+:\d\d\] ", out)) > 1
    # Every draw after the first moves the cursor up over the whole previous one (its 2 + 4 lines) and clears.
    moves = re.findall(r"\x1b\[(\d+)F\x1b\[J\[", out)
    assert moves and set(moves) == {"6"} and len(moves) == out.count("digits-tune:") - 1, draws[:2]
    # The last draw: every trial by its values, with how it ended.
    last = out.rsplit("digits-tune:", 1)[1]
    assert re.search(r"^lr=3\.0e-02\s+stopped\s+0\.03\s+20\s+0\.7000$", last, re.MULTILINE), last
    assert re.search(r"^lr=1\.0e-03\s+completed\s+0\.001\s+30\s+0\.8000$", last, re.MULTILINE), last
    assert "t_0000" not in out


def test_a_pipe_gets_a_line_per_trial_that_ends_and_no_table(capsys: pytest.CaptureFixture[str]) -> None:
    _study(_callback(live=False))
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["trial lr=3.0e-02 stopped at step 20, val_accuracy 0.7000",
                     "trial lr=1.0e-03 completed at step 30, val_accuracy 0.8000",
                     "trial lr=3.0e-03 completed at step 30, val_accuracy 0.8000",
                     "trial lr=1.0e-02 completed at step 30, val_accuracy 0.8000"]
