"""`orchestrator doctor` and the cost ledger on a real run: prefetch disabled and a slowed reader (a user transform
that sleeps on every block, re-read every epoch with the cache off, the validation split too, evaluated every 10
steps), so the loop mostly waits for data or validation; doctor must name the data pipeline, the evaluation and,
this run being 40 steps, its start-up. The same run's MLflow record carries the cost metrics and the start-up
breakdown, and the summary prints the ledger. A study's parent run, recorded in MLflow as `orchestrator tune`
records it, gets the study rules and a header that counts trials."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator import load_config, train
from orchestrator.cli import main
from orchestrator.run.result import summary

pytestmark = pytest.mark.slow

PHASES = ("compute", "sync", "data_wait", "eval", "checkpoint", "report", "other")


def printed_findings(out: str) -> list[str]:
    # Ray forwards raylet warnings to the driver's stdout at any moment, so find the report by its header.
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("doctor: run "))
    return [lines[header], *(line for line in lines[header + 1:] if line[:1].isdigit())]


def test_doctor_names_the_data_pipeline_evaluation_and_start_up_and_the_run_has_a_cost(
        ray_cluster: None, tmp_path: Path, digits_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrator.doctor.load import load_run
    from orchestrator.doctor.record import training_share
    from orchestrator.doctor.rules.run_health import bookkeeping, evaluation
    from orchestrator.doctor.rules.speed import gradient_sync, uneven_workers
    from orchestrator.report.startup import STAGES

    uri = f"sqlite:///{tmp_path}/mlruns.db"
    result = train(load_config(None, [
        f"data.train={digits_dir}/train", f"data.val={digits_dir}/val", f"storage.path={tmp_path}/runs",
        f"tracking.uri={uri}", "tracking.experiment=tests", "scaling.num_workers=2", "train.max_steps=40",
        "train.log_every=10", "train.eval_every=10", "checkpoint.every=40", "data.prefetch_batches=0",
        "data.cache=none", "data.transforms=[{call: {fn: 'slow_reader:slow', kwargs: {seconds: 0.1}}}]",
        "cost.price_per_hour=3.6",
    ]), verbose=False)
    assert result.run_id is not None

    # Read back as doctor reads it: metric histories and the summary table, by the names the product reports.
    run = load_run(result.run_id, uri)
    cost = {part: run.last(f"cost/{part}") for part in ("usd", "node_hours", "productive_usd", "overhead_usd",
                                                         "startup_frac", "productive_frac")}
    assert all(value is not None for value in cost.values()), cost
    # The summary table rounds to 4 significant digits.
    assert cost["usd"] == pytest.approx(cost["node_hours"] * 3.6, rel=1e-3)  # type: ignore[operator]
    assert cost["productive_usd"] + cost["overhead_usd"] == pytest.approx(cost["usd"], rel=1e-3)  # type: ignore[operator]
    assert cost["startup_frac"] > 0 and cost["productive_frac"] < 1  # type: ignore[operator]
    assert "cost: $" in summary(result)

    assert main(["doctor", result.run_id, "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    header, *findings = printed_findings(out)
    assert header.endswith(", 40 steps"), out
    rules = [f.split("] ")[1].split(":")[0] for f in findings]
    assert {"start-up", "data pipeline", "evaluation"} <= set(rules), out
    assert "--set data.prefetch_batches=4" in out and "--set data.cache=memory" in out
    assert "--set train.eval_every=20" in out and "(4 passes over the validation split)" in out
    # The start-up breakdown is in the run: its stages add up to the time before the first step, but for MLflow's
    # opening, which ran beside them (while the worker group started).
    recorded = {stage: run.last(f"startup/{stage.replace(' ', '_').replace('-', '_')}_s") for stage in STAGES}
    stages = {stage: seconds for stage, seconds in recorded.items() if seconds is not None}
    assert set(stages) == set(STAGES) and stages["tracking"] > 0  # every stage, the checks too
    assert sum(stages.values()) - stages["tracking"] == pytest.approx(run.last("startup/total_s"), rel=1e-3)
    start_up = next(f for f in findings if "] start-up:" in f)
    assert f"slowest: {max(stages, key=stages.__getitem__)}" in start_up

    # The training-share rules on this real record: every phase's share is found (under the loop's keys) and the
    # shares tile the training; each rule fires exactly when its share passes its threshold, and quotes it.
    shares = {phase: training_share(run, phase) for phase in PHASES}
    assert all(share is not None for share in shares.values()), shares
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.02), shares  # type: ignore[arg-type]
    for rule, phase, threshold in ((evaluation, "eval", 0.15), (bookkeeping, "other", 0.15),
                                   (gradient_sync, "sync", 0.1)):
        finding = rule(run)
        assert (finding is not None) == (shares[phase] >= threshold), (phase, shares)  # type: ignore[operator]
        if finding is not None:
            assert f"{shares[phase]:.0%} of the training time" in finding.title and finding.rule in rules
    # Nothing per worker is recorded yet: the uneven-workers rule has nothing to compare and stays quiet.
    assert uneven_workers(run) is None


def test_doctor_on_a_study_counts_trials_and_names_the_study_rules(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The parent run as `orchestrator tune` leaves it (study.tune and study._record): role and search-space tags,
    the best trial's params, trial counts and the study's cost shares."""
    from orchestrator.config import TrackingConfig
    from orchestrator.report.cost import Ledger, Pricing, study_metrics
    from orchestrator.tracking.client import MlflowTracker

    uri = f"sqlite:///{tmp_path}/mlruns.db"
    space = {"optim.lr": {"loguniform": [1e-4, 1e-1]}, "optim.warmup_steps": {"choice": [0, 50, 200]}}
    parent = MlflowTracker(TrackingConfig(uri=uri, experiment="tests"), "digits-mlp-study",
                           tags={"orchestrator.study": "digits-mlp-study", "orchestrator.role": "study"})
    parent.log_params({"tune.num_samples": 4, "tune.scheduler": "asha", "tune.searcher": "random",
                       "train.max_steps": 300, "train.eval_every": 100, "train.log_every": 25})
    parent.set_tags({"orchestrator.scheduler": "asha", "orchestrator.searcher": "random",
                     "orchestrator.search_space": json.dumps(space)})
    pricing = Pricing(1, None, "1 node")
    ledgers = [Ledger(30.0, pricing, {"startup": 13.0, "compute": 1.0, "sync": 0.5, "eval": 4.0, "other": 8.0,
                                      "shutdown": 3.5}) for _ in range(4)]
    parent.log_metrics({"study/best_val_accuracy": 0.97, "study/trials_completed": 3, "study/trials_stopped": 1,
                        "study/trials_error": 0, **study_metrics(ledgers)}, step=300)
    parent.set_tags({"orchestrator.best_params": json.dumps({"optim.lr": 0.0031, "optim.warmup_steps": 200})})
    parent.finish("FINISHED")
    assert parent.run_id is not None

    assert main(["doctor", parent.run_id, "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    header, *findings = printed_findings(out)
    assert header.endswith("study of 4 trials (3 completed, 1 stopped early)") and "0 steps" not in out, out
    rules = [f.split("] ")[1].split(":")[0] for f in findings]
    # Per trial: start-up 43% of the wall clock; of the training, eval 30% and other 59% (from the ledger).
    assert {"start-up", "search space", "study size", "evaluation", "other overhead"} <= set(rules), out
    assert "     # tune.space.optim.warmup_steps: {choice: [0, 50, 200, 800]}" in out
    assert "     --set tune.num_samples=8\n       # ASHA" in out  # the command's line, then why
    # ASHA compares trials at every report: each report validates, so the two cadences move together.
    assert "--set train.log_every=200 --set train.eval_every=200" in out
    assert not [line for line in out.splitlines() if line.strip().startswith("--set train.eval_every=")], out
