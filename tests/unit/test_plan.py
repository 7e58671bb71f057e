"""The run planned once (orchestrator/plan.py): what the plan decides, checked against the data and the price table
read independently; a resume's saved decisions as fields of the plan; the plan immutable; and the driver's
structure, walked statically (scripts/config_walk.py), staying as flat as this change made it. No Ray."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from orchestrator.config import load_config, to_yaml
from orchestrator.plan import plan_run

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, digits_dir: str, *sets: str):  # noqa: ANN202 - a Config
    return load_config(None, [f"data.train={digits_dir}/train", f"data.val={digits_dir}/val",
                              f"storage.path={tmp_path}/runs", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                              "experiment=planned", *sets])


def test_the_plan_holds_what_the_data_and_the_price_table_decide(tmp_path: Path, digits_dir: str) -> None:
    config = _config(tmp_path, digits_dir, "train.epochs=3", "train.global_batch_size=96", "scaling.num_workers=2",
                     "cost.node_type=head", "train.max_steps=null")
    plan = plan_run(config, verbose=False)
    rows = pq.ParquetDataset(f"{digits_dir}/train").read()
    labels = set(pq.ParquetDataset(f"{digits_dir}/train").read(columns=["label"]).column("label").to_pylist())
    # The step count for 3 epochs, computed here as the loop counts them: each worker's rows over its share.
    steps = math.ceil(3 * (rows.num_rows // 2) / (96 // 2))
    assert plan.config.train.max_steps == steps and plan.config.train.epochs is None
    assert plan.config.model.num_classes == len(labels) == 10
    assert plan.datasets["train"].num_rows == rows.num_rows
    assert plan.in_features == 64  # 8x8 pixels
    head = yaml.safe_load((ROOT / "cluster" / "prices.yaml").read_text())["aws"]["head"]  # an on-demand node
    assert plan.pricing.usd_per_node_hour == head["on_demand"]
    assert plan.pricing.nodes == math.ceil(2 * config.scaling.cpus_per_worker / head["cpus"])
    assert plan.resume is None and plan.place.uri.startswith(f"{tmp_path}/runs/planned-")
    assert plan.tracking_uri == f"sqlite:///{tmp_path}/mlflow.db" and plan.reopen_run_id is None
    # What show-config --plan prints and MLflow keeps: the same facts, as plain YAML.
    described = yaml.safe_load(plan.to_yaml())
    assert described["training"]["steps"] == steps and described["data"]["train"]["rows"] == rows.num_rows
    assert described["cost"]["usd_per_node_hour"] == plan.pricing.usd_per_node_hour
    assert described["run"]["resume"] is None
    # Decided once: the plan and what it holds cannot be changed by what runs it.
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.advice = "changed"  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.datasets["train"] = plan.datasets["val"]  # type: ignore[index]


def test_a_resume_plans_from_the_runs_record(tmp_path: Path, digits_dir: str) -> None:
    config = _config(tmp_path, digits_dir, "train.max_steps=40")
    first = plan_run(config, verbose=False)
    first.place.write_text("config.yaml", to_yaml(first.config))  # what the run stage writes as it opens the run
    first.place.write_record({"run_name": first.run_name, "mlflow_run_id": "abc123",
                              "tracking_uri": first.tracking_uri})
    resumed = plan_run(config, resume=True, verbose=False)
    assert resumed.place.uri == first.place.uri and resumed.resume is not None
    assert resumed.resume.step is None and resumed.resume.cache_decision is None  # no checkpoint yet
    assert resumed.reopen_run_id == "abc123"  # the same MLflow run continues
    assert yaml.safe_load(resumed.to_yaml())["run"]["resume"]["mlflow_run_id"] == "abc123"
    # Tracked elsewhere now: a new MLflow run, the same Train run.
    elsewhere = plan_run(_config(tmp_path, digits_dir, "train.max_steps=40",
                                 f"tracking.uri=sqlite:///{tmp_path}/other.db"), resume=True, verbose=False)
    assert elsewhere.place.uri == first.place.uri and elsewhere.reopen_run_id is None


def _walk_module():  # noqa: ANN202 - the script as a module
    spec = importlib.util.spec_from_file_location("config_walk", ROOT / "scripts" / "config_walk.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_driver_reads_the_config_in_one_place() -> None:
    """The static walk of `config` from launch.train: before the plan it took 59 climbs back up and 104 returns to
    a module already left (launch 27 stays, the data layer entered 12 times); the plan must keep it under half."""
    walk = _walk_module()
    w = walk.walk("orchestrator.launch.train", "config")
    counts = walk.counts(w)
    assert counts["climbs"] <= 59 // 2 and counts["returns"] <= 104 // 2, counts
    # The run stage never takes the config: launch is left once, for the plan, and the walk ends on coming back.
    stays = [module for module, _, _ in w.stays]
    assert stays[:2] == ["orchestrator.launch", "orchestrator.plan"] and stays.count("orchestrator.launch") == 2
    assert stays[-2:] == ["orchestrator.plan", "orchestrator.launch"]
    assert max(walk.entries(w).values()) <= 6, walk.entries(w)
