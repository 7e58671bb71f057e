"""Two guarantees the slow Ray tests also cover, checked here in about a second each with no Ray runtime, S3 server
or MLflow store: nothing shipped to workers carries an S3 credential, and Ctrl+C ends `orchestrator train` with
exit status 130 and the line that says how to continue."""

from __future__ import annotations

import pickle
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from orchestrator import cli
from orchestrator.config import load_config
from orchestrator.run import launch
from orchestrator.run.place import RAY_CHECKPOINTS, RunPlace, open_run_storage
from orchestrator.run.plan import RunPlan
from orchestrator.run.trainer import storage_args
from pipelines.config import S3Config
from pipelines.reader import ShardDatasource
from pipelines.storage import ObjectInfo, open_storage

CANARY = {"AWS_ACCESS_KEY_ID": "AKIAFASTGUARDCANARY1", "AWS_SECRET_ACCESS_KEY": "SECRET-fast-guard-canary-161803",
          "AWS_SESSION_TOKEN": "TOKEN-fast-guard-canary-141421"}
NOWHERE = "http://127.0.0.1:9"  # nothing listens: building and pickling the objects must not need a server


def test_nothing_shipped_to_workers_carries_a_credential(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import boto3

    for name, value in CANARY.items():
        monkeypatch.setenv(name, value)  # distinctive values: finding them in a pickle means they were shipped
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):  # the environment is the only source
        monkeypatch.setenv(name, str(tmp_path / "none"))
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    assert boto3.Session().get_credentials().secret_key == CANARY["AWS_SECRET_ACCESS_KEY"]  # the chain has them

    s3 = S3Config(endpoint=NOWHERE)
    data = open_storage("s3://bucket/data", s3)
    data.filesystem()  # built (with this process's credentials at hand) before it is pickled
    config = load_config(None, ["storage.path=s3://bucket/runs", f"data.s3.endpoint={NOWHERE}"])
    runs = RunPlace(open_run_storage(config), "exp-20250101-000000").storage
    runs.filesystem()
    source = ShardDatasource(data, [ObjectInfo("bucket/data/part-0.parquet", 1000, "etag")], [10], ["x", "label"])
    shipped = {
        "data storage": pickle.dumps(data),
        "run storage": pickle.dumps(runs),
        "a storage below": pickle.dumps(runs.below("exp")),
        "filesystem": pickle.dumps(data.filesystem()),
        "RunConfig storage (Train, Tune, tuner.pkl)": cloudpickle.dumps(storage_args(runs)),
        "datasource": cloudpickle.dumps(source),
        "read tasks": cloudpickle.dumps(source.get_read_tasks(1)),
    }
    assert "storage_filesystem" in storage_args(runs)  # the S3 filesystem itself travels in the RunConfig
    for what, blob in shipped.items():
        for name, value in CANARY.items():
            assert value.encode() not in blob, f"{what} carries {name}"
    # What arrives is still usable: the copy builds its own filesystem from its own process's chain.
    arrived = pickle.loads(shipped["data storage"])
    assert arrived.filesystem().type_name == "s3" and arrived.root == "bucket/data"


# (the last report the driver received, the checkpoint Ray Train registered, the step the line names). Second: step
# 20's checkpoint registered while its report was still on the way to the driver: the run reached step 20.
@pytest.mark.parametrize(("reported", "registered", "stopped"), [(12, 10, 12), (15, 20, 20)])
def test_ctrl_c_during_training_exits_130_and_says_how_to_continue(
        tmp_path: Path, digits_dir: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        reported: int, registered: int, stopped: int) -> None:
    argv = ["train", "--set", f"data.train={digits_dir}/train", "--set", f"data.val={digits_dir}/val",
            "--set", f"storage.path={tmp_path}/runs", "--set", "tracking.enabled=false",
            "--set", "scaling.num_workers=1"]
    monkeypatch.setattr(sys, "argv", [str(tmp_path / ".venv/bin/orchestrator"), *argv])  # as the console script
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "connect_cluster", lambda cluster: False)  # no cluster: a joined one, say
    monkeypatch.setattr(launch, "_build_inputs", lambda plan, started_ray, log: None)  # no datasets without it

    def fit_until_ctrl_c(plan: RunPlan, inputs: Any, handle: Any, *args: Any) -> Any:
        # Steps reported, a checkpoint registered by Ray Train, then Ctrl+C.
        handle.history.append({"step": reported})  # the reports so far
        plan.place.write_text(RAY_CHECKPOINTS, f'{{"checkpoints": ["checkpoint_{registered:08d}_d41d8cd9"]}}')
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "_fit", fit_until_ctrl_c)
    assert cli.main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    again = shlex.join(["orchestrator", *argv, "--resume"])
    assert err[-1] == f"interrupted at step {stopped}; last checkpoint step {registered}; continue with: {again}", err


def _tracked_cli(tmp_path: Path, digits_dir: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    argv = ["train", "--set", f"data.train={digits_dir}/train", "--set", f"data.val={digits_dir}/val",
            "--set", f"storage.path={tmp_path}/runs", "--set", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            "--set", "scaling.num_workers=1"]
    monkeypatch.setattr(sys, "argv", [str(tmp_path / ".venv/bin/orchestrator"), *argv])
    monkeypatch.chdir(tmp_path)
    return argv


def _statuses(tmp_path: Path) -> list[str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    return [r.info.status for r in client.search_runs([client.get_experiment_by_name("default").experiment_id])]


def test_the_mlflow_run_is_opened_while_the_worker_group_starts_and_ctrl_c_then_ends_it_killed(
        tmp_path: Path, digits_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = _tracked_cli(tmp_path, digits_dir, monkeypatch)
    times: dict[str, float] = {}

    def ray_start(cluster: Any) -> bool:
        time.sleep(1.0)  # Ray's own start (seconds): on 2 cores MLflow's set-up beside it slowed it by as much
        return False

    def build_inputs(plan: RunPlan, started_ray: bool, log: Any) -> None:
        time.sleep(0.3)
        times["datasets"] = time.time()

    clocks: list[Any] = []

    def fit(plan: RunPlan, inputs: Any, handle: Any, opening: Any, *args: Any) -> Any:
        times["fit"] = time.time()  # Ray Train starts the worker group: the driver only waits meanwhile
        clocks.append(handle.clock)
        opening.result()
        times["opened"] = opening.ended
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "connect_cluster", ray_start)
    monkeypatch.setattr(launch, "_build_inputs", build_inputs)
    monkeypatch.setattr(launch, "_fit", fit)
    assert cli.main(argv) == 130
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("default").experiment_id])
    assert run.info.status == "KILLED"  # opened beside the fit, ended by its Ctrl+C
    assert times["datasets"] <= run.info.start_time / 1000 and times["fit"] < times["opened"]  # neither waited
    (clock,) = clocks
    assert list(clock.marks)[-2:] == ["ray start", "datasets"] and clock.seconds()["ray start"] >= 1.0 - 0.01


def test_ctrl_c_while_ray_starts_opens_no_mlflow_run_and_says_how_to_continue(
        tmp_path: Path, digits_dir: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    argv = _tracked_cli(tmp_path, digits_dir, monkeypatch)

    def ray_start_interrupted(cluster: Any) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "connect_cluster", ray_start_interrupted)
    assert cli.main(argv) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "interrupted at step 0; no checkpoint yet: a new run starts from step 0")
    from mlflow.tracking import MlflowClient

    experiment = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_experiment_by_name("default")
    assert experiment is None or _statuses(tmp_path) == []  # nothing was opened, so nothing is left RUNNING
