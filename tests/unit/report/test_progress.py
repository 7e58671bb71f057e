"""The driver's progress lines, fed a recorded run's report rows (no Ray, no clock): a steady run with an evaluation
every 4 intervals keeps a steady rate and ETA, and each line's ETA ends where the run really ended."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest

from orchestrator.report.progress import ProgressLines

STEPS, LOG_EVERY, EVAL_EVERY, BATCH = 3000, 25, 100, 128
STEP_S, EVAL_S, CHECKPOINT_S, PUBLISH_S = 0.08, 10.0, 0.5, 0.002


def recorded_run(seed: int = 0) -> list[tuple[float, dict[str, Any]]]:
    """(when the report arrived, its row) for a steady run shaped like the loop's reports: each step's training
    time jittered by up to 15%, an evaluation every 100 steps (5 intervals' worth of time), a checkpoint every 500."""
    rng = random.Random(seed)
    rows, now = [], 0.0
    for step in range(LOG_EVERY, STEPS + 1, LOG_EVERY):
        train_s = LOG_EVERY * STEP_S * rng.uniform(0.85, 1.15)
        eval_s = EVAL_S * rng.uniform(0.9, 1.1) if step % EVAL_EVERY == 0 else 0.0
        checkpoint_s = CHECKPOINT_S if step % 500 == 0 else 0.0
        interval = train_s + eval_s + checkpoint_s + PUBLISH_S
        now += interval
        row = {"step": step, "train_loss": 2.0 / step ** 0.5, "lr": 1e-3, "samples_per_s": LOG_EVERY * BATCH / interval,
               "train_samples_per_s": LOG_EVERY * BATCH / train_s, "interval_s": interval, "data_wait_frac": 0.01,
               "time/eval_frac": eval_s / interval, "time/checkpoint_frac": checkpoint_s / interval,
               "time/report_frac": PUBLISH_S / interval}
        if eval_s:
            row |= {"val_accuracy": 0.9, "val_loss": 0.3, "eval_s": eval_s}
        rows.append((now, row))
    return rows


def _eta(line: str) -> float:
    hours, minutes, seconds = map(int, re.search(r"eta (\d+):(\d\d):(\d\d)", line).groups())  # type: ignore[union-attr]
    return 3600 * hours + 60 * minutes + seconds


def _lines(rows: list[tuple[float, dict[str, Any]]]) -> list[str]:
    lines = ProgressLines(STEPS, BATCH, EVAL_EVERY, "val_accuracy")
    return [lines(row) for _, row in rows]


def test_a_steady_runs_eta_and_rate_hold_steady_between_consecutive_lines() -> None:
    rows = recorded_run()
    lines = _lines(rows)
    timed = range(EVAL_EVERY // LOG_EVERY - 1, len(rows) - 10)  # from the first evaluation, 10+ intervals left
    for i in timed[1:]:
        assert 0.7 < _eta(lines[i]) / _eta(lines[i - 1]) < 1.3, (lines[i - 1], lines[i])
    rates = [float(re.search(r"([\d,]+) samples/s", line)[1].replace(",", "")) for line in lines]  # type: ignore[index]
    assert max(rates) / min(rates) < 1.3, (min(rates), max(rates))
    # The rate is training's: about the global batch over a step's training time, evaluating or not.
    assert sum(rates) / len(rates) == pytest.approx(BATCH / STEP_S, rel=0.05)


def test_each_lines_eta_ends_at_the_runs_real_finish() -> None:
    for seed in range(3):
        rows = recorded_run(seed)
        lines = _lines(rows)
        finish = rows[-1][0]
        # From the first evaluation on (its cost is measured then), each line's arrival plus its ETA is the finish,
        # within 10% of the run's length (the jitter still to come: the old per-interval ETA was 50% to 155% off),
        # and not biased either way over the run.
        errors = [(arrived + _eta(line) - finish) / finish
                  for (arrived, _), line in zip(rows, lines, strict=True)][EVAL_EVERY // LOG_EVERY - 1:]
        assert max(map(abs, errors)) < 0.1, errors
        assert abs(sum(errors) / len(errors)) < 0.015, errors


def test_lines_say_what_the_eta_does_not_count_yet_and_what_evaluation_took() -> None:
    rows = recorded_run()
    lines = _lines(rows)
    # Before the first evaluation its cost is unknown: the ETA says how many it leaves out.
    assert lines[0].endswith(f"+ {STEPS // EVAL_EVERY} evals"), lines[0]
    assert "+ " not in lines[EVAL_EVERY // LOG_EVERY - 1]
    evaluated = rows[EVAL_EVERY // LOG_EVERY - 1][1]
    assert f"val acc 0.900 (eval {evaluated['eval_s']:.1f} s)" in lines[EVAL_EVERY // LOG_EVERY - 1]
    assert lines[-1].startswith(f"step {STEPS}/{STEPS} | loss ") and lines[-1].endswith("eta 0:00:00")


def test_the_eta_rounds_to_the_nearest_second() -> None:
    # 75 steps left at 0.104 s a step (no evaluation, nothing else): 7.8 s, shown as 8 s, not cut down to 7.
    lines = ProgressLines(100, BATCH, None, "val_accuracy")
    row = {"step": 25, "train_loss": 1.0, "lr": 1e-3, "samples_per_s": 25 * BATCH / 2.6,
           "train_samples_per_s": 25 * BATCH / 2.6, "interval_s": 2.6, "data_wait_frac": 0.0}
    assert lines(row).endswith("| eta 0:00:08"), lines(row)
