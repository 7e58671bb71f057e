"""The run's description (`mlflow.note.content`, the Overview tab) leads with the task's metric, as docs/metrics.md's
example shows (`val_accuracy 0.986, val_loss 0.0757 at step 300; ...`): for every built-in task, and through the
tracker the run writes it with (a real MLflow store)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config import load_config
from orchestrator.config.task import TASK_KINDS
from orchestrator.tracking.client import MlflowTracker
from orchestrator.tracking.view import headline_note


def task_config(kind: str) -> list[str]:
    return [f"task={kind}", *(["data.label=null"] if kind == "causal_lm" else [])]


def final_figures(kind: str) -> dict[str, float]:
    """Every validation figure the task reports, as the summary table holds them, in a made-up order."""
    names = sorted(TASK_KINDS[kind].metrics, reverse=True)
    return {f"final/val/{name.removeprefix('val_')}": 0.5 + i / 10 for i, name in enumerate(names)}


@pytest.mark.parametrize("kind", sorted(TASK_KINDS))
def test_the_description_leads_with_the_tasks_metric(kind: str) -> None:
    metric = load_config(None, task_config(kind)).tune.metric
    assert metric == TASK_KINDS[kind].metric
    figures = {**final_figures(kind), "train/step": 300, "startup/total_s": 18.7}
    note = headline_note(figures, metric)
    value = figures[f"final/val/{metric.removeprefix('val_')}"]
    assert note.startswith(f"{metric} {value:.4g}"), note
    # The loss comes next when it is not the headline itself; then the step.
    second = "val_loss" if metric != "val_loss" else sorted(m for m in TASK_KINDS[kind].metrics if m != metric)[0]
    assert note.split(", ")[1].startswith(f"{second} "), note
    assert " at step 300; " in note


def test_the_tracker_writes_a_regression_runs_description_led_by_val_rmse(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlruns.db"
    config = load_config(None, [*task_config("regression"), f"tracking.uri={uri}", "tracking.experiment=notes"])
    tracker = MlflowTracker(config.tracking, "r", headline=config.tune.metric)  # as launch opens a run
    figures = final_figures("regression")
    tracker.log_metrics({**figures, "step": 50}, step=50)
    tracker.log_metrics({**figures, "step": 100}, step=100)  # unchanged: rows of the summary table
    tracker.finish("FINISHED")
    note = MlflowClient(uri).get_run(str(tracker.run_id)).data.tags["mlflow.note.content"]
    assert note.startswith(f"val_rmse {figures['final/val/rmse']:.4g}, val_loss "), note
