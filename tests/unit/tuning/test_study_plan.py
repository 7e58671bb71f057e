"""The study's plan (tuning/plan.py): made once, with one data inspection; each trial planned from it and its sampled
values through the function that plans `train`'s config. No Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config import Config, load_config
from orchestrator.errors import ConfigError
from orchestrator.report.cost import resolve_pricing
from orchestrator.run.checks import resolve_for_data
from orchestrator.tuning.plan import TrialPlanner, plan_study, plan_trial
from orchestrator.tuning.search import trial_config, user_tree


def _study(tmp_path: Path, digits_dir: str, *sets: str) -> Config:
    return load_config(None, [f"data.train={digits_dir}/train", f"data.val={digits_dir}/val",
                              f"storage.path={tmp_path}/runs", "experiment=digits", "train.epochs=1",
                              "train.global_batch_size=64", "tune.scheduler=fifo", "cost.node_type=gpu_spot",
                              "scaling.use_gpu=true", "tune.space.optim.lr.loguniform=[1e-4, 1e-1]",
                              "tune.space.scaling.num_workers.choice=[1, 4]", *sets])


def test_the_study_is_planned_once_and_each_trial_as_the_config_is_resolved_for_the_data(
        tmp_path: Path, digits_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import pipelines.datasets

    inspections = []
    inspect = pipelines.datasets.inspect_datasets
    monkeypatch.setattr(pipelines.datasets, "inspect_datasets",
                        lambda *a, **k: inspections.append(a) or inspect(*a, **k))
    config = _study(tmp_path, digits_dir)
    plan = plan_study(config)
    assert len(inspections) == 1  # the data read once, for the study and every trial it plans
    assert plan.place.name == "digits-tune" and plan.place.uri.endswith("runs/digits-tune")
    assert plan.base.config == resolve_for_data(config, plan.trials.datasets or {})
    assert plan.max_steps == plan.base.config.train.max_steps and plan.max_steps > 0  # epochs made steps
    assert plan.widest.scaling.num_workers == 4 and plan.mode == "max"  # val_accuracy
    assert plan.trials.tree == user_tree(config)
    for workers in (1, 4):
        params = {"optim.lr": 0.01, "scaling.num_workers": workers}
        trial = plan_trial(plan.trials.sizes(), params)
        resolved = resolve_for_data(trial_config(user_tree(config), params), plan.trials.datasets or {})
        assert trial.config == resolved
        assert trial.pricing == resolve_pricing(resolved) and trial.pricing.nodes == workers


def test_a_trial_that_would_not_price_fails_the_study_before_any_starts(tmp_path: Path, digits_dir: str) -> None:
    config = _study(tmp_path, digits_dir, "tune.space.cost.node_type.choice=[gpu_spot, gpu_b300]")
    with pytest.raises(ConfigError, match="tune.space.cost.node_type: a trial with cost.node_type='gpu_b300'"):
        plan_study(config)


def test_a_planner_without_the_data_plans_no_trial() -> None:
    with pytest.raises(ValueError, match="study's data"):
        plan_trial(TrialPlanner({}), {"optim.lr": 0.1})


def test_the_planner_pickled_with_the_study_keeps_the_sizes_and_no_password(tmp_path: Path, digits_dir: str) -> None:
    config = _study(tmp_path, digits_dir, "tracking.uri=postgresql://db/mlflow?user=u&password=SECRET")
    plan = plan_study(config)
    sizes = plan.trials.sizes()
    assert all(info.files == [] and info.storage is None for info in (sizes.datasets or {}).values())
    assert {s: i.num_rows for s, i in (sizes.datasets or {}).items()} == {
        s: i.num_rows for s, i in (plan.trials.datasets or {}).items()}
    assert "SECRET" not in repr(sizes.masked().tree) and "SECRET" in repr(sizes.tree)
