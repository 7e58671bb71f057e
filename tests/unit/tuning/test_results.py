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
    from orchestrator.tuning.plan import TrialPlanner
    from orchestrator.tuning.trials import StudyFacts

    study = StudyFacts("digits-tune", TrialPlanner({}), ("optim.lr",), "val_accuracy", 30)
    return StudyCallback(study, verbose=True, table_every_s=0.0, live=live)


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


def test_a_restarted_trials_ledger_bills_the_time_its_restart_lost() -> None:
    """Tune rewinds time_total_s to the checkpoint's when it restarts a trial: the ledger's clock is when each report
    was made, from the trial's start, and its wall clock the span Tune saw the trial run."""
    from orchestrator.report.cost import REPORTED_AT, RESTART_MARK, Pricing
    from orchestrator.tuning.trials import trial_ledger

    started = 1000.0
    rows = [  # the first process reports step 10 at +5 s, checkpoints, dies at +8 s; the second restarts from it
        {"step": 10, "interval_s": 1.0, "time_total_s": 5.0, REPORTED_AT: 1005.0, RESTART_MARK: 1},
        {"step": 20, "interval_s": 1.0, "time_total_s": 6.0, REPORTED_AT: 1014.0, RESTART_MARK: 2},
        {"step": 30, "interval_s": 1.0, "time_total_s": 7.0, REPORTED_AT: 1015.0},
    ]
    rows = [r | {"time/compute_frac": 1.0} for r in rows]
    ledger = trial_ledger(rows, started, 1015.5, Pricing(1, 3600.0, "one node at $1/s"))
    assert ledger.wall_s == 15.5 and ledger.usd == pytest.approx(15.5)
    seconds = {k: v for k, v in ledger.seconds.items() if v}
    # 4 s before the first interval; the three intervals; 1014 - 1005 - 1 s between the last report before the kill
    # and the restarted process's first interval; half a second after the last report.
    assert seconds == pytest.approx({"startup": 4.0, "compute": 3.0, "recovery": 8.0, "shutdown": 0.5})
    # Without the stamps (a wider trial's reports), Tune's clock, which its trial never rewinds.
    plain = [{k: v for k, v in r.items() if k != REPORTED_AT} for r in rows[1:]]
    assert trial_ledger(plain, None, None, Pricing(1, None, "")).wall_s == 7.0


def test_the_final_table_ranks_the_trials_shows_their_values_and_marks_the_best() -> None:
    from orchestrator.tuning.results import TrialSummary, TuneResult, final_table, pick_best

    def trial(i: int, lr: float, status: str, metric: float | None) -> TrialSummary:
        return TrialSummary(f"t_{i:05d}", {"optim.lr": lr, "optim.warmup_steps": 10 * i}, status,
                            40 if status == "completed" else 20, metric, name=f"lr={lr:.1e},warmup={10 * i}")

    trials = [trial(0, 1e-3, "stopped", 0.95), trial(1, 3e-2, "completed", 0.80), trial(2, 1e-2, "completed", 0.90),
              trial(3, 1e-4, "error", None)]
    for mode, order in (("max", [2, 1, 0, 3]), ("min", [1, 2, 0, 3])):
        best = pick_best(trials, mode)
        assert best is not None
        result = TuneResult(config=None, best=best, trials=trials, metric="val_accuracy",  # type: ignore[arg-type]
                            mode=mode, best_config_path="", study_path="", parent_run_id=None, tracking_uri=None,
                            resumed=False)
        header, *lines = final_table(result).splitlines()
        assert header.split() == ["trial", "status", "lr", "warmup", "step", "val_accuracy", "id"]
        # Completed trials by their metric, then the early-stopped (from fewer steps), then those without one.
        assert [line.split()[-1] if "<-" not in line else line.split()[-3] for line in lines] == [
            f"t_{i:05d}" for i in order]
        assert lines[0].endswith(f"{best.trial_id}  <- best") and sum("<- best" in x for x in lines) == 1
        values = [(float(line.split()[2]), int(line.split()[3])) for line in lines]  # the searched values
        assert values == [(pytest.approx(trials[i].params["optim.lr"], rel=1e-2), 10 * i) for i in order]


def test_a_studys_parent_charts_the_best_trials_headline_under_the_trials_own_keys() -> None:
    # The parent run's headline figures are the best trial's last ones, charted as the trial's run charts them.
    from orchestrator.tracking.view import chart_key, headline_keys, mlflow_key
    from orchestrator.tuning.results import TrialSummary, headline_figures

    history = [{"step": 20, "train_loss": 1.0, "samples_per_s": 500.0, "train_samples_per_s": 900.0,
                "val_accuracy": 0.8},
               {"step": 40, "train_loss": 0.5, "samples_per_s": 400.0, "train_samples_per_s": 950.0}]
    best = TrialSummary("t_00000", {"optim.lr": 1e-3}, "completed", 40, 0.8, history=history)
    charted = {chart_key(mlflow_key(k), "val_accuracy"): v for k, v in headline_figures(best, "val_accuracy").items()}
    assert set(charted) == set(headline_keys("val_accuracy").values())
    assert charted == {"headline/train_loss": 0.5, "headline/val_accuracy": 0.8, "headline/train_samples_per_s": 950.0}
