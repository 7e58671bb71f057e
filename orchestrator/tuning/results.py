"""What a finished study reports: one summary per trial, the best of them, `best.yaml` (ready for
`orchestrator train`), the plots and figures on the parent run, and the lines printed after it."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from orchestrator.config import Config, to_dict, to_yaml
from orchestrator.report.cost import PARTS, PRODUCTIVE, study_metrics
from orchestrator.report.plots import plot_lr_sweep, plot_trial_curves
from orchestrator.run.place import RunPlace
from orchestrator.tracking.links import experiment_of, experiment_url, run_url, ui_command
from orchestrator.tracking.tracker import Tracker
from orchestrator.tracking.uri import mask_password, mask_passwords
from orchestrator.tracking.view import NOTE_TAG
from orchestrator.tuning.plan import StudyPlan, TrialPlanner, plan_trial
from orchestrator.tuning.search import (
    TrialNamer,
    domains,
    peak_concurrency,
    short_keys,
    trial_config,
)
from orchestrator.tuning.trials import format_table, trial_ledger, trial_status


@dataclass
class TrialSummary:
    """One trial as the study ended: status is completed | stopped (early, by ASHA) | error |
    running."""

    trial_id: str
    params: dict[str, Any]
    status: str
    steps: int
    metric: float | None
    history: list[dict[str, Any]] = field(default_factory=list)
    cost: Any = None  # orchestrator.report.cost.Ledger of the trial's run
    # its searched values, `lr=3.2e-03,warmup=20` (search.TrialNamer); also its Tune trial name
    name: str = ""
    # When Ray Tune started the trial and when its last result reached the driver (epoch seconds,
    # the driver's clock): the trial's place among the study's concurrent trials. None where Tune
    # recorded none.
    started_at: float | None = None
    ended_at: float | None = None
    error: str | None = None  # the first line of a failed trial's error

    @property
    def label(self) -> str:
        return self.name or self.trial_id

    @property
    def usd(self) -> float | None:
        return self.cost.usd if self.cost is not None else None


@dataclass
class TuneResult:
    """What `tune()` returns: the best trial, its ready-to-train config (also written to
    `best_config_path`)."""

    config: Config
    best: TrialSummary
    trials: list[TrialSummary]
    metric: str
    mode: str
    best_config_path: str
    study_path: str
    parent_run_id: str | None
    tracking_uri: str | None
    resumed: bool
    rank_by: str = "metric"
    # the study's cost/* metrics (summed over trials)
    cost: dict[str, float] = field(default_factory=dict)
    # study/goodput and its parts (study_goodput)
    goodput: dict[str, float] = field(default_factory=dict)


# The study's reporting cadence: ASHA needs the metric at every report (docs/tune.md), so a study
# evaluates far more often than a run should; the winner is retrained at an ordinary run's cadence
# unless the study searched it.
STUDY_CADENCE = ("log_every", "eval_every")


def best_yaml(tree: dict[str, Any], params: dict[str, Any], header: str = "") -> str:
    """The full config with the best values, minus the tune section and the study's reporting
    cadence (see STUDY_CADENCE): `orchestrator train` takes it unchanged. It is logged to MLflow, so
    the password of every URI in it is masked, and said so: the command that trains it gives the
    password again."""
    tree = {**tree, "train": {k: v for k, v in tree.get("train", {}).items()
                              if k not in STUDY_CADENCE or f"train.{k}" in params}}
    config = to_dict(trial_config(tree, params))
    config.pop("tune")
    masked = mask_passwords(config)
    if masked != config:
        header += ("# Passwords in URIs are masked (***): give them with --set (e.g. --set "
                   "tracking.uri=...), or $MLFLOW_TRACKING_URI with tracking.uri left out.\n")
    return header + yaml.safe_dump(masked, sort_keys=False)


def _tune_trials(grid: Any) -> dict[str, tuple[str, float | None, float | None]]:
    """trial path -> (trial id, started, last result) as Ray Tune recorded them (Trial.run_metadata,
    kept in the study's saved state). The ResultGrid's own trials: Ray has no public accessor for
    them; empty if that changes."""
    found: dict[str, tuple[str, float | None, float | None]] = {}
    for trial in getattr(getattr(grid, "_experiment_analysis", None), "trials", None) or []:
        meta = getattr(trial, "run_metadata", None)
        start, last = getattr(meta, "start_time", None), getattr(meta, "last_result_time", None)
        found[str(trial.path)] = (trial.trial_id, start,
                                  last if isinstance(last, float) and last > 0 else None)
    return found


def _error_line(error: BaseException | None) -> str | None:
    """A failed trial's error in one line: the trial's own exception, not Ray's wrapping and
    traceback."""
    if error is None:
        return None
    cause = getattr(error, "cause", None) or error
    text = str(cause).strip()
    line = next((x.strip() for x in text.splitlines() if x.strip()), type(cause).__name__)
    return line if len(line) <= 200 else line[:197] + "..."


def summaries(grid: Any, trials_plan: TrialPlanner, metric: str, namer: TrialNamer | None = None
              ) -> list[TrialSummary]:
    """One TrialSummary per trial of the ResultGrid, each by its own plan (`trials_plan`: what the
    study plans its trials from); `namer` names them (default: by their params' keys)."""
    tune_trials = _tune_trials(grid)
    trials = []
    for result in grid:
        last = dict(result.metrics or {})
        params = dict(result.config or {})
        plan = plan_trial(trials_plan, params)
        max_steps = plan.config.train.max_steps or 0
        frame = result.metrics_dataframe
        history: list[dict[str, Any]] = []
        ledger = None
        fallback_id = str(last.get("trial_id") or Path(result.path).name)
        trial_id, started, ended = tune_trials.get(str(result.path), (fallback_id, None, None))
        if frame is not None and "step" in frame:
            # Priced from the trial's own config: a searched num_workers changes the nodes it held.
            rows = [{k: v for k, v in row.items() if v == v} for row in frame.to_dict("records")]
            ledger = trial_ledger(rows, started, ended, plan.pricing)
        if frame is not None and "step" in frame:
            keep = [c for c in ("step", "train_loss", "val_loss", "val_accuracy", metric,
                                "samples_per_s", "train_samples_per_s") if c in frame]
            # v == v drops NaN (reports without eval)
            history = [{k: v for k, v in row.items() if v == v}
                       for row in frame[list(dict.fromkeys(keep))].to_dict("records")]
        name = (namer or TrialNamer(tuple(short_keys(params).items())))(params)
        trials.append(TrialSummary(
            trial_id=trial_id, params=params,
            status=trial_status(last, max_steps, errored=result.error is not None),
            steps=int(last.get("step", 0)), metric=last.get(metric), history=history,
            cost=ledger, name=name, started_at=started, ended_at=ended,
            error=_error_line(result.error),
        ))
    return trials


def pick_best(trials: list[TrialSummary], mode: str,
              rank_by: str = "metric") -> TrialSummary | None:
    """Best final metric among trials that ran to the end (an early-stopped trial's value is from
    fewer steps); among all trials with a value when none completed. rank_by=metric_per_dollar:
    metric / the trial's $."""
    scored = [t for t in trials if t.metric is not None]
    if rank_by == "metric_per_dollar":
        scored = [t for t in scored if t.usd]
    pool = [t for t in scored if t.status == "completed"] or scored
    if not pool:
        return None
    if rank_by == "metric_per_dollar":
        return max(pool, key=lambda t: t.metric / t.usd)  # type: ignore[operator]
    pick = max if mode == "max" else min
    return pick(pool, key=lambda t: t.metric)  # type: ignore[arg-type,return-value]


def local_dir(place: RunPlace) -> Path:
    """Where the study's local files go (best.yaml, plots, the log): its directory, or for a study
    stored in S3 ./<study> in the working directory."""
    return Path(place.path) if "://" not in place.uri else Path.cwd() / place.name


def record(plan: StudyPlan, trials: list[TrialSummary], best: TrialSummary, tracker: Tracker,
           resumed: bool, began: float | None = None) -> TuneResult:
    """best.yaml, plots and the best trial (by tune.metric, in its resolved mode) on the parent run.
    `began`: when the command started (epoch seconds): the study's goodput is over its wall clock
    since then, and the trials it started (a resumed study's earlier trials ran in another
    command)."""
    config, tree, place = plan.config, plan.trials.tree, plan.place
    metric, mode = config.tune.metric, plan.mode
    study, study_path = place.name, place.uri
    values = ", ".join(f"{k}={v}" for k, v in best.params.items())
    header = (f"# Best of study {study}: trial {best.trial_id} ({best.label}), "
              f"{metric}={best.metric:.4f} with {values}.\n# Reports and evaluates at "
              "an ordinary run's cadence (train.log_every, train.eval_every), not "
              "the study's.\n# Train it: orchestrator train --config <this file>\n")
    out = local_dir(place)
    out.mkdir(parents=True, exist_ok=True)
    best_path = out / "best.yaml"
    best_path.write_text(best_yaml(tree, best.params, header))
    keys = list(config.tune.space)
    listed = {key for key, domain in domains(config).items() if domain.kind in ("choice", "grid")}
    plots = [plot_lr_sweep(trials, keys, metric, out / "metric_vs_lr.png", categorical=listed),
             plot_trial_curves(trials, metric, out / "learning_curves.png")]
    tracker.log_artifact(best_path)
    for plot in plots:  # top level: beside best.yaml, where the run's Artifacts tab opens
        tracker.log_artifact(plot)
    with tempfile.TemporaryDirectory() as tmp:
        # no password of a URI
        (Path(tmp) / "study.yaml").write_text(mask_password(to_yaml(config)))
        tracker.log_artifact(Path(tmp) / "study.yaml")

    cost = study_metrics([t.cost for t in trials if t.cost is not None])
    goodput = {} if began is None else study_goodput(
        [t for t in trials if t.started_at is None or t.started_at >= began], time.time() - began)
    counts = {s: sum(t.status == s for t in trials) for s in ("completed", "stopped", "error")}
    # Figures of the whole study: rows of the parent run's summary table (tracking/view.py), not
    # one-point charts. The best trial's headline figures as the parent run's metrics: the runs
    # table compares studies with each other and with runs by them. Summary rows below.
    tracker.log_metrics(headline_figures(best, metric), step=best.steps)
    tracker.log_metrics({f"study/best_{metric}": best.metric or 0.0,
                         **{f"study/trials_{s}": n for s, n in counts.items()}, **cost, **goodput},
                        step=best.steps)
    tracker.set_tags({"orchestrator.best_trial": best.trial_id,
                      "orchestrator.best_params": json.dumps(best.params),
                      "orchestrator.best_config": str(best_path),
                      NOTE_TAG: study_note(trials, best, metric, cost)})
    return TuneResult(
        config=trial_config(tree, best.params), best=best, trials=trials, metric=metric, mode=mode,
        best_config_path=str(best_path), study_path=study_path, parent_run_id=tracker.run_id,
        tracking_uri=getattr(tracker, "uri", None), resumed=resumed, rank_by=config.tune.rank_by,
        cost=cost, goodput=goodput,
    )


def headline_figures(trial: TrialSummary, metric: str) -> dict[str, float]:
    """The trial's headline figures (tracking.view.headline_keys: training loss, `metric`, training
    samples/s) at its last report that has each."""
    figures: dict[str, float] = {}
    for row in trial.history:
        figures |= {k: v for k, v in row.items()
                    if k in ("train_loss", metric, "train_samples_per_s")}
    return figures


def study_goodput(trials: list[TrialSummary], wall_s: float) -> dict[str, float]:
    """A study's goodput, as ML goodput counts a job's: its trials' productive seconds (compute +
    sync of the steps they kept) over the trial-seconds its wall clock held (the wall clock times
    the trials it ran at once, at most). What the trials ASHA stopped held, and the productive part
    of it, are shown apart. {} without ledgers."""
    priced = [t for t in trials if t.cost is not None]
    spans = [(t.started_at, t.ended_at) for t in priced
             if t.started_at is not None and t.ended_at is not None]
    slots = peak_concurrency(spans) or 1  # type: ignore[arg-type]
    held = wall_s * slots
    if not priced or held <= 0:
        return {}

    def productive(t: TrialSummary) -> float:
        return sum(t.cost.seconds.get(p, 0.0) for p in PRODUCTIVE)

    stopped = [t for t in priced if t.status == "stopped"]
    return {"study/goodput": sum(map(productive, priced)) / held, "study/wall_s": wall_s,
            "study/slots": float(slots),
            "study/stopped_trials_frac": sum(t.cost.wall_s for t in stopped) / held,
            "study/stopped_productive_frac": sum(map(productive, stopped)) / held}


def study_note(trials: list[TrialSummary], best: TrialSummary, metric: str,
               cost: dict[str, float]) -> str:
    """The parent run's description: the best trial and its figure, how the trials ended, what the
    study cost."""
    counts = {s: sum(t.status == s for t in trials) for s in ("completed", "stopped", "error")}
    text = (f"Best trial {best.label}: {metric} {best.metric:.4g} at step "
            f"{best.steps}. {len(trials)} trials: {counts['completed']} completed, "
            f"{counts['stopped']} stopped early, {counts['error']} failed.")
    if "cost/usd" in cost:
        text += f" Cost ${cost['cost/usd']:.4f}."
    elif "cost/node_hours" in cost:
        text += f" {cost['cost/node_hours']:.4f} node-hours."
    return text + " Each trial is a child run, named by its values; best.yaml trains the best one."


def summary(result: TuneResult) -> str:
    """The lines printed after a study: the table, the best trial, and how to train it."""
    lines = [final_table(result), ""]
    counts = {s: sum(t.status == s for t in result.trials)
              for s in ("completed", "stopped", "error")}
    spans = [(t.started_at, t.ended_at) for t in result.trials
             if t.started_at is not None and t.ended_at is not None]
    at_once = f" (at most {peak_concurrency(spans)} at once)" if spans else ""
    b = result.best
    lines += [f"study {Path(result.study_path).name}{' (resumed)' if result.resumed else ''}: "
              f"{len(result.trials)} trials{at_once}, {counts['completed']} completed, "
              f"{counts['stopped']} stopped early, {counts['error']} failed",
             *[f"trial {t.label} ({t.trial_id}) failed: {t.error}"
               for t in result.trials if t.error],
             f"best trial {b.label} ({b.trial_id}): {result.metric} "
             f"{b.metric:.4f} at step {b.steps} with "
             + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in b.params.items()),
             *([f"ranked by {result.metric} per dollar: "
                f"{b.metric / b.usd:.4g} per $ (${b.usd:.4f})"]
               if result.rank_by == "metric_per_dollar" and b.usd else []),
             *([study_cost_line(result.cost)] if result.cost else []),
             *([goodput_line(result.goodput)] if result.goodput else []),
             f"best config: {result.best_config_path}",
             f"train it: orchestrator train --config {result.best_config_path}"]
    if result.parent_run_id:
        uri = result.tracking_uri or ""
        lines.append(f"MLflow parent run id: {result.parent_run_id}")
        lines.append(f"open the MLflow UI: {ui_command(uri, result.config.tracking.experiment)}")
        experiment = experiment_of(result.parent_run_id)
        if experiment:  # the runs list shows the parent with its trials nested under it
            lines.append(f"the study's runs in the MLflow UI: {experiment_url(uri, experiment)}")
        url = run_url(uri, result.parent_run_id, tab="overview")
        if url:
            lines.append(f"this study in the MLflow UI: {url}")
    return "\n".join(lines)


def ranked(trials: list[TrialSummary], mode: str, rank_by: str = "metric") -> list[TrialSummary]:
    """Best first, as pick_best ranks (by the metric, or per dollar): trials that ran to the end,
    then the early- stopped ones, then those without a figure."""
    def key(t: TrialSummary) -> tuple[int, float]:
        if t.metric is None or (rank_by == "metric_per_dollar" and not t.usd):
            return (2, 0.0)
        per_dollar = rank_by == "metric_per_dollar"
        value = t.metric / t.usd if per_dollar else t.metric  # type: ignore[operator]
        return (0 if t.status == "completed" else 1,
                -value if mode == "max" or rank_by != "metric" else value)

    return sorted(trials, key=key)


def final_table(result: TuneResult) -> str:
    """The table printed after a study: the trials best first, with their searched values, the best
    one marked; named by their values, then the id that finds their directory and MLflow run."""
    keys = list(result.best.params)
    short = short_keys(keys)
    rows = [{"trial_id": t.label, "status": t.status,
             "params": {short[k]: t.params.get(k) for k in keys},
             "step": t.steps, "metric": t.metric, "usd": t.usd}
            for t in ranked(result.trials, result.mode, result.rank_by)]
    table = format_table(rows, list(short.values()), result.metric).splitlines()
    ids = ["id"] + [t.trial_id for t in ranked(result.trials, result.mode, result.rank_by)]
    width = max(map(len, table))
    return "\n".join(f"{line.ljust(width)}  {tid}"
                     + ("  <- best" if tid == result.best.trial_id else "")
                     for line, tid in zip(table, ids, strict=True))


def _share(frac: float) -> str:
    """A share as the summary prints it: whole percents, one decimal below 10%, '<0.1%' for a
    sliver."""
    if 0 < frac < 0.001:
        return "<0.1%"
    return f"{frac:.1%}" if frac < 0.1 else f"{frac:.0%}"


def goodput_line(g: dict[str, float]) -> str:
    """'study goodput 30%: productive trial time over 100 s x 2 trial slots | trials ASHA stopped
    held 12% (5% productive)'."""
    line = (f"study goodput {_percent(g['study/goodput'])}: productive trial time over "
            f"{g['study/wall_s']:.0f} s")
    line += (f" x {g['study/slots']:.0f} trial slots" if g["study/slots"] > 1
             else " of the study's wall clock")
    if g["study/stopped_trials_frac"] > 0:
        line += (f" | trials ASHA stopped held {_share(g['study/stopped_trials_frac'])} "
                 f"({_percent(g['study/stopped_productive_frac'])} productive)")
    return line


def _percent(frac: float) -> str:
    """Two significant digits, however small: a study of short trials has a goodput of a fraction of
    a percent."""
    return f"{100 * frac:.2g}%" if frac < 0.1 else f"{frac:.0%}"


def study_cost_line(cost: dict[str, float]) -> str:
    """'study cost: $0.0421 over 4 trials, 0.0210 node-hours | productive 38% | start-up 51% | eval
    9.0% | ...': the trials' node-hours split as their cost ledgers split them (compute + sync is
    productive); every other part of at least 0.5% follows, largest first, so a small productive
    share comes with what took the time."""
    usd = f"${cost['cost/usd']:.4f}" if "cost/usd" in cost else "unpriced"
    head = (f"study cost: {usd} over {cost['cost/trials']:.0f} trials, "
            f"{cost['cost/node_hours']:.4f} node-hours")
    if "cost/productive_frac" not in cost:
        return f"{head} | productive share unknown: no trial ran long enough to report its timings"
    others = sorted((cost.get(f"cost/{p}_frac", 0.0), p) for p in PARTS if p not in PRODUCTIVE)
    shares = [f"{p.replace('startup', 'start-up').replace('_', ' ')} {_share(f)}"
              for f, p in reversed(others) if f >= 0.005]
    return " | ".join([head, f"productive {_share(cost['cost/productive_frac'])}", *shares])
