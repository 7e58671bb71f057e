"""What a run holds (the same for a Tune trial's child run and a study's parent run): the loop
reports under its own names (the progress line, the history and Tune use them); `mlflow_key` names
each in MLflow, in sections (`train/`, `val/`, `perf/`, `time/`, `system/`, `memory/`), and
`logged_as` says where it goes. The three a user looks for first, the training loss, the task's
validation metric and samples/s, are charted in the `headline/` section, which the UI shows first
(it sorts sections by name). Series that change from report to report are metrics; a series reported
more than once whose values never changed (`comm_bytes_per_sample` on one worker, top-5 accuracy on
5 classes), facts that do not change (the worker's pid, precision, FLOPs per sample, device facts,
the start-up breakdown) and whole-run figures (`final/*`, the cost ledger `cost/*`, the autopilot's
`autopilot/*`) go into one `summary.json` table artifact, rounded and grouped, and the headline
figures into the run's description (`mlflow.note.content`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

# The loop's (and the driver's) names -> MLflow keys. A name not listed keeps its key (a `val_*`
# becomes `val/*`).
_KEYS = {
    "train_loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "step": "train/step", "epoch": "train/epoch", "samples_seen": "train/samples_seen",
    "skipped_steps": "train/skipped_steps", "nonfinite_skipped": "train/nonfinite_skipped",
    "oom_retries": "train/oom_retries", "micro_batch_size": "train/micro_batch_size",
    "grad_accum_steps": "train/grad_accum_steps", "global_batch": "train/global_batch",
    "precision": "train/precision", "world_size": "train/world_size",
    "worker_pid": "train/worker_pid",
    # train.parallel's facts: ddp or fsdp, and the fp32 parameter and optimizer-state bytes one
    # worker holds.
    "parallel": "train/parallel", "param_bytes_per_rank": "train/param_bytes_per_rank",
    "optimizer_bytes_per_rank": "train/optimizer_bytes_per_rank",
    # samples/s over the interval's wall clock (the cost ledger's), and training's own pace (the
    # headline's).
    "samples_per_s": "perf/samples_per_s", "train_samples_per_s": "perf/train_samples_per_s",
    "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu",
    # One name for the interval's data-wait share (the loop reports it twice, as a time/* share and
    # on its own).
    "data_wait_frac": "perf/data_wait_frac", "time/data_wait_frac": "perf/data_wait_frac",
    "comm_bytes": "perf/comm_bytes", "comm_bytes_per_sample": "perf/comm_bytes_per_sample",
    "flops_per_sample": "perf/flops_per_sample", "compile_s": "perf/compile_s",
    "interval_s": "time/interval_s", "eval_s": "time/eval_s",
    # checkpoint.every=auto's interval and its inputs: not a `checkpoint/` section, which the run
    # page would list before the headline one (it orders sections by name).
    "checkpoint/interval_s": "time/checkpoint_interval_s",
    "checkpoint/cost_s": "time/checkpoint_cost_s",
    "checkpoint/mtbf_s": "time/mtbf_s", "checkpoint/interruptions": "train/interruptions",
}
# Keys whose value does not change from report to report (or that only count rare events): the
# summary table's.
_FACTS = {"train/step", "train/epoch", "train/samples_seen", "train/skipped_steps",
          "train/nonfinite_skipped", "train/oom_retries", "train/micro_batch_size",
          "train/grad_accum_steps", "train/global_batch",
          "train/precision", "train/world_size", "train/worker_pid", "perf/comm_bytes",
          "perf/flops_per_sample", "perf/compile_s", "train/parallel", "train/param_bytes_per_rank",
          "train/optimizer_bytes_per_rank", "train/interruptions"}
# Sections of whole-run figures, of a study's (`study/`) and of the autopilot's search
# (`autopilot/`, its predicted and achieved speed-up: report/autopilot.py): rows of the summary
# table, never charted.
_SUMMARY_SECTIONS = ("final/", "cost/", "startup/", "device/", "study/", "autopilot/")
# The summary table's groups, in the order a reader wants them; a figure of another section comes
# after.
_SUMMARY_ORDER = ("final", "autopilot", "study", "cost", "startup", "train", "val", "perf",
                  "device")
# What only the driver uses: when a report arrived, the worker's start-up marks, which rank
# reported, events, the autopilot's report (a table, never a metric: report/autopilot.py takes it
# out of the report).
_DROPPED = {"elapsed_s", "world_rank", "drain_checkpoint", "autopilot"}
SUMMARY_TABLE = "summary.json"
# The section that holds the training loss, the task's validation metric and samples/s: MLflow 3's
# run page sorts its chart sections by name (plain string order, then localeCompare), so this one
# comes before memory/, perf/, replicas/, time/, train/, val/...; no charted key may have a section
# that sorts before it (tests/unit/test_summary_keys.py checks every mode's keys).
HEADLINE = "headline/"
NOTE_TAG = "mlflow.note.content"  # the run's description in the UI
SIGNIFICANT = 4  # digits of a figure in the summary table


def mlflow_key(name: str) -> str:
    """The MLflow key under which a figure the loop (or the driver) reports as `name` is logged and
    read back: a metric's, or a row of the summary table's (`logged_as` says which). Idempotent: a
    key maps to itself. `summary/<name>` (a whole-run figure of `name`) ->
    `final/<mlflow_key(name)>`."""
    if name.startswith("summary/"):
        return "final/" + mlflow_key(name.removeprefix("summary/"))
    if name in _KEYS:
        return _KEYS[name]
    if name.startswith("val_"):
        return "val/" + name.removeprefix("val_")
    return name


def logged_as(key: str) -> Literal["metric", "summary"] | None:
    """Where the figure under MLflow key `key` goes: a metric (a series over steps; one whose values
    never change is moved to the summary table when the run ends, see MlflowTracker), a row of the
    run's summary table, or nowhere (None: the driver's own bookkeeping)."""
    if key in _DROPPED or key.startswith("at/"):
        return None
    if key in _FACTS or key.startswith(_SUMMARY_SECTIONS):
        return "summary"
    return "metric"


def headline_keys(metric: str | None) -> dict[str, str]:
    """MLflow key -> the key it is charted under in the headline section: the training loss, the
    task's validation metric `metric` (tune.metric, resolved per task; val_loss when it is not a
    validation figure) and training's samples/s (evaluation and checkpoints taken out, so a steady
    run charts a flat line)."""
    val = metric if metric and metric.startswith("val_") else "val_loss"
    return {mlflow_key(name): HEADLINE + name
            for name in ("train_loss", val, "train_samples_per_s")}


def canonical_key(key: str) -> str:
    """The MLflow key a charted key reads back as: `headline/<name>` -> `mlflow_key(name)`, anything
    else itself."""
    return mlflow_key(key.removeprefix(HEADLINE)) if key.startswith(HEADLINE) else key


def chart_key(key: str, metric: str | None) -> str:
    """The key under which the metric with MLflow key `key` is charted, on a run whose validation
    metric is `metric`."""
    return headline_keys(metric).get(key, key)


def rounded(value: Any) -> Any:
    """A float to SIGNIFICANT significant digits (what the summary table shows); anything else as it
    is."""
    if isinstance(value, float) and math.isfinite(value) and value != 0:
        return float(f"{value:.{SIGNIFICANT}g}")
    return value


def summary_rows(figures: Mapping[str, Any]) -> list[list[Any]]:
    """[section, figure, value] rows of the summary table: grouped by section (_SUMMARY_ORDER
    first), by name within one, each value rounded."""
    def order(key: str) -> tuple[int, str]:
        section = key.split("/")[0]
        rank = _SUMMARY_ORDER.index(section) if section in _SUMMARY_ORDER else len(_SUMMARY_ORDER)
        return (rank, key)

    return [[key.split("/")[0] if "/" in key else "run", key, rounded(figures[key])]
            for key in sorted(figures, key=order)]


def headline_note(figures: Mapping[str, Any], metric: str | None = None) -> str:
    """The run's description: its headline figures in one line, from the summary table's figures (by
    MLflow key), the task's validation `metric` first."""
    parts = []
    val = {k.removeprefix("final/val/"): v for k, v in figures.items()
           if k.startswith("final/val/")}
    head = (metric or "").removeprefix("val_")
    if val:
        names = sorted(val, key=lambda n: (n != head, n != "loss", n))[:2]
        text = ", ".join(f"val_{n} {rounded(float(val[n])):.4g}" for n in names)
        step = figures.get("train/step")
        parts.append(text + (f" at step {int(step)}" if isinstance(step, int | float) else ""))
    if isinstance(figures.get("final/perf/samples_per_s"), int | float):
        parts.append(f"{figures['final/perf/samples_per_s']:,.0f} samples/s over the training")
    if isinstance(figures.get("startup/total_s"), int | float):
        parts.append(f"start-up {figures['startup/total_s']:.1f} s")
    if isinstance(figures.get("cost/wall_s"), int | float):
        wall = f"{figures['cost/wall_s']:.0f} s wall clock"
        if isinstance(figures.get("cost/productive_frac"), int | float):
            share = figures["cost/productive_frac"]
            wall += f", productive {share:.0%}" if share >= 0.1 else f", productive {share:.1%}"
        parts.append(wall)
    if isinstance(figures.get("cost/usd"), int | float):
        parts.append(f"${figures['cost/usd']:.4f}")
    return "; ".join(parts) + ("." if parts else "") + (" All run-level figures: "
                                                        "the summary.json artifact."
                                                       if parts else "")
