"""MLflow's two promises (README, MLflow section), against real `mlflow server` processes and real local Ray:
a tracking store unreachable at start stops `orchestrator train` before it takes any cluster resource; a server
that dies mid-run costs one warning, not the run (and not minutes of the client's retries)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cluster_jobs import BIN, free_port, http_json, wait_for

from orchestrator import load_config, train

pytestmark = pytest.mark.slow


def test_unreachable_tracking_at_start_stops_before_ray_starts(tmp_path: Path, digits_dir: str) -> None:
    uri = f"http://127.0.0.1:{free_port()}"  # bound, then closed: nothing listens there
    # Ray puts its session directories under $TMPDIR/ray (a generic variable, not a Ray one): a private, short one
    # shows whether this command started Ray at all.
    ray_tmp = Path(tempfile.mkdtemp(prefix="orch-trk-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"TMPDIR": str(ray_tmp)}
    command = [str(BIN / "orchestrator"), "train", "--set", f"data.train={digits_dir}/train",
               "--set", f"data.val={digits_dir}/val", "--set", f"storage.path={tmp_path}/runs",
               "--set", f"tracking.uri={uri}", "--set", "scaling.num_workers=1"]
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        elapsed = time.monotonic() - started
        assert not (ray_tmp / "ray").exists(), "Ray was started although tracking was unreachable"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # one clear line, no traceback
    assert lines[0].startswith("error: MLflow tracking at ") and uri in lines[0]
    assert "start the server" in lines[0] and "tracking.enabled=false" in lines[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # no run directory
    assert elapsed < 60, f"{elapsed:.0f} s to give up on a refused connection"  # the client's defaults: minutes


@pytest.fixture()
def mlflow_server(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real `mlflow server` in its own process group (it runs uvicorn as a child), stopped by that group's id."""
    root = tmp_path / "mlflow"
    root.mkdir()
    port = free_port()
    log = open(root / "server.log", "wb")  # noqa: SIM115 - closed at teardown
    process = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
         "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: urllib.request.urlopen(f"{uri}/health", timeout=5).status == 200, "mlflow server")
        yield uri, process
    finally:
        kill_group(process)
        log.close()


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group this test started (the mlflow CLI and its uvicorn), like a crashed server."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def logged_steps(uri: str, experiment: str) -> int:
    """How many train_loss points the server holds for the experiment's run (0 before the run exists)."""
    found = http_json(f"{uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name={experiment}")
    runs = http_json(f"{uri}/api/2.0/mlflow/runs/search", {"experiment_ids": [found["experiment"]["experiment_id"]]})
    run_id = runs["runs"][0]["info"]["run_id"]
    history = http_json(f"{uri}/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key=train_loss")
    return len(history.get("metrics", []))


def test_tracking_server_dying_mid_run_warns_once_and_training_finishes(
        ray_cluster: None, mlflow_server: tuple[str, subprocess.Popen[bytes]], tmp_path: Path,
        digits_dir: str) -> None:
    uri, server = mlflow_server
    killed: dict[str, float] = {}  # how many reports the server held, and when it was killed

    def kill_after_two_reports() -> None:
        killed["logged"] = wait_for(lambda: (n := logged_steps(uri, "tracking")) >= 2 and n, "two logged reports",
                                    timeout=240)
        kill_group(server)
        killed["at"] = time.monotonic()

    config = load_config(None, [
        f"data.train={digits_dir}/train", f"data.val={digits_dir}/val", f"storage.path={tmp_path}/runs",
        f"tracking.uri={uri}", "tracking.experiment=tracking", "scaling.num_workers=1",
        "train.global_batch_size=64", "train.precision=fp32", "train.max_steps=150", "train.log_every=5",
        "checkpoint.every=50", "model.entrypoint=fault_model:build", "model.step_s=0.03"])
    killer = threading.Thread(target=kill_after_two_reports, daemon=True)
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # count every warning, not only the first per code location
        killer.start()
        result = train(config, verbose=False)
    elapsed = time.monotonic() - started
    killer.join(timeout=5)

    assert "at" in killed, "the server was never killed: the run may have ended before two reports were logged"
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{uri}/health", timeout=5)  # really gone
    assert result.metrics["step"] == 150  # training finished
    assert result.checkpoint_path and Path(result.checkpoint_path, "state.pt").is_file()
    assert [r["step"] for r in result.history][-1] == 150  # every report reached the driver
    assert len(result.history) - killed["logged"] >= 10  # most reports met the dead server
    tracking = [str(w.message) for w in caught if "MLflow" in str(w.message)]
    assert len(tracking) == 1, tracking  # one warning for the outage, not one per report or per kind of call
    assert uri in tracking[0] and "training continues" in tracking[0]
    after_kill = time.monotonic() - killed["at"]
    print(f"run {elapsed:.1f} s, of which {after_kill:.1f} s after the server died")
    # ~25 reports and the final artifacts met a dead server: with the client's default retries each call would wait
    # minutes; tracking.py's budget keeps the whole tail near the training time itself.
    assert after_kill < 45, f"{after_kill:.0f} s after the server died: tracking calls stalled the run"
