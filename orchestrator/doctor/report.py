"""Doctor's report and entry points: `doctor` (read a run, diagnose it) and `summary` (the printed
report: `format_findings`, headed by the run's length, `_length`), as `orchestrator doctor RUN_ID`
calls them."""

from __future__ import annotations

import shlex

from orchestrator.doctor.engine import diagnose
from orchestrator.doctor.load import load_run
from orchestrator.doctor.record import (
    HIGH,
    LOW,
    MEDIUM,
    Finding,
    RunRecord,
    is_study,
    reason,
    settings,
    trial_counts,
)
from orchestrator.tracking.context import COMMAND_TAG

_SEVERITY = {HIGH: "high", MEDIUM: "medium", LOW: "low"}


def format_findings(run_id: str, run: RunRecord, findings: list[Finding]) -> str:
    status = run.tags.get("orchestrator.status", "")
    name = run.tags.get("mlflow.runName", run_id)
    lines = [f"doctor: run {name} ({run_id}){' ' + status if status else ''}, {_length(run)}"]
    if not findings:
        lines.append("no findings: nothing in the recorded metrics points at an easy win")
    elif _command(run, []) is None and any(settings(c) for f in findings for c in f.changes):
        lines.append("(the run was not started by `orchestrator train` or `tune`: "
                     "add these --set values to the overrides it was loaded with)")
    for i, f in enumerate(findings, 1):
        lines.append(f"{i}. [{_SEVERITY[f.severity]}] {f.rule}: {f.title}")
        for change in f.changes:
            # A command on a line of its own, as the shell takes it; anything else (its why on the
            # next line, a check to make, a search-space edit of the study's YAML) a shell comment:
            # the block pastes whole.
            values = settings(change)
            if values is None:
                lines.append(f"     # {change}")
                continue
            argv = _command(run, values) or [part for value in values for part in ("--set", value)]
            lines.append(f"     {shlex.join(argv)}")
            if (why := reason(change)) is not None:
                lines.append(f"       # {why}")
    return "\n".join(lines)


def _command(run: RunRecord, values: list[str]) -> list[str] | None:
    """The command that started the run (its `orchestrator.command`; for a run from before that tag,
    MLflow's `mlflow.source.name`) with `values` as `--set` flags after its own (a key they change
    loses its old value). Without `--resume` (a changed config trains a new run), without
    `--autopilot` when the values are the autopilot's choice (the flag would win over them), with
    `--fresh` for a study (one started with another config is refused; its trials so far stay in
    MLflow), and without a `--set` whose value MLflow keeps masked (`***`). None when `orchestrator
    train` or `tune` did not start it (Python)."""
    try:
        argv = shlex.split(run.tags.get(COMMAND_TAG) or run.tags.get("mlflow.source.name", ""))
    except ValueError:
        return None
    if argv[:1] != ["orchestrator"] or argv[1:2] not in (["train"], ["tune"]):
        return None
    autopilot_set = any(v.startswith("autopilot.") for v in values)
    drop = {"--resume", *(["--autopilot"] if autopilot_set else [])}
    changed = {value.split("=", 1)[0] + "=" for value in values}
    kept: list[str] = []
    for arg in argv:
        if arg in drop:
            continue
        if "***" in arg or (kept[-1:] == ["--set"] and arg.startswith(tuple(changed))):
            # the run's own value of a key that changes goes with its flag
            if kept[-1:] == ["--set"]:
                kept.pop()
            continue
        kept.append(arg)
    if argv[1] == "tune" and "--fresh" not in kept:
        kept.append("--fresh")
    return [*kept, *(part for value in values for part in ("--set", value))]


def _length(run: RunRecord) -> str:
    """'300 steps' for a run; 'study of 4 trials (3 completed, 1 stopped early)' for a study's
    parent run."""
    if not is_study(run):
        return f"{int(run.last('step') or 0)} steps"
    counts = trial_counts(run)
    if not counts:
        return "study (no trials recorded yet)"
    words = {"completed": "completed", "stopped": "stopped early", "error": "failed"}
    ended = ", ".join(f"{n} {words[status]}" for status, n in counts.items() if status in words)
    return f"study of {sum(counts.values())} trials" + (f" ({ended})" if ended else "")


def doctor(run_id: str, tracking_uri: str | None = None) -> tuple[RunRecord, list[Finding]]:
    run = load_run(run_id, tracking_uri)
    return run, diagnose(run)


def summary(run_id: str, result: tuple[RunRecord, list[Finding]]) -> str:
    return format_findings(run_id, *result)
