"""What a training run returns (`TrainResult`) and the lines printed after it: the whole-run figures
MLflow keeps under `final/...`, where the time and money went, where the checkpoint and the MLflow
run are."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from orchestrator.config import Config
from orchestrator.report.autopilot import gain_line
from orchestrator.tracking.links import run_url, ui_command
from orchestrator.training.checkpoint_interval import auto_interval, mtbf_origin


@dataclass
class TrainResult:
    """What `train()` returns: the last reported metrics, where the final checkpoint is, and the
    MLflow run."""

    config: Config
    metrics: dict[str, Any]
    checkpoint_path: str | None
    run_dir: str
    run_id: str | None
    tracking_uri: str | None
    history: list[dict[str, Any]] = field(default_factory=list)
    # orchestrator.report.cost.Ledger: node-hours, $ and the productive/overhead split
    cost: Any = None
    # seconds per start-up part, to the first step
    startup: dict[str, float] = field(default_factory=dict)
    # stages run at once with one of those parts
    startup_alongside: dict[str, float] = field(default_factory=dict)
    # a resumed run's Ledger over all its attempts (cost.ledger_across_attempts); else None
    run_cost: Any = None
    attempts: int = 1  # driver attempts of this run: the first command and each `--resume`
    # the autopilot's report (report/autopilot.py); None without it
    autopilot: dict[str, Any] | None = None
    # a `--resume` of a run that had finished: nothing trained, its result as it was
    already_finished: bool = False

    @property
    def run_name(self) -> str:
        """The run's one name (runs.run_name): its directory's, its MLflow run's."""
        return self.run_dir.rstrip("/").rsplit("/", 1)[-1]

    def finished_record(self) -> dict[str, Any]:
        """What the run's record keeps once it finished (`finished`): its step, result figures,
        final checkpoint."""
        return {"step": self.metrics.get("step"), "checkpoint": self.checkpoint_path,
                "metrics": _result_figures(self.metrics)}


def finished_result(config: Config, run_dir: str, record: Mapping[str, Any],
                    tracking_uri: str | None) -> TrainResult:
    """A finished run's result from its record (`TrainResult.finished_record`): what `--resume` of
    it returns. `tracking_uri`: the store the run's MLflow run is in, when this command tracks to it
    (else the record's)."""
    finished = record["finished"]
    return TrainResult(config, {**finished.get("metrics", {}), "step": finished.get("step")},
                       finished.get("checkpoint"), run_dir, record.get("mlflow_run_id"),
                       tracking_uri or record.get("tracking_uri"), already_finished=True)


def _result_figures(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The training loss and every validation figure: the run's result in a line."""
    return {k: float(v) for k, v in metrics.items() if (k == "train_loss" or k.startswith("val_"))
            and isinstance(v, int | float) and not isinstance(v, bool)}


def run_summary(history: list[dict[str, Any]]) -> dict[str, float]:
    """Whole-run figures from the reports: throughput and MFU over the wall clock of the training
    (every interval, reports and checkpoints included; a step redone after a restart counts once),
    time shares, compile time, and the last validation figures. MLflow holds them under `final/...`
    (tracking.view.mlflow_key)."""
    kept = list({int(r["step"]): r for r in history if "interval_s" in r}.values())
    seconds = sum(r["interval_s"] for r in kept)
    summary: dict[str, float] = {}
    if seconds > 0:
        # Per-interval rates and shares, weighted by each interval's wall seconds.
        keys = {k for r in kept for k in r if k.startswith("time/")} | {"samples_per_s"}
        keys |= {k for k in ("tokens_per_s", "mfu") if all(k in r for r in kept)}
        for key in sorted(keys):
            weighted = sum(r.get(key, 0.0) * r["interval_s"] for r in kept)
            summary[f"summary/{key}"] = weighted / seconds
    if any("compile_s" in r for r in history):
        summary["summary/compile_s"] = sum(r.get("compile_s", 0.0) for r in history)
    evaluated = [r for r in history if "val_loss" in r]
    if evaluated:
        summary |= {f"summary/{k}": float(v) for k, v in evaluated[-1].items()
                    if k.startswith("val_") and isinstance(v, int | float)}
    return summary


def parallel_line(history: list[dict[str, Any]]) -> str | None:
    """'parallel: fsdp over 2 workers, each holding 1.2 GiB of parameters and 2.4 GiB of optimizer
    state', from the worker's facts in the latest (re)start's first report; None when the workers
    sent none."""
    facts = next((r for r in reversed(history) if "param_bytes_per_rank" in r), None)
    if facts is None:
        return None
    world = facts.get("world_size")
    workers = (", each" if world is None else " on 1 worker," if world == 1
               else f" over {world} workers, each")
    return (f"parallel: {facts.get('parallel', 'ddp')}{workers} holding "
            f"{_bytes(facts['param_bytes_per_rank'])} of parameters and "
            f"{_bytes(facts.get('optimizer_bytes_per_rank', 0))} of optimizer state")


def checkpoint_interval_line(config: Config, history: list[dict[str, Any]]) -> str | None:
    """'checkpoint interval: auto, 7.2 s (about 720 steps): sqrt(2 x 0.0072 s a checkpoint x 3,600 s
    between interruptions); 3,600 s assumed ...': checkpoint.every=auto's interval from the last
    report's figures (C: the last checkpoint's measured blocking time), and where the time between
    interruptions came from; None for a fixed interval or before any checkpoint cost was
    measured."""
    last = next((r for r in reversed(history) if "checkpoint/interval_s" in r), None)
    if config.checkpoint.every != "auto" or last is None:
        return None
    interval = auto_interval(last["checkpoint/cost_s"], last["checkpoint/mtbf_s"],
                             config.checkpoint.every_minutes)
    rate = last.get("samples_per_s")
    steps = (f" (about {interval.seconds * rate / config.train.global_batch_size:,.0f} steps)"
             if rate else "")
    origin = mtbf_origin(interval.mtbf_s, int(last.get("checkpoint/interruptions", 0)),
                         config.failure.mtbf_minutes)
    return (f"checkpoint interval: auto, {interval.seconds:,.1f} s{steps}: "
            f"{interval.why()}; {origin}")


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def summary(result: TrainResult) -> str:
    """The lines printed after a run: final accuracy, where the time went, where things are, how to
    look at them."""
    m = result.metrics
    if result.already_finished:
        figures = sorted(_result_figures(m).items(), key=lambda kv: (kv[0] != "train_loss", kv[0]))
        shown = (", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in figures)
                 or "no figures recorded")
        return "\n".join([f"{result.run_name} finished at step {m.get('step')} (its "
                          f"result: {shown}): nothing to "
                          "resume", f"run directory: {result.run_dir}", *_where(result)])
    lines = [f"finished {result.run_name}: step {m.get('step')}, "
             f"train loss {m.get('train_loss', float('nan')):.4f}"]
    if ("val_accuracy" in m and result.config.task.kind is not None
            and result.config.task.kind.label == "classes"):
        lines.append(f"final validation accuracy: {m['val_accuracy']:.4f} "
                     f"(val loss {m['val_loss']:.4f})")
    elif "val_loss" in m:  # every validation figure of the task, its headline first
        keys = sorted((k for k in m if k.startswith("val_")),
                      key=lambda k: (k != result.config.tune.metric, k))
        lines.append("final validation: "
                     + " | ".join(f"{k.removeprefix('val_')} {m[k]:.4f}" for k in keys))
    if result.cost is not None:
        lines.append(result.cost.time_line())
    if result.history:
        figures = run_summary(result.history)
        throughput = f"throughput: {figures.get('summary/samples_per_s', 0):,.0f} samples/s"
        if "summary/tokens_per_s" in figures:
            throughput += f", {figures['summary/tokens_per_s']:,.0f} tokens/s"
        if "summary/mfu" in figures:
            throughput += f", MFU {figures['summary/mfu']:.1%}"
        lines.append(throughput + " over the training's wall clock (first step to last)")
    gained = gain_line(result.autopilot, result.history)
    if gained:
        lines.append(gained)
    if result.cost is not None:
        lines.append(result.cost.line())
    if result.run_cost is not None:
        lines.append(f"run over its {result.attempts} attempts (the commands' own "
                     f"time): {result.run_cost.time_line().removeprefix('time: ')} "
                     f"| ETTR {result.run_cost.ettr:.0%}")
    held = parallel_line(result.history)
    if held:
        lines.append(held)
    interval = checkpoint_interval_line(result.config, result.history)
    if interval:
        lines.append(interval)
    return "\n".join([*lines, *_where(result)])


def _where(result: TrainResult) -> list[str]:
    """Where the run's final checkpoint and its MLflow run are, and how to open it."""
    lines = [f"checkpoint: {result.checkpoint_path}"]
    if result.run_id:
        lines.append(f"MLflow run id: {result.run_id}")
        command = ui_command(result.tracking_uri or "", result.config.tracking.experiment)
        lines.append(f"open the MLflow UI: {command}")
        url = run_url(result.tracking_uri or "", result.run_id)
        if url:
            lines.append(f"this run in the MLflow UI: {url}")
    return lines
