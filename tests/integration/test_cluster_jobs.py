"""`ray job submit -- orchestrator train` against a real Ray head + worker node (separate `ray start` processes)
with the project's runtime env, tracked by a real `mlflow server` over HTTP and read back through its REST API.
With AWS credentials in the environment and a password in the tracking URI, none of them may appear in MLflow,
the job logs or the run's storage. And the path a new user takes: a SQLite store (no server) with a relative
`--config`."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from services import BIN, free_port, start_mlflow_server, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY-test"
KEY_ID = "AKIAORCHESTRATORTEST1"
CANARY = "Canary-Tracking-Password-7f3a"  # the password in the job's tracking URI (the server ignores basic auth)


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """Stop processes this module started (by PID), all at once (each node takes seconds to stop its own),
    escalating to SIGKILL."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    for process in running:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def http_json(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with start_mlflow_server(tmp_path_factory.mktemp("mlflow")) as (uri, _):
        yield uri


@dataclass(frozen=True)
class Nodes:
    """The cluster: its dashboard (job server, state API), its GCS, the environment its processes run with (the
    clients' too), and its token."""

    dashboard: str
    gcs: str
    env: dict[str, str]
    token: str


@pytest.fixture(scope="module")
def ray_nodes() -> Iterator[Nodes]:
    """A head node (with dashboard + job server) and one worker node, as `ray start --block` processes, with token
    auth set up as cluster/README.md sets it up: `ray get-auth-token --generate` writes the token into
    ~/.ray/auth_token (here a private HOME of this module's, never the user's) and every process, nodes and
    clients, runs with RAY_AUTH_MODE=token."""
    temp_dir = tempfile.mkdtemp(prefix="rayjt", dir="/tmp")  # short: Ray's unix socket paths have a length limit
    home = tempfile.mkdtemp(prefix="rayhome")
    gcs, dashboard = free_port(), free_port()
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",  # the job's driver finds `orchestrator` here
        "HOME": home,
        "RAY_AUTH_MODE": "token",  # this cluster's mode, for every process of it and every client
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        # This cluster's state API, for Train's placement-group cleaner in the job (other Ray instances may run).
        "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dashboard}",
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, check=True, capture_output=True,
                   timeout=120)
    token = Path(home, ".ray", "auth_token").read_text().strip()
    common = ["--block", "--disable-usage-stats", "--min-worker-port", "0", "--max-worker-port", "0"]
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--port", str(gcs), "--dashboard-port", str(dashboard),
         "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--num-cpus", "4",
         "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
         "--metrics-export-port", str(free_port()), "--temp-dir", temp_dir, *common],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    worker = None
    nodes = Nodes(f"http://127.0.0.1:{dashboard}", f"127.0.0.1:{gcs}", env, token)
    try:
        wait_for(lambda: alive_nodes(nodes) == 1, "Ray head")
        worker = subprocess.Popen(
            [str(BIN / "ray"), "start", "--address", nodes.gcs, "--num-cpus", "2",
             "--dashboard-agent-listen-port", str(free_port()), "--metrics-export-port", str(free_port()), *common],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: alive_nodes(nodes) == 2, "worker node")
        yield nodes
    finally:
        stop([p for p in (worker, head) if p is not None])
        shutil.rmtree(temp_dir, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def ray_json(nodes: Nodes, path: str) -> dict[str, Any]:
    """GET from the cluster's dashboard, with its token (without it: 401, "Missing authentication token")."""
    request = urllib.request.Request(f"{nodes.dashboard}{path}", headers={"Authorization": f"Bearer {nodes.token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def alive_nodes(nodes: Nodes) -> int:
    summary = ray_json(nodes, "/nodes?view=summary")["data"]["summary"]
    return sum(1 for n in summary if n["raylet"]["state"] == "ALIVE")


def job_runtime_env(tmp_path: Path, tracking_uri: str) -> Path:
    """The project's runtime env, minus the pip section: these local nodes already run from the project's .venv
    (on a cloud cluster the nodes are set up the same way by cluster/*.yaml)."""
    runtime_env = yaml.safe_load((ROOT / "cluster" / "runtime_env.yaml").read_text())
    runtime_env.pop("pip", None)
    runtime_env["working_dir"] = str(ROOT)
    runtime_env["env_vars"] = {**runtime_env["env_vars"], "MLFLOW_TRACKING_URI": tracking_uri}
    path = tmp_path / "runtime_env.yaml"
    path.write_text(yaml.safe_dump(runtime_env))
    return path


def test_job_submit_trains_on_two_nodes_and_tracks_to_mlflow_server(
    ray_nodes: Nodes, mlflow_server: str, digits_dir: str, tmp_path: Path
) -> None:
    address, env = ray_nodes.dashboard, ray_nodes.env
    submission_id = f"orchestrator-test-{int(time.time())}"
    command = [
        str(BIN / "ray"), "job", "submit", "--address", address, "--submission-id", submission_id,
        "--runtime-env", str(job_runtime_env(tmp_path, mlflow_server)), "--",
        "orchestrator", "train", "--config", "examples/digits.yaml",
        "--set", f"data.train={digits_dir}/train", "--set", f"data.val={digits_dir}/val",
        "--set", "train.max_steps=60", "--set", "train.log_every=20", "--set", "train.eval_every=60",
        "--set", f"storage.path={tmp_path}/runs", "--set", f"tracking.uri={with_password(mlflow_server)}",
        "--set", "tracking.experiment=jobs", "--set", "scaling.num_workers=2",
    ]
    submit = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    logs = subprocess.run([str(BIN / "ray"), "job", "logs", "--address", address, submission_id], env=env,
                          capture_output=True, text=True, timeout=60).stdout
    # Ray's own echo of the submitted command holds what the user typed; everything else is the product's.
    submit.stdout, logs = without_ray_echo(submit.stdout), without_ray_echo(logs)
    status = ray_json(ray_nodes, f"/api/jobs/{submission_id}")["status"]
    assert status == "SUCCEEDED", f"{submit.stdout[-3000:]}\n{submit.stderr[-3000:]}"
    assert "final validation accuracy" in logs and "MLflow run id" in logs
    assert "without token auth" not in logs  # the job's driver joined with the token (no exposure warning)

    # Read the run back through the REST API the MLflow UI uses.
    experiment = http_json(f"{mlflow_server}/api/2.0/mlflow/experiments/get-by-name?experiment_name=jobs")
    runs = http_json(f"{mlflow_server}/api/2.0/mlflow/runs/search",
                     {"experiment_ids": [experiment["experiment"]["experiment_id"]]})["runs"]
    assert len(runs) == 1
    run = runs[0]
    assert run["info"]["status"] == "FINISHED"
    assert run["info"]["run_id"] in logs  # the id the job printed is the run on the server
    metrics = {m["key"]: m["value"] for m in run["data"]["metrics"]}
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert metrics["headline/val_accuracy"] > 0.8 and params["scaling.num_workers"] == "2"  # charted first
    assert params["train.max_steps"] == "60"
    assert {t["key"]: t["value"] for t in run["data"]["tags"]}["mlflow.source.type"] == "JOB"

    # No credential anywhere: params, tags, artifacts, job logs.
    from mlflow.tracking import MlflowClient

    tags = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
    blobs = [json.dumps(params), json.dumps(tags), logs, submit.stdout, submit.stderr]
    artifacts = Path(MlflowClient(mlflow_server).download_artifacts(run["info"]["run_id"], "", str(tmp_path / "a")))
    import mlflow.artifacts

    models = MlflowClient(mlflow_server).search_logged_models([run["info"]["experiment_id"]])
    (logged,) = [m for m in models if m.source_run_id == run["info"]["run_id"] and m.name == "model"] or [None]
    assert logged is not None, (models, [ln for ln in logs.splitlines() if "warning" in ln.lower()])
    model = Path(mlflow.artifacts.download_artifacts(artifact_uri=logged.artifact_location,
                                                     dst_path=str(tmp_path / "m"), tracking_uri=mlflow_server))
    files = [p for p in [*artifacts.rglob("*"), *model.rglob("*")] if p.is_file()]
    assert {"config.yaml", "learning_curves.png", "MLmodel"} <= {p.name for p in files}
    run_log = next(Path(tmp_path, "runs").rglob("orchestrator.log")).read_text()  # the run log: Ray's, MLflow's lines
    # The run's storage (often a shared bucket): config.yaml, its record, attempts, checkpoints.
    files += [p for p in Path(tmp_path, "runs").rglob("*") if p.is_file()]
    assert params["tracking.uri"] == with_password(mlflow_server).replace(CANARY, "***")  # masked, not dropped
    assert "open the MLflow UI: open " + mlflow_server in logs  # the server's address, no credentials in it
    named = dict(zip(["params", "tags", "job logs", "submit stdout", "submit stderr"], blobs, strict=True))
    for secret in (SECRET, KEY_ID, CANARY):
        found = [(name, re.findall(rf".{{0,80}}{re.escape(secret)}", blob)[:3])
                 for name, blob in {**named, "run log": run_log}.items() if secret in blob]
        assert not found, found
        assert not [p for p in files if secret.encode() in p.read_bytes()], secret


def with_password(uri: str) -> str:
    """`uri` (http://host:port) with userinfo holding the canary password."""
    return uri.replace("http://", f"http://jobs:{CANARY}@")


def without_ray_echo(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if "Running entrypoint for job" not in line)


def test_job_submit_tracks_to_a_sqlite_store_with_a_relative_config(
    ray_nodes: Nodes, digits_dir: str, tmp_path: Path
) -> None:
    """What a new user runs: no tracking server, the store a SQLite file (given through the runtime env's
    MLFLOW_TRACKING_URI, as cluster/runtime_env.yaml does for a server), the config named relative to the job's
    working directory. The job's own `ray.init` sets off every node's runtime-env agent installing the job's
    working_dir: an agent sharing this host's session directory (the second node here) deletes and re-extracts it,
    under the driver, which must not need its working directory from then on (MLflow's SQLite store reads it)."""
    address, env = ray_nodes.dashboard, ray_nodes.env
    store = tmp_path / "tracking" / "mlflow.db"
    store.parent.mkdir()
    submission_id = f"orchestrator-sqlite-{int(time.time())}"
    command = [
        str(BIN / "ray"), "job", "submit", "--address", address, "--submission-id", submission_id,
        "--runtime-env", str(job_runtime_env(tmp_path, f"sqlite:///{store}")), "--",
        "orchestrator", "train", "--config", "examples/digits.yaml",
        "--set", f"data.train={digits_dir}/train", "--set", f"data.val={digits_dir}/val",
        "--set", "train.max_steps=30", "--set", "train.log_every=10", "--set", "train.eval_every=30",
        "--set", f"storage.path={tmp_path}/runs", "--set", "scaling.num_workers=2",
    ]
    submit = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    status = ray_json(ray_nodes, f"/api/jobs/{submission_id}")["status"]
    assert status == "SUCCEEDED", f"{submit.stdout[-3000:]}\n{submit.stderr[-3000:]}"
    run_id = re.search(r"MLflow run id: (\w+)", submit.stdout)[1]

    # The printed command opens this store, and the run's artifacts lie beside it (not in the job's working
    # directory, Ray's temporary copy of the package).
    printed = next(ln for ln in submit.stdout.splitlines() if "open the MLflow UI: " in ln)
    argv = shlex.split(printed.split("open the MLflow UI: ", 1)[1])
    assert Path(argv[0]).name == "orchestrator" and argv[1] == "ui", printed
    assert argv[argv.index("--tracking-uri") + 1] == f"sqlite:///{store}", printed
    with sqlite3.connect(store) as db:
        ((status_in_store, artifact_uri),) = db.execute(
            "select status, artifact_uri from runs where run_uuid = ?", (run_id,)).fetchall()
    assert status_in_store == "FINISHED"
    artifacts = Path(artifact_uri.removeprefix("file://"))
    assert artifacts.is_relative_to(store.parent / "mlruns"), artifact_uri
    assert {"config.yaml", "learning_curves.png", "summary.json"} <= {p.name for p in artifacts.iterdir()}


def test_a_driver_on_the_host_joins_with_the_token_and_is_refused_without_it_in_one_line(
    ray_nodes: Nodes, digits_dir: str, tmp_path: Path
) -> None:
    """`orchestrator train --address <gcs>` from a shell on this machine. Without the token (the same command from a
    HOME that has none, RAY_AUTH_MODE=token exported as cluster/README.md says): refused at once, one line naming the
    fix. With it: the driver joins and trains on the cluster, and no exposure warning (the cluster asked for a token
    and got it)."""
    command = [
        str(BIN / "orchestrator"), "train", "--address", ray_nodes.gcs, "--config", "examples/digits.yaml",
        "--set", f"data.train={digits_dir}/train", "--set", f"data.val={digits_dir}/val",
        "--set", "train.max_steps=30", "--set", "train.log_every=10", "--set", "train.eval_every=30",
        "--set", f"storage.path={tmp_path}/runs", "--set", "tracking.enabled=false", "--set", "scaling.num_workers=2",
    ]
    elsewhere = tmp_path / "home"
    elsewhere.mkdir()
    refused = subprocess.run(command, env={**ray_nodes.env, "HOME": str(elsewhere)}, cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: could not join the Ray cluster at {ray_nodes.gcs}: it runs with token auth and refused this "
        "command's token"), refused.stderr[-3000:]
    assert "set RAY_AUTH_TOKEN" in lines[0] and "~/.ray/auth_token" in lines[0] and ray_nodes.token not in lines[0]
    assert not list(tmp_path.rglob("checkpoint_*"))  # refused before anything trained

    joined = subprocess.run(command, env=ray_nodes.env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert joined.returncode == 0, joined.stdout[-3000:] + joined.stderr[-3000:]
    assert "final validation accuracy" in joined.stdout and re.search(r"^step 30/30", joined.stdout, re.MULTILINE)
    assert "without token auth" not in joined.stderr
