"""Doctor's report and entry points: `doctor` (read a run, diagnose it) and `summary` (the printed report:
`format_findings`, headed by the run's length, `_length`), as `orchestrator doctor RUN_ID` calls them."""

from __future__ import annotations

from orchestrator.doctor.engine import diagnose
from orchestrator.doctor.load import load_run
from orchestrator.doctor.record import HIGH, LOW, MEDIUM, Finding, RunRecord, is_study, trial_counts

_SEVERITY = {HIGH: "high", MEDIUM: "medium", LOW: "low"}


def format_findings(run_id: str, run: RunRecord, findings: list[Finding]) -> str:
    status = run.tags.get("orchestrator.status", "")
    name = run.tags.get("mlflow.runName", run_id)
    lines = [f"doctor: run {name} ({run_id}){' ' + status if status else ''}, {_length(run)}"]
    if not findings:
        lines.append("no findings: nothing in the recorded metrics points at an easy win")
    for i, f in enumerate(findings, 1):
        lines.append(f"{i}. [{_SEVERITY[f.severity]}] {f.rule}: {f.title}")
        # Config keys as the --set flag that applies them; search-space edits go in the study's YAML.
        lines.extend(f"     --set {change}" if "=" in change and not change.startswith("tune.space.")
                     else f"     {change}" for change in f.changes)
    return "\n".join(lines)


def _length(run: RunRecord) -> str:
    """'300 steps' for a run; 'study of 4 trials (3 completed, 1 stopped early)' for a study's parent run."""
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
