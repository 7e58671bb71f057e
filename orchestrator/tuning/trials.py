"""What the driver does while a study runs: one MLflow child run per trial, and a live table of
trials.

A `ray.tune.Callback` runs in the driver process (DESIGN: only the driver talks to MLflow). ASHA
stops a trial by killing its actor, so nothing after the trial's last report runs inside it: the
callback closes child runs from here.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from ray.tune import Callback

from orchestrator.config import TrackingConfig
from orchestrator.errors import ConfigError
from orchestrator.report.cost import REPORTED_AT, RESTART_MARK, Ledger, Pricing, build_ledger
from orchestrator.tracking.client import MlflowTracker
from orchestrator.tracking.context import config_params
from orchestrator.tracking.uri import mask_password
from orchestrator.tuning.autopilot import find_board
from orchestrator.tuning.plan import TrialPlanner, plan_trial
from orchestrator.tuning.search import TRAIN_METRICS, trial_config

_METRICS = set(TRAIN_METRICS)  # and every val_* metric of the trial's task
_LEDGER_KEYS = {"step", "interval_s", "time_total_s", "world_size", RESTART_MARK, REPORTED_AT}


def trial_status(last: dict[str, Any], max_steps: int, errored: bool = False) -> str:
    """completed (reached max_steps) | stopped (early, by the scheduler) | error | running (no final
    result yet)."""
    if errored:
        return "error"
    if not last.get("done"):
        return "running"
    return "completed" if last.get("step", 0) >= max_steps else "stopped"


def trial_ledger(rows: list[dict[str, Any]], started: float | None, ended: float | None,
                 pricing: Pricing) -> Ledger:
    """A trial's cost ledger over the time it ran: from when Tune started it to its last result
    (`started`, `ended`: Tune's record, epoch seconds), restarts included. Tune's time_total_s
    cannot be that clock: on a restart Tune rewinds it to the checkpoint's, so the time lost since
    that checkpoint and the restart itself would be billed to nobody. Each report is placed at when
    it was made (REPORTED_AT, stamped by the trial's reporter); reports without the stamp (a wider
    trial's, whose restarts happen inside its own Train run) keep time_total_s."""
    def elapsed(row: dict[str, Any]) -> float:
        if REPORTED_AT in row and started is not None:
            return float(row[REPORTED_AT]) - started
        return float(row.get("time_total_s", 0.0))

    timeline = [row | {"elapsed_s": elapsed(row)} for row in rows]
    wall = max((r["elapsed_s"] for r in timeline), default=0.0)
    if started is not None and ended is not None:
        wall = max(wall, ended - started)
    return build_ledger(timeline, wall, pricing)


def format_table(rows: list[dict[str, Any]], keys: list[str], metric: str) -> str:
    """Fixed-width table: trial, status, each searched key, step, metric (and $ when rows carry
    `usd`)."""
    priced = any(row.get("usd") is not None for row in rows)
    header = ["trial", "status", *keys, "step", metric, *(["$"] if priced else [])]
    cells = [header]
    for row in rows:
        value = row.get("metric")
        usd = [f"{row['usd']:.4f}" if row.get("usd") is not None else "-"] if priced else []
        cells.append([row["trial_id"], row["status"], *(_short(row["params"].get(k)) for k in keys),
                      str(row.get("step") or "-"), "-" if value is None else f"{value:.4f}", *usd])
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in cells)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if 1e-3 <= abs(value) < 1e4 or value == 0 else f"{value:.2e}"
    return "-" if value is None else str(value)


@dataclass(frozen=True)
class StudyFacts:
    """What the study's callback knows of its study: its name, what its trials are planned from (the
    user's tree, the data's sizes: None, no cost ledger), the searched keys (the table's columns),
    its metric and step count, and whether its trials share one autopilot search
    (tuning/autopilot.py)."""

    name: str
    trials: TrialPlanner
    keys: tuple[str, ...]
    metric: str
    max_steps: int
    shared_search: bool = False


@dataclass(frozen=True)
class ParentRun:
    """The study's parent MLflow run, under which each trial's child run goes, and the store it is
    in."""

    tracking: TrackingConfig
    run_id: str


# The resuming command's callback of each study while Tuner.restore unpickles the saved one
# (`restored_as`).
_RESTORING: dict[str, StudyCallback] = {}


@contextmanager
def restored_as(callback: StudyCallback) -> Iterator[None]:
    """While Tune restores a study (Tuner.restore unpickles its tuner.pkl, in this process): its
    saved callback becomes `callback`, the resuming command's, whose URIs carry the passwords the
    saved one has masked."""
    _RESTORING[callback.study.name] = callback
    try:
        yield
    finally:
        _RESTORING.pop(callback.study.name, None)


class StudyCallback(Callback):
    """Child runs (tag mlflow.parentRunId: the UI nests them under the study's parent run) with
    params and step metrics (under the tracker's MLflow keys; the trial's cost and other facts in
    its summary table), closed with a terminal status and an `orchestrator.stop_reason` tag. On a
    terminal, one table of the trials (named by their values) redrawn in place on every status
    change and at most every `table_every_s`; on a pipe or a log (`live` false), one line per trial
    that ends. The study's summary prints the final table once. `parent`: None, tracking off."""

    def __init__(self, study: StudyFacts, parent: ParentRun | None = None, verbose: bool = True,
                 table_every_s: float = 2.0, live: bool | None = None) -> None:
        # What planning a trial needs of the data: only the sizes. The callback is pickled into the
        # study's saved state, which has no use for shard lists or storage handles.
        self.study = replace(study, trials=study.trials.sizes())
        self.parent = parent
        self.verbose, self.table_every_s, self.live = verbose, table_every_s, live
        self._runtime()

    def _runtime(self) -> None:
        self._runs: dict[str, MlflowTracker] = {}
        # per trial: what its cost ledger needs
        self._timeline: dict[str, list[dict[str, Any]]] = {}
        self._parent: MlflowTracker | None = None
        self._printed = 0.0
        self._started = time.monotonic()
        self._drawn = 0  # lines of the table on the terminal now, redrawn over

    def settings(self) -> dict[str, Any]:
        """What the callback is made of, without its clients and open runs."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    # Tune pickles its callbacks into the study's tuner.pkl (often in a shared bucket) for
    # Tuner.restore: settings only, with no password of any URI (the config tree's, the tracking
    # store's). Restored, the callback takes the resuming command's own settings (`restored_as`),
    # real passwords included, a rotated one too.
    def __getstate__(self) -> dict[str, Any]:
        state = self.settings() | {"study": replace(self.study, trials=self.study.trials.masked())}
        if self.parent is not None and self.parent.tracking.uri is not None:
            uri = mask_password(self.parent.tracking.uri)
            tracking = self.parent.tracking.model_copy(update={"uri": uri})
            state["parent"] = replace(self.parent, tracking=tracking)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        study = state["study"]  # a study saved by an earlier version kept its name alone here
        live = _RESTORING.get(study if isinstance(study, str) else study.name)
        self.__dict__.update(state if live is None else live.settings())
        self._runtime()

    def _run(self, trial: Any) -> MlflowTracker | None:
        if self.parent is None:
            return None
        if trial.trial_id in self._runs:
            return self._runs[trial.trial_id]
        study, parent = self.study.name, self.parent
        try:
            # reopening the parent only to search it; its status is the driver's
            if self._parent is None:
                self._parent = MlflowTracker(parent.tracking, study, run_id=parent.run_id)
            tags = {"mlflow.parentRunId": parent.run_id, "orchestrator.study": study,
                    "orchestrator.trial_id": trial.trial_id}
            existing = self._parent.find_run({"orchestrator.trial_id": trial.trial_id,
                                              "orchestrator.study": study})
            # Named by its searched values (study.py's trial names); the trial id is a tag.
            run = MlflowTracker(parent.tracking, str(trial), tags=tags, run_id=existing,
                                headline=self.study.metric)
            # the trial's resolved config, model defaults included; the study's tune.* not
            if existing is None:
                run.log_params(config_params(trial_config(self.study.trials.tree, trial.config)))
                run.log_datasets(dict(self.study.trials.datasets or {}))
        except Exception as exc:  # tracking never stops the study
            print(f"warning: no MLflow run for trial {trial.trial_id}: {exc}", file=sys.stderr)
            return None
        self._runs[trial.trial_id] = run
        return run

    def _close(self, trial: Any, errored: bool) -> None:
        run = self._runs.pop(trial.trial_id, None) or self._run(trial)
        if run is None:
            return
        status = trial_status(trial.last_result or {}, self.study.max_steps, errored)
        reason = {"completed": "max_steps", "stopped": "asha", "error": "error",
                  "running": "interrupted"}[status]
        tags = {"orchestrator.stop_reason": reason}
        timeline = self._timeline.pop(trial.trial_id, [])
        pricing = self._pricing(trial) if timeline else None
        if pricing is not None:
            meta = trial.run_metadata
            ledger = trial_ledger(timeline, meta.start_time, meta.last_result_time or None, pricing)
            run.log_metrics(ledger.metrics(), step=int(timeline[-1]["step"]))
        if errored and trial.error_file:
            tags["orchestrator.error_file"] = str(trial.error_file)
        run.set_tags(tags)
        run.finish({"completed": "FINISHED", "stopped": "FINISHED",
                    "error": "FAILED"}.get(status, "KILLED"))

    def _pricing(self, trial: Any) -> Pricing | None:
        """The trial's nodes and price, from its own plan: a searched scaling.num_workers (or cost
        key) changes what the trial holds, so the study's base config cannot price it."""
        if self.study.trials.datasets is None:
            return None
        try:
            return plan_trial(self.study.trials, trial.config).pricing
        # a trial whose config is invalid has already failed; tracking never stops the study
        except ConfigError:
            return None

    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._run(trial)
        self._table(trials)

    def on_trial_result(self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any],
                        **info: Any) -> None:
        run = self._run(trial)
        if run is not None and "step" in result:
            metrics = {k: v for k, v in result.items() if (k in _METRICS or k.startswith("val_"))
                       and isinstance(v, int | float)
                       and math.isfinite(v)}
            run.log_metrics(metrics, step=int(result["step"]))
        if "step" in result and "interval_s" in result:
            self._timeline.setdefault(trial.trial_id, []).append(
                {k: v for k, v in result.items() if k in _LEDGER_KEYS or k.startswith("time/")})
        self._table(trials)

    def _release(self, trial: Any) -> None:
        """A trial that ended while it ran the study's autopilot search (ASHA stops a trial by
        killing its actor): a waiting trial searches instead."""
        board = find_board(self.study.name) if self.study.shared_search else None
        if board is not None:
            board.release.remote(trial.trial_id)

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._release(trial)
        self._close(trial, errored=False)
        self._ended(trial, errored=False)
        self._table(trials, force=True)

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._release(trial)
        self._close(trial, errored=True)
        self._ended(trial, errored=True)
        self._table(trials, force=True)

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        # still open: the study was interrupted; resuming reopens them
        for trial_id in list(self._runs):
            run = self._runs.pop(trial_id)
            run.set_tags({"orchestrator.stop_reason": "interrupted"})
            run.finish("KILLED")

    def rows(self, trials: list[Any]) -> list[dict[str, Any]]:
        """One row per trial, named by its searched values (its Tune trial name), as the final table
        names it."""
        rows = []
        for trial in trials:
            last = trial.last_result or {}
            status = ("pending" if trial.status == "PENDING" else
                      trial_status(last, self.study.max_steps, errored=trial.status == "ERROR"))
            rows.append({"trial_id": str(trial), "status": status, "params": trial.config,
                         "step": last.get("step"), "metric": last.get(self.study.metric)})
        return rows

    def _live(self) -> bool:
        return sys.stdout.isatty() if self.live is None else self.live

    def _ended(self, trial: Any, errored: bool) -> None:
        """Off a terminal: the one line a trial's end gets (the table comes once, in the study's
        summary)."""
        if not self.verbose or self._live():
            return
        last = trial.last_result or {}
        status = trial_status(last, self.study.max_steps, errored)
        metric = self.study.metric
        value = last.get(metric)
        figure = f", {metric} {value:.4f}" if isinstance(value, int | float) else ""
        print(f"trial {trial} {status} at step {last.get('step', 0)}{figure}", flush=True)

    def _table(self, trials: list[Any], force: bool = False) -> None:
        """On a terminal: the trial table, drawn over the one before (cursor up its lines, clear to
        the end)."""
        now = time.monotonic()
        if (not self.verbose or not self._live()
                or (not force and now - self._printed < self.table_every_s)):
            return
        self._printed = now
        rows = self.rows(trials)
        counts = {s: sum(r["status"] == s for r in rows)
                  for s in ("running", "completed", "stopped", "error")}
        elapsed = int(now - self._started)
        text = (f"[{elapsed // 60}:{elapsed % 60:02d}] {self.study.name}: "
                + ", ".join(f"{n} {s}" for s, n in counts.items()) + "\n"
                + format_table(rows, list(self.study.keys), self.study.metric))
        over = f"\x1b[{self._drawn}F\x1b[J" if self._drawn else ""
        print(over + text, flush=True)
        self._drawn = text.count("\n") + 1
