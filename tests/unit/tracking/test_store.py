"""A call the MLflow store refuses is not an outage, and Ctrl+C never leaves a run RUNNING. Against real stores: a
SQLite file in tmp_path (refusals, a resumed run with a changed param, an interrupted set-up) and an HTTP URI that
nothing listens on (an outage); no Ray."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from orchestrator.config import TrackingConfig, load_config
from orchestrator.run import launch
from orchestrator.tracking.client import MlflowTracker
from orchestrator.tracking.view import chart_key, mlflow_key


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite store for the module (making one runs MLflow's migrations: seconds); one experiment per test."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlruns.db"


def steps_of(tracker: MlflowTracker, name: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    # Where the run charts it: the training loss is a headline chart.
    history = MlflowClient(tracker.uri).get_metric_history(tracker.run_id, chart_key(mlflow_key(name), None))
    return sorted(m.step for m in history)


def test_a_resumed_run_whose_config_changed_a_param_keeps_every_report_and_tags_the_change(
        store: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--resume --set scaling.num_workers=1` on a run started with 2 workers (a documented resize): MLflow keeps a
    param's first value, so the change is a tag, and the reports after it all reach the store."""
    from mlflow.tracking import MlflowClient

    cfg = TrackingConfig(uri=store, experiment="resized")
    first = MlflowTracker(cfg, "resized-run")
    first.log_params({"scaling.num_workers": 2, "optim.lr": 0.1})
    first.log_metrics({"train_loss": 1.0}, step=100)
    first.finish("KILLED")
    capsys.readouterr()  # MLflow's own lines about creating the store

    again = MlflowTracker(cfg, "resized-run", run_id=first.run_id)
    again.log_params({"scaling.num_workers": 1, "optim.lr": 0.1, "train.max_steps": 175})
    for step in (125, 150, 175):
        again.log_metrics({"train_loss": 1.0 / step}, step=step)
    again.finish("FINISHED")

    assert steps_of(again, "train_loss") == [100, 125, 150, 175]
    run = MlflowClient(again.uri).get_run(again.run_id)
    assert run.info.status == "FINISHED"
    # The first value stays the param (MLflow cannot change it), a new key is logged, the change is a tag.
    assert run.data.params == {"scaling.num_workers": "2", "optim.lr": "0.1", "train.max_steps": "175"}
    changed = {k: v for k, v in run.data.tags.items() if k.startswith("orchestrator.param_changed.")}
    assert changed == {"orchestrator.param_changed.scaling.num_workers": "2 -> 1"}
    assert "warning" not in capsys.readouterr().err  # nothing was refused, nothing was taken for an outage

    # Resumed once more with the first value back: the run runs as its params say again, so no change is tagged.
    third = MlflowTracker(cfg, "resized-run", run_id=first.run_id)
    third.log_params({"scaling.num_workers": 2, "optim.lr": 0.1, "train.max_steps": 175})
    third.finish("FINISHED")
    tags = MlflowClient(again.uri).get_run(again.run_id).data.tags
    assert not [k for k in tags if k.startswith("orchestrator.param_changed.")], tags


def test_a_refused_call_warns_once_and_does_not_mark_the_store_down(
        store: str, capsys: pytest.CaptureFixture[str]) -> None:
    tracker = MlflowTracker(TrackingConfig(uri=store, experiment="refused"), "refused-run")
    capsys.readouterr()
    tracker.log_metrics({"train_loss": 0.5}, step=1)
    # A key MLflow refuses ('!' is not allowed in a metric name) in reports of its own; its value changes, so it is
    # charted (a series that keeps one value waits for the summary table): refused at steps 3 and 4.
    for step in (2, 3, 4):
        tracker.log_metrics({"bad key!": float(step)}, step=step)
    tracker.log_metrics({"train_loss": 0.4}, step=5)  # straight after the refusals: the store still takes it
    tracker.finish("FINISHED")

    assert steps_of(tracker, "train_loss") == [1, 5]
    lines = [line for line in capsys.readouterr().err.splitlines() if "MLflow" in line]
    assert len(lines) == 1, lines  # once per kind of call, not per report
    assert lines[0].startswith("warning: MLflow log_metrics was refused by ") and "training continues" in lines[0]


def test_only_an_unreachable_store_is_an_outage(store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real failures from real clients: a refused connection and a timeout are an outage; the SQLite store refusing
    a changed param or a bad metric name, or an artifact file that is not there, is not."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from orchestrator.tracking.store import is_outage

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(Exception) as dead:
        MlflowClient(f"http://127.0.0.1:{port}").log_batch("0" * 32, metrics=[Metric("m", 1.0, 0, 0)])
    assert is_outage(dead.value)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    with socket.socket() as silent:  # listens, never answers: the call times out
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        with pytest.raises(Exception) as timed_out:
            MlflowClient(f"http://127.0.0.1:{silent.getsockname()[1]}").log_batch(
                "0" * 32, metrics=[Metric("m", 1.0, 0, 0)])
    assert "timeout" in str(timed_out.value) and is_outage(timed_out.value)
    with socket.socket() as dying:  # answers, then goes away in the middle of its answer (a server killed)
        dying.bind(("127.0.0.1", 0))
        dying.listen()

        def answer_half() -> None:
            conn, _ = dying.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 400\r\n\r\n{")

        threading.Thread(target=answer_half, daemon=True).start()
        with pytest.raises(Exception) as cut:
            MlflowClient(f"http://127.0.0.1:{dying.getsockname()[1]}").log_batch(
                "0" * 32, metrics=[Metric("m", 1.0, 0, 0)])
    assert is_outage(cut.value), repr(cut.value)

    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("refusals")).info.run_id
    client.log_batch(run_id, params=[Param("scaling.num_workers", "2")])
    with pytest.raises(Exception) as changed:
        client.log_batch(run_id, params=[Param("scaling.num_workers", "1")])
    assert "Changing param values is not allowed" in str(changed.value)
    with pytest.raises(Exception) as bad_name:
        client.log_batch(run_id, metrics=[Metric("bad key!", 1.0, 0, 0)])
    with pytest.raises(Exception) as missing:
        client.log_artifact(run_id, str(tmp_path / "never-written.png"))
    assert not is_outage(changed.value) and not is_outage(bad_name.value) and not is_outage(missing.value)


class _CtrlC:
    """A param value whose str() is where Ctrl+C lands: in the middle of writing the run's params."""

    def __str__(self) -> str:
        raise KeyboardInterrupt


def test_ctrl_c_while_the_run_is_being_set_up_ends_it_killed_and_says_how_to_continue(
        store: str, tmp_path: Path, digits_dir: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from mlflow.tracking import MlflowClient

    config = load_config(None, [f"data.train={digits_dir}/train", f"data.val={digits_dir}/val",
                                f"storage.path={tmp_path}/runs", f"tracking.uri={store}",
                                "tracking.experiment=setup", "scaling.num_workers=1"])
    params = launch.config_params
    monkeypatch.setattr(launch, "config_params", lambda c: {**params(c), "zz.interrupted": _CtrlC()})
    monkeypatch.setattr(launch, "connect_cluster", lambda cluster: False)  # Ray starts meanwhile: none here
    monkeypatch.setattr(launch, "_build_inputs", lambda plan, started_ray, log: None)  # no datasets without it
    monkeypatch.setattr(launch, "_fit", lambda plan, inputs, handle, opening, *args: opening.result())  # group starts
    with pytest.raises(KeyboardInterrupt):
        launch.train(config, verbose=False)

    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("setup").experiment_id])
    assert run.info.status == "KILLED"
    err = capsys.readouterr().err
    assert "interrupted at step 0; no checkpoint yet: a new run starts from step 0" in err, err
