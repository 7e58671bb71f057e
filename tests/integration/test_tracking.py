"""MLflow's two promises (docs/metrics.md), against real `mlflow server` processes and real local Ray:
a tracking store unreachable at start stops `orchestrator train` before it takes any cluster resource; a server
that dies mid-run costs one warning, not the run (and not minutes of the client's retries). And the final model
is an MLflow Model in the run: loaded, predicted with and registered through runs:/<run_id>/model."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from services import BIN, free_port, start_mlflow_server, stop_group, wait_for
from test_cluster_jobs import http_json

from orchestrator import load_config, train
from orchestrator.run.result import summary

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
    with start_mlflow_server(tmp_path / "mlflow") as server:
        yield server


def logged_steps(uri: str, experiment: str) -> int:
    """How many training-loss points the server holds for the experiment's run (0 before the run exists)."""
    from orchestrator.tracking.view import chart_key, mlflow_key

    found = http_json(f"{uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name={experiment}")
    runs = http_json(f"{uri}/api/2.0/mlflow/runs/search", {"experiment_ids": [found["experiment"]["experiment_id"]]})
    run_id = runs["runs"][0]["info"]["run_id"]
    key = urllib.parse.quote(chart_key(mlflow_key("train_loss"), None), safe="")  # headline/train_loss
    history = http_json(f"{uri}/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key={key}")
    return len(history.get("metrics", []))


def test_tracking_server_dying_mid_run_warns_once_and_training_finishes(
        ray_cluster: None, mlflow_server: tuple[str, subprocess.Popen[bytes]], tmp_path: Path,
        digits_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    uri, server = mlflow_server
    killed: dict[str, float] = {}  # how many reports the server held, and when it was killed
    hold = tmp_path / "hold"
    hold.mkdir()

    def kill_while_held() -> None:
        # The worker holds in step 51 (held_model): the server has every report up to step 50 and no later one
        # when it dies, however fast or slow the run got there; the last 20 reports can only meet a dead server.
        try:
            wait_for(lambda: list(hold.glob("held-*")), "the worker held at step 51", timeout=240)
            killed["logged"] = wait_for(lambda: (n := logged_steps(uri, "tracking")) >= 10 and n,
                                        "the reports up to step 50 logged", timeout=120)
            stop_group(server)  # SIGKILL: a crashed server
            killed["at"], killed["wall"] = time.monotonic(), time.time()
        finally:
            (hold / "release").touch()  # killed or not: training goes on, and the assertions below say which

    config = load_config(None, [
        f"data.train={digits_dir}/train", f"data.val={digits_dir}/val", f"storage.path={tmp_path}/runs",
        f"tracking.uri={uri}", "tracking.experiment=tracking", "scaling.num_workers=1",
        "train.global_batch_size=64", "train.precision=fp32", "train.max_steps=150", "train.log_every=5",
        "checkpoint.every=50", "model.entrypoint=held_model:build", "model.hold_call=52", f"model.marker={hold}"])
    killer = threading.Thread(target=kill_while_held, daemon=True)
    started = time.monotonic()
    killer.start()
    result = train(config, verbose=False)
    elapsed = time.monotonic() - started
    stderr = capsys.readouterr().err.splitlines()
    killer.join(timeout=5)

    assert "at" in killed, "the server was never killed while the worker held at step 51"
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{uri}/health", timeout=5)  # really gone
    assert result.metrics["step"] == 150  # training finished
    assert result.checkpoint_path and Path(result.checkpoint_path, "state.pt").is_file()
    # Every report reached the driver: the 10 the server logged before it died and the 20 (steps 55..150) after.
    assert [r["step"] for r in result.history] == list(range(5, 151, 5))
    assert killed["logged"] == 10, killed
    tracking = [line for line in stderr if "MLflow" in line]
    # One line for the outage, not one per report or per kind of call; and one at the end for the points the writer
    # kept for it that it never took (tracking/writer.py: nothing is dropped silently).
    assert len(tracking) == 2, tracking
    assert tracking[0].startswith("warning: ") and uri in tracking[0] and "training continues" in tracking[0]
    assert tracking[1].startswith("warning: ") and "were not written to MLflow" in tracking[1] and uri in tracking[1]
    # The client's own retries and warnings went to the run's log, not to the terminal.
    assert not [line for line in stderr if "urllib3" in line or "Retrying" in line or "Warning:" in line], stderr
    after_kill = time.monotonic() - killed["at"]
    print(f"run {elapsed:.1f} s, of which {after_kill:.1f} s after the server died")
    # The summary names the run's page on the server, without asking the dead server for it.
    assert f"this run in the MLflow UI: {uri}/#/experiments/" in summary(result)
    last = summary(result).splitlines()[-1]
    assert last.endswith(f"/runs/{result.run_id}/model-metrics?workflowType=machine_learning")
    # ~25 reports and the final artifacts met a dead server: with the client's default retries each call would wait
    # minutes; tracking/client.py's budget keeps the whole tail near the training time itself. The training part of the
    # tail (to the final checkpoint, written by the worker whatever the driver's tracking does) is what a loaded
    # machine stretches, so only the rest is charged to tracking.
    training = max(0.0, Path(result.checkpoint_path, "state.pt").stat().st_mtime - killed["wall"])
    assert after_kill - training < 45, \
        f"{after_kill:.0f} s after the server died, {training:.0f} s of it training: tracking calls stalled the run"


def test_a_server_that_stops_answering_and_comes_back_gets_every_point_in_order(
        mlflow_server: tuple[str, subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The writer (tracking/writer.py) against a real server paused with SIGSTOP (it takes connections and answers
    none): the reports go on without waiting for it, what it did not take is kept, and once it answers again every
    point lands, in order, before the run's end status."""
    from mlflow.tracking import MlflowClient

    from orchestrator.config import TrackingConfig
    from orchestrator.tracking import client as client_module
    from orchestrator.tracking.client import MlflowTracker
    from orchestrator.tracking.view import chart_key, mlflow_key

    uri, server = mlflow_server
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")  # a paused server is found down after one short wait
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setattr(client_module, "OUTAGE_RETRY_S", 1.0)
    tracker = MlflowTracker(TrackingConfig(uri=uri, experiment="paused"), "paused-run")
    begun = []
    log_batch = tracker._client.log_batch
    tracker._client.log_batch = lambda *a, **k: (begun.append(1), log_batch(*a, **k))[1]

    def reports(steps: range) -> None:
        for step in steps:
            tracker.log_metrics({"step": step, "train_loss": 1.0 / step}, step=step)

    reports(range(1, 11))
    tracker.flush()
    calls = len(begun)
    os.killpg(server.pid, signal.SIGSTOP)
    try:
        reports(range(11, 61))
        wait_for(lambda: tracker._down_until is not None, "the writer finding the server down", timeout=120)
        reports(range(61, 101))  # while it is known to be down
        assert len(begun) - calls <= 2  # the reports made no call of their own: the writer's one try (or two)
        assert tracker.writer.pending() >= 90  # kept for it
    finally:
        os.killpg(server.pid, signal.SIGCONT)
    tracker.finish("FINISHED")
    client = MlflowClient(uri)
    loss = chart_key(mlflow_key("train_loss"), None)
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, loss)] == \
        [(step, 1.0 / step) for step in range(1, 101)]
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    lines = [line for line in capsys.readouterr().err.splitlines() if "MLflow" in line]
    assert len(lines) == 2, lines
    assert "training continues" in lines[0] and "answers again: the points and tags kept meanwhile" in lines[1]


# The final model as an MLflow Model (orchestrator/tracking/flavour.py): loadable and registrable from the run.


def named_mlp(in_features: int, num_classes: int) -> torch.nn.Module:
    """A model taking its input by name (`model.inputs: [pixels]`), for `model.entrypoint=test_tracking:named_mlp`."""
    return NamedMLP(in_features, num_classes)


class NamedMLP(torch.nn.Module):
    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(in_features, 16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, num_classes))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.net(pixels)


@pytest.fixture()
def mlflow_uri(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Points MLflow's process-wide tracking URI (what runs:/ and models:/ URIs resolve against) at a test's store;
    the previous URI and $MLFLOW_TRACKING_URI (set_tracking_uri sets it) come back after the test."""
    import mlflow
    from mlflow.tracking._tracking_service import utils

    monkeypatch.setattr(utils, "_tracking_uri", utils._tracking_uri)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return mlflow.set_tracking_uri


def sample_batch(config: Any) -> dict[str, torch.Tensor]:
    """The training data's sample rows (the logged input example's) as the loop collates them."""
    from pipelines.batches import collate_arrow
    from pipelines.datasets import inspect_datasets

    info = inspect_datasets(config.data, named=config.model.inputs is not None)["train"]
    return collate_arrow(info.sample, config.data.features, config.data.label, config.model.inputs is not None)


def test_final_model_is_an_mlflow_model_that_loads_predicts_and_registers(
        ray_cluster: None, tmp_path: Path, digits_dir: str, mlflow_uri: Callable[[str], None]) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    import orchestrator.run.launch
    from orchestrator.models.zoo import build_model
    from orchestrator.training.checkpoint import load_state

    timings: list[float] = []
    log_final_artifacts = orchestrator.run.launch._log_final_artifacts

    def timed(*args: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        log_final_artifacts(*args, **kwargs)
        timings.append(time.perf_counter() - started)

    config = load_config(None, [
        f"data.train={digits_dir}/train", f"data.val={digits_dir}/val", f"storage.path={tmp_path}/runs",
        f"tracking.uri=sqlite:///{tmp_path}/mlruns.db", "tracking.experiment=models", "scaling.num_workers=1",
        "train.global_batch_size=64", "train.precision=fp32", "train.max_steps=30", "train.log_every=10",
        "train.eval_every=10", "checkpoint.every=10"])  # checkpoints at 10, 20, 30; retention keeps 2
    uri_before, env_before = mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(orchestrator.run.launch, "_log_final_artifacts", timed)
        result = train(config, verbose=False)
    # Logging the model read and changed no process-wide MLflow state.
    assert (mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")) == (uri_before, env_before)
    assert mlflow.active_run() is None
    print(f"final artifacts (config, MLflow Model, learning curves) logged in {timings[0]:.2f} s")
    assert result.run_id and result.tracking_uri and result.checkpoint_path

    # The final checkpoint's weights in the model the config builds: the reference outputs.
    resolved = result.config
    reference = build_model(resolved.model.name, None, 64, resolved.model.num_classes, resolved.model.kwargs)
    reference.load_state_dict(load_state(result.checkpoint_path)["model"])
    reference.eval()
    x = sample_batch(resolved)["x"]
    with torch.no_grad():
        expected = reference(x)

    mlflow_uri(result.tracking_uri)
    uri = f"runs:/{result.run_id}/model"
    loaded = mlflow.pytorch.load_model(uri)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loaded(x[:3]), expected[:3], atol=1e-5, rtol=1e-5)  # any batch size

    # The pyfunc flavour: the `pixels` column by name, the class and its probabilities (classification).
    frame = pd.DataFrame({"pixels": list(x.numpy())})
    pyfunc = mlflow.pyfunc.load_model(uri)
    predicted = pyfunc.predict(frame)
    np.testing.assert_array_equal(predicted["class"].to_numpy(), expected.argmax(-1).numpy())
    np.testing.assert_allclose(np.stack(predicted["probabilities"].to_numpy()), expected.softmax(-1).numpy(),
                               atol=1e-5, rtol=1e-5)
    signature = pyfunc.metadata.signature
    assert signature is not None
    assert [c.name for c in signature.inputs.inputs] == ["pixels"]
    assert [c.name for c in signature.outputs.inputs] == ["class", "probabilities"]
    assert pyfunc.metadata.saved_input_example_info["type"] == "dataframe"  # the sample rows

    version = mlflow.register_model(uri, "digits-mlp")
    assert str(version.version) == "1" and version.run_id == result.run_id
    registered = mlflow.pyfunc.load_model("models:/digits-mlp/1")
    np.testing.assert_array_equal(registered.predict(frame)["class"], predicted["class"])

    # The other final artifacts are still there; the bare state dict is gone (the MLflow Model replaces it).
    client = MlflowClient(tracking_uri=result.tracking_uri)
    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"config.yaml", "learning_curves.png", "summary.json"} <= artifacts and "model" not in artifacts
    mlrun = client.get_run(result.run_id)
    assert mlrun.info.status == "FINISHED"
    assert_checkpoints_are_logged_models(client, mlrun, result.checkpoint_path)
    # The summary's last lines: how to open the UI, then this run's page in it (a SQLite store: the local UI's).
    *_, command, page = summary(result).splitlines()
    assert command.startswith("open the MLflow UI: ") and " ui --tracking-uri " in command
    assert page == (f"this run in the MLflow UI: http://127.0.0.1:5055/#/experiments/{mlrun.info.experiment_id}/runs/"
                    f"{result.run_id}/model-metrics?workflowType=machine_learning")


def assert_checkpoints_are_logged_models(client: Any, mlrun: Any, final_checkpoint: str) -> None:
    """The run committed checkpoints at steps 10, 20 and 30 and Ray's retention (checkpoint.keep=2) deleted the
    first: the run's checkpoint models are the two in storage, each external (its files where Ray wrote them, none
    uploaded), with its step and the run's own validation figures of that step linked; the best is found by
    ordering on a validation metric."""
    run_id, experiment_id = mlrun.info.run_id, mlrun.info.experiment_id
    models = client.search_logged_models([experiment_id],
                                         filter_string=f"source_run_id = '{run_id}' AND model_type = 'checkpoint'")
    by_step = {int(m.params["step"]): m for m in models}
    assert sorted(by_step) == [20, 30]
    checkpoints = sorted(c for c in Path(final_checkpoint).parent.glob("checkpoint_0*") if c.is_dir())
    assert [by_step[step].tags["orchestrator.checkpoint"] for step in (20, 30)] == [str(c) for c in checkpoints]
    assert by_step[30].tags["orchestrator.checkpoint"] == final_checkpoint
    history = {key: {m.step: m.value for m in client.get_metric_history(run_id, key)}
               for key in ("headline/val_accuracy", "val/loss")}
    for step, model in by_step.items():
        assert Path(model.tags["orchestrator.checkpoint"], "state.pt").is_file()
        assert model.tags["mlflow.model.isExternal"] == "true"
        assert client.list_logged_model_artifacts(model.model_id) == []
        linked = {m.key: m.value for m in model.metrics}
        assert {key: linked[key] for key in history} == {key: values[step] for key, values in history.items()}
    (best,) = client.search_logged_models([experiment_id], filter_string=f"source_run_id = '{run_id}'",
                                          order_by=[{"field_name": "metrics.val/loss", "ascending": True}],
                                          max_results=1)
    assert best.model_id == by_step[min(by_step, key=lambda step: history["val/loss"][step])].model_id
    assert {o.step for o in mlrun.outputs.model_outputs} >= {20, 30}


def test_named_inputs_are_logged_with_a_dict_signature(tmp_path: Path, digits_dir: str,
                                                       mlflow_uri: Callable[[str], None],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a training run: the logging itself, for a model called by keyword (`model.inputs`)."""
    import mlflow

    from orchestrator.run.checks import resolve_for_data
    from orchestrator.tracking.client import MlflowTracker
    from orchestrator.tracking.flavour import log_final_model
    from pipelines.datasets import inspect_datasets

    config = load_config(None, [
        f"data.train={digits_dir}/train", f"data.val={digits_dir}/val", f"tracking.uri=sqlite:///{tmp_path}/m.db",
        "tracking.experiment=named", "model.entrypoint=test_tracking:named_mlp", "model.inputs=[pixels]"])
    infos = inspect_datasets(config.data, named=True)
    config = resolve_for_data(config, infos)
    model = named_mlp(64, 10).eval()
    tracker = MlflowTracker(config.tracking, "named")
    log_final_model(tracker, config, infos["train"], model.state_dict)
    tracker.finish("FINISHED")

    mlflow_uri(tracker.uri)
    uri = f"runs:/{tracker.run_id}/model"
    # Saved with pickle (torch.export takes positional inputs only): loading it has to be allowed.
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")
    loaded = mlflow.pytorch.load_model(uri)
    pixels = sample_batch(config)["pixels"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(pixels=pixels), model(pixels=pixels))
    metadata = mlflow.models.get_model_info(uri)
    assert [c.name for c in metadata.signature.inputs.inputs] == ["pixels"]
    assert metadata.saved_input_example_info["type"] == "dataframe"
    # The pyfunc flavour calls forward(pixels=...) with the column of that name.
    predicted = mlflow.pyfunc.load_model(uri).predict(pd.DataFrame({"pixels": list(pixels.numpy())}))
    with torch.no_grad():
        np.testing.assert_array_equal(predicted["class"].to_numpy(), model(pixels=pixels).argmax(-1).numpy())


def test_a_model_that_cannot_be_logged_warns_one_line_and_tracking_goes_on(
        tmp_path: Path, digits_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    from mlflow.tracking import MlflowClient

    from orchestrator.run.checks import resolve_for_data
    from orchestrator.tracking.client import MlflowTracker
    from orchestrator.tracking.flavour import log_final_model
    from orchestrator.tracking.tracker import NullTracker
    from pipelines.datasets import inspect_datasets

    config = load_config(None, [f"data.train={digits_dir}/train", f"data.val={digits_dir}/val",
                                f"tracking.uri=sqlite:///{tmp_path}/m.db", "tracking.experiment=broken"])
    infos = inspect_datasets(config.data)
    config = resolve_for_data(config, infos)

    def unreadable() -> dict[str, Any]:
        raise OSError("checkpoint gone\nsecond line")

    log_final_model(NullTracker(), config, infos["train"], unreadable)  # no tracking: not even read
    assert capsys.readouterr().err == ""
    tracker = MlflowTracker(config.tracking, "broken")
    capsys.readouterr()  # MLflow's own lines about creating the store
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no tracking warning: the store is fine
        log_final_model(tracker, config, infos["train"], unreadable)
        wrong = {"0.weight": torch.zeros(3, 3)}  # not this model's weights
        log_final_model(tracker, config, infos["train"], lambda: wrong)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("warning: the final model was not logged as an MLflow Model (OSError: checkpoint")
    assert "RuntimeError" in lines[1]
    tracker.log_metrics({"after": 1.0}, step=1)
    tracker.finish("FINISHED")
    client = MlflowClient(tracker.uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["after"] == 1.0
    assert client.search_logged_models([run.info.experiment_id]) == []
