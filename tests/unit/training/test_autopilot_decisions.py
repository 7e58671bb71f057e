"""The autopilot's decisions (training/autopilot.py) on a clock the test sets: each candidate's step takes exactly
the seconds given here (the search reads its time module's perf_counter, replaced by a virtual clock that every step
of the search advances), so the decision is the rule's, not the machine's load. Run through the loop (loop.run), as
a worker runs it: a candidate is adopted only when faster than the best by more than the noise margin, a run
resumed close to its end starts no search its remaining steps cannot repay, and the choice kept in the checkpoint
is the chosen one, also when the budget stopped the search on a slower candidate."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from test_autopilot import Net, _config, _parts, _source, _table
from test_autopilot import one_thread as one_thread  # its autouse fixture: one torch thread, flushing on
from test_loop import Recorder

from orchestrator.training import autopilot
from orchestrator.training.checkpoint import Progress
from orchestrator.training.loop import Data, run

MICRO = 4  # the configured micro-batch: a step's micro-batch under a candidate is 4 x join / split (parts.state)


class VirtualClock:
    """The search's clock: a step under micro-batch m takes the next of `seconds[m]` (cycled), exactly."""

    def __init__(self, seconds: dict[int, list[float]]) -> None:
        self.now = 0.0
        # A micro-batch not given here is hopeless (2 s a step), should the search try it.
        self.seconds = {micro: itertools.cycle(seconds.get(micro, [2.0])) for micro in (1, 2, 4, 8, 16, 32, 64)}
        self.micros: list[int] = []  # each search step's micro-batch, in order

    def perf_counter(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        """test_autopilot's Net charges its modelled forward here: a step's time is this clock's table alone."""

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = autopilot.train_step

        def timed(parts: Any, batch: list[Any], timer: Any = None) -> Any:
            result = real(parts, batch, timer)
            micro = MICRO * parts.state.join // parts.state.split
            self.micros.append(micro)
            self.now += next(self.seconds[micro])
            return result

        monkeypatch.setattr(autopilot, "time", self)
        monkeypatch.setattr(autopilot, "train_step", timed)


def _run(cfg: Any, clock: VirtualClock, monkeypatch: pytest.MonkeyPatch, progress: Progress | None = None,
         recorder: Recorder | None = None) -> tuple[Progress, Recorder]:
    clock.install(monkeypatch)
    progress, recorder = progress or Progress(), recorder or Recorder()
    run(cfg, _parts(cfg, Net()), Data(_source(0, MICRO)), recorder, progress)
    return progress, recorder


def _rows(table: dict[str, Any]) -> list[tuple[int, str, bool]]:
    return [(r["settings"]["micro_batch_size"], r["status"], r["chosen"]) for r in table["rows"]]


# The start's timed steps 1, 1 + d, 1 - d, ... (after its warm-up step) with d = 3/64: a spread above 2% at every
# count, so it is timed 8 times, then median 1 and spread d: a noise margin of 2d = 3/32 = 9.375% (every figure
# here is a binary fraction: the clock's sums and the ratios are exact).
D = 3 / 64
NOISY_START = [1.0, 1.0, 1 + D, 1 - D, 1.0, 1 + D, 1 - D, 1.0, 1 + D]


def test_a_candidate_must_beat_the_best_by_more_than_the_noise_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    # Micro-batch 8 is 12.5% faster than the start: adopted. Micro-batch 16 is then exactly the margin (9.375%)
    # faster than 8: not more than the margin, so not adopted, and the search keeps 8.
    clock = VirtualClock({4: NOISY_START, 8: [0.875], 16: [0.875 * (1 - 2 * D)], 32: [0.5]})
    progress, recorder = _run(_config("train.max_steps=60", "autopilot.budget=0.5"), clock, monkeypatch)
    table = _table(recorder)
    assert _rows(table) == [(4, "ok", False), (8, "ok", True), (16, "ok", False)], table["rows"]
    assert table["chosen"]["micro_batch_size"] == 8 and progress.autopilot["chosen"]["micro_batch_size"] == 8
    assert table["predicted_speedup"] == 1 / 0.875
    # The start was measured until its figure was stable (8 timed steps: its spread is above 2%).
    assert clock.micros[:9] == [4] * 9 and clock.micros[9:] == [8] * 4 + [16] * 4


def test_a_tie_or_a_candidate_slower_within_the_margin_is_not_adopted(monkeypatch: pytest.MonkeyPatch) -> None:
    # Micro-batch 8 ties the start, micro-batch 2 is 3.125% slower (inside the 9.375% margin): neither is adopted.
    clock = VirtualClock({4: NOISY_START, 8: [1.0], 2: [1 + 1 / 32]})
    progress, recorder = _run(_config("train.max_steps=60", "autopilot.budget=0.5"), clock, monkeypatch)
    table = _table(recorder)
    assert _rows(table) == [(4, "ok", True), (8, "ok", False), (2, "ok", False)], table["rows"]
    assert table["chosen"] == table["start"] and progress.autopilot["chosen"]["micro_batch_size"] == 4
    assert table["predicted_speedup"] == 1.0
    later = {m["micro_batch_size"] for m, _ in recorder.reports if m["step"] > table["search_steps"] + 1}
    assert later == {4}


def test_a_run_resumed_close_to_its_end_starts_no_search_it_cannot_repay(monkeypatch: pytest.MonkeyPatch) -> None:
    # 0.1 of 300 steps pays for a search (30 steps' time); resumed at step 250 (a checkpoint saved before the
    # autopilot was turned on, so no choice to keep), 0.1 of the 50 steps left is 5, under two candidates' 8 steps.
    cfg = _config("train.max_steps=300", "autopilot.budget=0.1", "checkpoint.every=50", "train.log_every=10")
    clock = VirtualClock({4: [1.0], 8: [0.5], 16: [0.25]})
    progress, recorder = _run(cfg, clock, monkeypatch, progress=Progress(step=250, samples_seen=250 * 64))
    table = _table(recorder)
    assert table["skipped"].startswith("run too short to pay for the search"), table
    assert "x 50 steps" in table["skipped"]
    assert clock.micros == [] and table["rows"] == [] and progress.autopilot is None
    assert {m["micro_batch_size"] for m, _ in recorder.reports} == {4}
    # Resumed at step 200 instead, the 100 steps left pay for it: the search's budget is 0.1 of those 100 steps at
    # the start's measured pace (1 s a step), not of the run's 300.
    clock = VirtualClock({4: [1.0], 8: [0.5], 16: [0.25]})
    progress, recorder = _run(cfg, clock, monkeypatch, progress=Progress(step=200, samples_seen=200 * 64))
    table = _table(recorder)
    assert table["skipped"] is None and table["budget_s"] == pytest.approx(0.1 * 100 * 1.0)
    assert clock.micros[:4] == [4] * 4 and table["budget_spent_s"] <= table["budget_s"]
    assert progress.step == 300 and progress.autopilot["chosen"] == table["chosen"]  # type: ignore[index]


def test_the_saved_choice_is_the_chosen_one_when_the_budget_stops_a_slower_candidate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Budget: 0.2 x 40 steps x the start's 1 s = 8 s of candidates' steps. Micro-batch 8 at 0.96 s beats the start
    # by 4% (over the 2% margin of a steady start) and is adopted after 4 steps (3.84 s charged). Micro-batch 16 at
    # 1.42 s (1.48x of the best, not hopeless) may start (3.84 + 4 x 0.96 <= 8), and its warm-up and two timed steps
    # reach the budget (3.84 + 3 x 1.42 = 8.1 s): the search stops in it, unmeasured, and keeps micro-batch 8.
    cfg = _config("train.max_steps=40", "autopilot.budget=0.2", "checkpoint.every=20", "train.log_every=10")
    clock = VirtualClock({4: [1.0], 8: [0.96], 16: [1.42]})
    progress, recorder = _run(cfg, clock, monkeypatch)
    table = _table(recorder)
    assert clock.micros == [4] * 4 + [8] * 4 + [16] * 3, clock.micros
    assert table["budget_s"] == pytest.approx(8.0) and table["budget_spent_s"] == pytest.approx(3.84 + 3 * 1.42)
    assert _rows(table) == [(4, "ok", False), (8, "ok", True), (16, "ok", False)], table["rows"]
    assert table["chosen"]["micro_batch_size"] == 8
    # What the checkpoints keep (each one after the search) is the chosen setting, not the candidate the budget
    # stopped, nor the start; the rest of the run trains with it.
    assert progress.autopilot["chosen"] == table["chosen"]  # type: ignore[index]
    saved = [state for _, state in recorder.reports if state is not None]
    assert len(saved) == 2 and all(s["progress"]["autopilot"]["chosen"] == table["chosen"] for s in saved)
    later = [m["micro_batch_size"] for m, _ in recorder.reports if m["step"] > len(clock.micros) + 1]
    assert later and set(later) == {8}
