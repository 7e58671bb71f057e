"""Every doctor rule (doctor/engine.py RULES) on every kind of run record, table-driven: a finished run, one that
failed before its first report and one that failed mid-run, a resumed run, a `checkpoint.every: auto` run, a study's
parent (finished, and still without trials), autopilot runs (searched, kept from the checkpoint, skipped, on GPUs),
an fsdp GPU run that ran out of memory and a record with nothing in it. Each rule returns None or a well-formed
finding for each record, never raises; and each record gets the findings its figures call for, and no other. The
records are built as MLflow holds a run: params from the resolved config (tracking.context.config_params, as
strings), metrics under their MLflow keys, the tags the driver sets."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from orchestrator.config import load_config
from orchestrator.doctor.engine import RULES, diagnose
from orchestrator.doctor.record import HIGH, LOW, MEDIUM, Finding, RunRecord
from orchestrator.doctor.report import format_findings
from orchestrator.tracking.context import config_params
from orchestrator.tracking.view import mlflow_key


def _params(*sets: str, study: bool = False) -> dict[str, str]:
    """A run's params as MLflow keeps them: the flattened resolved config, each value a string."""
    config = load_config(None, ["scaling.num_workers=2", "train.global_batch_size=128", "train.max_steps=100",
                                "train.log_every=25", "train.eval_every=100", *sets])
    return {key: str(value) for key, value in config_params(config, study=study).items()}


def _metrics(**histories: list[float]) -> dict[str, list[float]]:
    return {mlflow_key(name.replace("__", "/")): values for name, values in histories.items()}


# A 2-worker CPU run's reports (most of each interval in compute, both workers at one pace) and its ledger.
REPORTS = _metrics(step=[25.0, 50.0, 75.0, 100.0], time__data_wait_frac=[0.02, 0.01, 0.02, 0.01],
                   time__compute_frac=[0.8] * 4, time__sync_frac=[0.05] * 4, time__eval_frac=[0.0, 0.0, 0.0, 0.12],
                   time__checkpoint_frac=[0.0, 0.0, 0.0, 0.01], time__report_frac=[0.01] * 4,
                   time__other_frac=[0.06] * 4, interval_s=[2.0] * 4, world_size=[2.0] * 4,
                   comm_bytes_per_sample=[2700.0] * 4, micro_batch_size=[64.0] * 4, skipped_steps=[0.0] * 4,
                   nonfinite_skipped=[0.0] * 4, train_loss=[1.2, 0.6, 0.4, 0.3], samples_per_s=[9000.0] * 4,
                   **{"worker/0/samples_per_s": [10_000.0] * 2, "worker/1/samples_per_s": [9_800.0] * 2})
LEDGER = _metrics(cost__wall_s=[30.0], cost__startup_frac=[0.2], cost__compute_frac=[0.6], cost__sync_frac=[0.04],
                  cost__eval_frac=[0.03], cost__checkpoint_frac=[0.01], cost__report_frac=[0.01],
                  cost__other_frac=[0.05], cost__shutdown_frac=[0.06])
# A failed run's ledger: 4 failures in 1000 s, checkpoints costing 25 s each, far from checkpoint.every=20.
FAILED_LEDGER = _metrics(cost__wall_s=[1000.0], cost__compute_frac=[0.70], cost__checkpoint_frac=[0.04],
                         cost__report_frac=[0.01], cost__startup_frac=[0.05], cost__recovery_frac=[0.2])
FAILURES = {f"orchestrator.failure.{i}": f"after step {20 * i}: RuntimeError: a worker died" for i in (1, 2, 3, 4)}
AUTO_FIGURES = _metrics(checkpoint__interval_s=[8.5, 60.0, 60.0, 60.0], checkpoint__cost_s=[0.5] * 4,
                        checkpoint__mtbf_s=[3600.0] * 4, checkpoint__interruptions=[0.0, 0.0, 1.0, 1.0])
STUDY_SPACE = {"optim.lr": {"loguniform": [1e-4, 1e-1]}, "optim.warmup_steps": {"choice": [0, 50, 200]}}
STUDY_TAGS = {"orchestrator.role": "study", "orchestrator.scheduler": "asha", "orchestrator.searcher": "random",
              "orchestrator.search_space": json.dumps(STUDY_SPACE)}
AUTOPILOT = _metrics(autopilot__predicted_speedup=[1.6], autopilot__achieved_speedup=[1.1],
                     autopilot__search_s=[4.5], autopilot__search_steps=[17.0])
CHOSEN = {"autopilot.micro_batch_size": "64", "autopilot.grad_accum_steps": "1", "autopilot.compile": "False",
          "autopilot.torch_threads": "2", "autopilot.flush_denormal": "True", "autopilot.precision": "fp32",
          "autopilot.sync": "ddp"}
GPU = _metrics(device__cuda=[1.0], device__bf16_supported=[1.0], device__memory_total_gb=[80.0],
               memory__peak_allocated_gb=[20.0, 22.0], param_bytes_per_rank=[2e9], optimizer_bytes_per_rank=[4e9],
               mfu=[0.35, 0.36], flops_per_sample=[6e9])

RECORDS: dict[str, RunRecord] = {
    "finished": RunRecord(REPORTS | LEDGER, _params(), {}),
    "failed before its first report": RunRecord(
        {}, _params(), {"orchestrator.failure.1": "after step 0: RuntimeError: CUDA error"}),
    "failed mid-run": RunRecord(REPORTS | FAILED_LEDGER, _params("train.max_steps=1000", "checkpoint.every=20"),
                                FAILURES),
    "resumed": RunRecord(
        REPORTS | _metrics(step=[25.0, 50.0, 50.0, 75.0, 100.0], cost__recovery_frac=[0.1]) | LEDGER, _params(),
        {"orchestrator.resume.20250101-120000": "from step 50", "orchestrator.failure.1": "after step 60: killed"}),
    "checkpoint.every auto, failed": RunRecord(
        REPORTS | FAILED_LEDGER | AUTO_FIGURES | _metrics(cost__report_frac=[0.35]),
        _params("train.max_steps=1000", "checkpoint.every=auto", "checkpoint.every_minutes=5"), FAILURES),
    "study parent": RunRecord(
        LEDGER | _metrics(study__trials_completed=[3.0], study__trials_stopped=[1.0], cost__trials=[4.0]),
        _params("tune.space={optim.lr: {loguniform: [1.0e-4, 1.0e-1]}}", study=True),
        STUDY_TAGS | {"orchestrator.best_params": json.dumps({"optim.lr": 0.09, "optim.warmup_steps": 50})}),
    "study parent, no trial yet": RunRecord({}, _params(study=True), STUDY_TAGS),
    "autopilot": RunRecord(REPORTS | LEDGER | AUTOPILOT, _params("autopilot.enabled=true") | CHOSEN, {}),
    "autopilot kept from the checkpoint": RunRecord(
        REPORTS | LEDGER | _metrics(autopilot__achieved_speedup=[1.2]), _params("autopilot.enabled=true") | CHOSEN,
        {"orchestrator.resume.20250101-120000": "from step 50"}),
    "autopilot skipped": RunRecord(REPORTS | LEDGER, _params("autopilot.enabled=true", "train.max_steps=30"), {}),
    # It ran out of memory once: fsdp already, so no advice to shard.
    "fsdp on GPUs": RunRecord(
        REPORTS | LEDGER | GPU, _params("train.parallel=fsdp", "scaling.use_gpu=true", "train.precision=bf16"),
        {"orchestrator.precision": "bf16", "orchestrator.failure.1": "after step 40: CUDA out of memory"}),
    # Small kernels in fp32 with memory to spare: what the autopilot measured (precision, compile, the micro-batch
    # split at this global batch) is settled, not advised.
    "autopilot on GPUs": RunRecord(
        REPORTS | LEDGER | AUTOPILOT | GPU | _metrics(mfu=[0.05], flops_per_sample=[2e6], micro_batch_size=[32.0]),
        _params("autopilot.enabled=true", "scaling.use_gpu=true") | CHOSEN | {"autopilot.micro_batch_size": "32"},
        {"orchestrator.precision": "fp32"}),
    "nothing recorded": RunRecord(),
}

# The findings each record calls for (by rule name), and no other.
EXPECTED: dict[str, set[str]] = {
    "finished": set(),
    "failed before its first report": set(),
    "failed mid-run": {"checkpoint interval"},
    "resumed": set(),
    # auto sets the interval itself: no interval finding; the blocked reports' advice names no fixed interval.
    "checkpoint.every auto, failed": {"checkpoint reports"},
    "study parent": {"study size", "search space"},
    "study parent, no trial yet": set(),
    "autopilot": {"autopilot"},
    "autopilot kept from the checkpoint": {"autopilot"},
    "autopilot skipped": set(),
    "fsdp on GPUs": {"memory headroom"},
    "autopilot on GPUs": {"autopilot"},
    "nothing recorded": set(),
}


def _well_formed(finding: Finding | None, rule: Any) -> None:
    if finding is None:
        return
    assert isinstance(finding, Finding), (rule.__name__, finding)
    assert finding.severity in (HIGH, MEDIUM, LOW) and math.isfinite(finding.score), finding
    assert finding.title and "None" not in finding.title and "nan" not in finding.title, finding
    assert isinstance(finding.changes, tuple) and all(isinstance(c, str) and c for c in finding.changes), finding


@pytest.mark.parametrize("rule", RULES, ids=[rule.__name__ for rule in RULES])
@pytest.mark.parametrize("kind", list(RECORDS))
def test_every_rule_runs_on_every_kind_of_run_record(kind: str, rule: Any) -> None:
    _well_formed(rule(RECORDS[kind]), rule)


@pytest.mark.parametrize("kind", list(RECORDS))
def test_each_kind_of_run_gets_the_findings_its_figures_call_for(kind: str) -> None:
    found = diagnose(RECORDS[kind])
    assert {f.rule for f in found} == EXPECTED[kind], [(f.rule, f.title) for f in found]
    assert format_findings("r", RECORDS[kind], found)  # and the report prints


def test_the_records_of_these_kinds_read_as_such() -> None:
    """The table's auto run is an auto run to the rules that read checkpoint.every, and its blocked reports are
    advised without a fixed interval; a run kept from the checkpoint says it has no prediction."""
    auto = RECORDS["checkpoint.every auto, failed"]
    assert auto.param("checkpoint.every") == "auto"
    blocked = next(f for f in diagnose(auto) if f.rule == "checkpoint reports")
    assert not any(c.startswith("checkpoint.every=") for c in blocked.changes), blocked.changes
    kept = next(f for f in diagnose(RECORDS["autopilot kept from the checkpoint"]) if f.rule == "autopilot")
    assert kept.title.startswith("no prediction (kept from the checkpoint) over the configuration as written, "
                                 "achieved 1.20x"), kept.title
    assert set(RECORDS) == set(EXPECTED)
