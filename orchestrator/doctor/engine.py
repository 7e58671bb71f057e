"""Doctor's rule engine: `RULES`, every rule in the order it runs, and `diagnose`, which runs them
over a `RunRecord` and sorts the findings by severity, then by how strongly each rule fired. Add a
rule by writing it in the file of `doctor/rules/` that reads what it reads and appending it to
`RULES`."""

from __future__ import annotations

from orchestrator.doctor.record import Finding, Rule, RunRecord
from orchestrator.doctor.rules.autopilot import autopilot_gain
from orchestrator.doctor.rules.run_health import (
    bookkeeping,
    checkpoint_interval,
    evaluation,
    nonfinite_steps,
    report_blocking,
    startup,
)
from orchestrator.doctor.rules.speed import (
    compile_small_kernels,
    data_pipeline,
    gradient_sync,
    memory_headroom,
    model_state,
    precision,
    uneven_workers,
)
from orchestrator.doctor.rules.study import search_space_edge, study_size

RULES: list[Rule] = [startup, report_blocking, checkpoint_interval, data_pipeline, evaluation,
                     bookkeeping, gradient_sync, uneven_workers, memory_headroom, model_state,
                     precision, compile_small_kernels, nonfinite_steps, study_size,
                     search_space_edge, autopilot_gain]


def diagnose(run: RunRecord, rules: list[Rule] | None = None) -> list[Finding]:
    """Every rule's finding, most severe (then strongest) first."""
    found = [f for rule in (rules or RULES) if (f := rule(run)) is not None]
    return sorted(found, key=lambda f: (-f.severity, -f.score))
