"""The run planned once (orchestrator/run/plan.py): what the plan decides, checked against the data and the price table
read independently; a resume's saved decisions as fields of the plan; the plan immutable; and the driver's
structure, walked statically (scripts/config_walk.py), staying as flat as this change made it. No Ray."""

from __future__ import annotations

import ast
import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from orchestrator.config import load_config
from orchestrator.report.cost import resolve_pricing
from orchestrator.run.plan import plan_run

ROOT = Path(__file__).resolve().parents[3]


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
    assert plan.pricing_at(None) == plan.pricing_at(2) == plan.pricing and dict(plan.elastic_prices) == {}
    # Decided once: the plan and what it holds cannot be changed by what runs it.
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.advice = "changed"  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.datasets["train"] = plan.datasets["val"]  # type: ignore[index]


def test_one_name_for_the_runs_folder_its_mlflow_run_and_its_summary(tmp_path: Path, digits_dir: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan names the run once: its folder in storage.path, its MLflow run (and `plan.yaml`), the summary's
    `finished` line. The command's --set flags that change what is trained are in the name; the command itself is
    the MLflow run's Source, whole in the runs table (MLflow shows a source's text after its last slash)."""
    from orchestrator.run.result import TrainResult, summary

    argv = ["/venv/bin/orchestrator", "train", "--config", "examples/digits.yaml", "--set", "optim.lr=1e-3",
            "--set", f"storage.path={tmp_path}/runs", "--set", "tracking.uri=http://me:secret@mlflow.internal:5000"]
    monkeypatch.setattr(sys, "argv", argv)
    plan = plan_run(_config(tmp_path, digits_dir, "optim.lr=1e-3"), verbose=False)
    assert plan.run_name == plan.place.name == yaml.safe_load(plan.to_yaml())["run"]["mlflow_run_name"]
    assert re.fullmatch(r"lr1e-3-planned-mlp-\d{8}-\d{6}", plan.run_name), plan.run_name
    plan.place.write_config(plan.config)  # as the run opens
    assert plan_run(_config(tmp_path, digits_dir, "optim.lr=1e-3"), resume=True, verbose=False).run_name == (
        plan.run_name)  # --resume finds it by that name
    command = (f"orchestrator train --config examples/digits.yaml --set optim.lr=1e-3 --set storage.path={tmp_path}"
               "/runs --set tracking.uri=http://me:***@mlflow.internal:5000")
    assert plan.context["orchestrator.command"] == command  # exact, its password masked: what doctor re-runs
    # MLflow's Source, which the UI shows whole for a JOB (a LOCAL source: its text after the last slash only).
    assert plan.context["mlflow.source.name"] == command and plan.context["mlflow.source.type"] == "JOB"
    result = TrainResult(plan.config, {"step": 40, "train_loss": 0.5}, None, plan.place.uri, None, None)
    assert summary(result).splitlines()[0] == f"finished {plan.run_name}: step 40, train loss 0.5000"


def test_a_resume_plans_from_the_runs_record(tmp_path: Path, digits_dir: str) -> None:
    config = _config(tmp_path, digits_dir, "train.max_steps=40")
    first = plan_run(config, verbose=False)
    first.place.write_config(first.config)  # what the run stage writes as it opens the run
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
    # By its directory's path, from a config whose storage.path is elsewhere: that run, its parent as storage.path.
    by_path = plan_run(_config(tmp_path, digits_dir, "train.max_steps=40", f"storage.path={tmp_path}/other"),
                       resume=first.place.path, verbose=False)
    assert by_path.place.uri == first.place.uri and by_path.config.storage.path == f"{tmp_path}/runs"
    assert by_path.reopen_run_id == "abc123" and by_path.resume is not None and by_path.resume.finished is None


def test_the_driver_reads_the_config_in_one_place() -> None:
    """The static walk of `config` from launch.train (`python scripts/config_walk.py`, run as anyone runs it; in a
    process of its own, as CPython 3.11's ast may not parse beside another thread using it): before the plan it
    took 59 climbs back up and 104 returns to a module already left (the data layer entered 12 times, the config
    10); the plan must keep it under half."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "config_walk.py"), "--trace"], capture_output=True,
                         text=True, check=True, timeout=120).stdout.splitlines()
    counts = re.search(r"in (\d+) stays, (\d+) climbs back up, (\d+) returns", out[-2])
    assert counts is not None, out[-2:]
    stays, climbs, returns = map(int, counts.groups())
    assert climbs <= 59 // 2 and returns <= 104 // 2, out[-2]
    # The run stage never takes the config: of launch's functions only train is walked (it hands the config to the
    # plan, in the same package), and the walk starts and ends in the run package.
    trace = [line.split() for line in out if line.startswith(("->", "<-"))]
    assert len(trace) == stays and trace[0] == ["->", "orchestrator.run", "(train)"], trace[:1]
    assert trace[-1][1] == "orchestrator.run", trace[-1]
    launch = ast.parse((ROOT / "orchestrator" / "run" / "launch.py").read_text())
    stage = {f"({node.name})" for node in ast.walk(launch) if isinstance(node, ast.FunctionDef)} - {"(train)"}
    assert not [line for line in trace if line[2] in stage], trace
    entries = dict(re.findall(r"([\w.]+) (\d+)", out[-1].removeprefix("entries per module: ")))
    assert max(map(int, entries.values())) <= 6, out[-1]


def test_an_elastic_plan_prices_every_size_its_group_may_reach(tmp_path: Path, digits_dir: str) -> None:
    """Billed at the largest size the group reached, priced by the plan: gpu_spot nodes hold one GPU each, so a group
    of 4 is 4 nodes (the price table's figure), not the planned minimum's 2."""
    config = _config(tmp_path, digits_dir, "scaling.num_workers=[2, 6]", "train.global_batch_size=120",
                     "scaling.use_gpu=true", "cost.node_type=gpu_spot")
    plan = plan_run(config, verbose=False)
    spot = yaml.safe_load((ROOT / "cluster" / "prices.yaml").read_text())["aws"]["gpu_spot"]["spot"]
    assert sorted(plan.elastic_prices) == [2, 3, 4, 5, 6]
    assert (plan.pricing.nodes, plan.pricing_at(None).nodes, plan.pricing_at(4).nodes) == (2, 2, 4)
    assert plan.pricing_at(4).usd_per_node_hour == spot and plan.pricing_at(4) == resolve_pricing(plan.config, 4)


BUILT_AT: list[float] = []


def timed_mlp(in_features: int, num_classes: int) -> Any:
    """The plan's model check builds this: when it did is recorded."""
    import time

    from torch import nn

    BUILT_AT.append(time.time())
    return nn.Linear(in_features, num_classes)


def test_the_start_up_lines_data_inspection_is_the_data_read_and_the_model_check_a_stage_of_its_own(
        tmp_path: Path, digits_dir: str) -> None:
    """`data inspection` is what its name says (the Parquet footers and sample rows read): the model's build on the
    meta device, torch's import with it, and the plan's other checks are the `checks` stage after it. The order of
    the marks against the build, not a duration: nothing here times the machine."""
    from orchestrator.report.startup import StartupClock

    BUILT_AT.clear()
    clock = StartupClock()
    clock.mark("command")
    plan_run(_config(tmp_path, digits_dir, "model.entrypoint=test_plan:timed_mlp"), verbose=False, clock=clock)
    assert len(BUILT_AT) == 1
    assert clock.marks["command"] <= clock.marks["data inspection"] <= BUILT_AT[0]
    clock.mark("checks")
    assert BUILT_AT[0] <= clock.marks["checks"]
    assert list(clock.seconds()) == ["command", "data inspection", "checks"]


def test_the_data_inspection_of_labelled_columns_imports_no_torch(digits_dir: str) -> None:
    """Reading Parquet footers and sample rows needs Arrow only: torch's import (seconds) belongs to the model's
    check, the `checks` stage, and a fresh process is where the command pays it."""
    code = ("import sys; from pipelines.config import DataConfig; from pipelines.datasets import inspect_run; "
            f"cfg = DataConfig(train='{digits_dir}/train', val='{digits_dir}/val', features=['pixels'], label='label'); "
            "inspection = inspect_run(cfg, False, sys.argv[1]); "
            "print(inspection.datasets['train'].num_rows, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "runs")], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    rows = pq.ParquetDataset(f"{digits_dir}/train").read().num_rows
    assert out.stdout.split() == [str(rows), "False"]
