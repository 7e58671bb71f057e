"""A password in a tracking URI (a SQL store's, an http server's userinfo) is never logged, written or printed:
MLflow params cannot be deleted. Masked where the URI is shown (params, a Tune trial's params, config artifacts,
tags, printed commands and URLs, warnings), never where it connects. The job test (test_cluster_jobs.py) greps a
real run for it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import load_config, to_yaml
from orchestrator.tracking.context import config_params, source_name
from orchestrator.tracking.links import run_url, ui_command
from orchestrator.tracking.store import unavailable
from orchestrator.tracking.uri import mask_password, resolve_uri
from orchestrator.tuning.search import trial_config, user_tree

PASSWORD = "s3cr3t-Pa55"


@pytest.mark.parametrize(("uri", "masked"), [
    (f"postgresql://mlflow:{PASSWORD}@db.internal:5432/mlflow", "postgresql://mlflow:***@db.internal:5432/mlflow"),
    (f"mysql+pymysql://u:{PASSWORD}@db/mlflow", "mysql+pymysql://u:***@db/mlflow"),
    (f"http://me:{PASSWORD}@127.0.0.1:5000", "http://me:***@127.0.0.1:5000"),
    (f"https://me:p@ss{PASSWORD}@host/path?x=1", "https://me:***@host/path?x=1"),  # an @ in the password
    ("http://me@host:5000", "http://me@host:5000"),  # a user name alone: no password to hide
    ("sqlite:////tmp/mlruns.db", "sqlite:////tmp/mlruns.db"),
    ("http://127.0.0.1:5000/a@b", "http://127.0.0.1:5000/a@b"),  # an @ in the path is no userinfo
    # A secret as a query parameter: libpq's and SQLAlchemy's password, a token, a presigned URL's signature.
    (f"postgresql://db/mlflow?user=mlflow&password={PASSWORD}&sslmode=require",
     "postgresql://db/mlflow?user=mlflow&password=***&sslmode=require"),
    (f"mysql+pymysql://db/mlflow?passwd={PASSWORD}", "mysql+pymysql://db/mlflow?passwd=***"),
    (f"http://127.0.0.1:5000/?token={PASSWORD}#x", "http://127.0.0.1:5000/?token=***#x"),
    (f"https://b.s3.amazonaws.com/w.pt?X-Amz-Security-Token={PASSWORD}&X-Amz-Signature={PASSWORD}",
     "https://b.s3.amazonaws.com/w.pt?X-Amz-Security-Token=***&X-Amz-Signature=***"),
    (f"https://host/w.pt?sig={PASSWORD}&api_key={PASSWORD}", "https://host/w.pt?sig=***&api_key=***"),
    ("postgresql://db/mlflow?sslmode=require&sslkey=/k.pem", "postgresql://db/mlflow?sslmode=require&sslkey=/k.pem"),
])
def test_the_password_of_a_uri_is_masked_and_nothing_else(uri: str, masked: str) -> None:
    assert mask_password(uri) == masked
    assert mask_password(f"--set tracking.uri={uri} and more") == f"--set tracking.uri={masked} and more"


def test_params_and_a_trials_params_carry_the_uri_masked_and_the_config_keeps_it() -> None:
    uri = f"postgresql://mlflow:{PASSWORD}@db/mlflow"
    config = load_config(None, [f"tracking.uri={uri}"])
    params = config_params(config)
    assert params["tracking.uri"] == "postgresql://mlflow:***@db/mlflow"
    assert not any(PASSWORD in str(v) for v in params.values())
    # A Tune trial's child run: its params from the trial's config, built the way tuning/trials.py builds them.
    trial = trial_config(user_tree(config), {"optim.lr": 0.01})
    assert trial.tracking.uri == uri  # what the trial connects with
    trial_params = config_params(trial)
    assert trial_params["optim.lr"] == 0.01 and not any(PASSWORD in str(v) for v in trial_params.values())
    assert PASSWORD not in mask_password(to_yaml(config)) and "mlflow:***@db" in mask_password(to_yaml(config))
    assert resolve_uri(config.tracking.uri) == uri  # what the tracker connects with


def test_the_command_line_tag_printed_commands_and_errors_hold_no_password() -> None:
    uri = f"http://me:{PASSWORD}@mlflow.internal:5000"
    argv = ["/venv/bin/orchestrator", "train", "--set", f"tracking.uri={uri}"]
    assert source_name(argv) == "orchestrator train --set tracking.uri=http://me:***@mlflow.internal:5000"
    assert ui_command(uri) == "open http://mlflow.internal:5000"  # the browser asks for the credentials
    url = run_url(uri, "abc", experiment_id="1")
    assert url is not None and url.startswith("http://mlflow.internal:5000/#/experiments/1/runs/abc")
    assert PASSWORD not in str(unavailable(uri, ConnectionError(f"refused: {uri}")))

    # A SQL store: the printed command reads $MLFLOW_TRACKING_URI and says so in a comment, so it runs as copied.
    sql = f"postgresql://mlflow:{PASSWORD}@db/mlflow"
    command = ui_command(sql, "digits")
    assert PASSWORD not in command and "MLFLOW_TRACKING_URI=postgresql://mlflow:***@db/mlflow" in command
    words = shlex.split(command, comments=True)
    assert words[1:] == ["ui", "--experiment", "digits"]
    # Without a password the store is named on the command line, as before.
    assert shlex.split(ui_command("sqlite:////tmp/m.db", "digits"))[1:] == [
        "ui", "--tracking-uri", "sqlite:////tmp/m.db", "--experiment", "digits"]


def test_doctor_on_an_unreachable_store_names_it_without_its_password(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from orchestrator.doctor.load import load_run
    from orchestrator.errors import UserError

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # nothing listens: fail at once
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(UserError) as refused:
        load_run("0" * 32, f"http://analyst:{PASSWORD}@127.0.0.1:{port}")
    assert PASSWORD not in str(refused.value) and f"http://analyst:***@127.0.0.1:{port}" in str(refused.value)


@pytest.mark.parametrize(("uri", "masked"), [
    ("http://me:{}@127.0.0.1:1", "http://me:***@127.0.0.1:1"),
    ("http://127.0.0.1:1/?token={}", "http://127.0.0.1:1/?token=***"),
])
def test_the_runs_storage_and_log_hold_no_password_and_a_resume_still_continues_it(
        uri: str, masked: str, tmp_path: Path, digits_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run storage is often a shared bucket: the run's `config.yaml` there (what --resume compares against), its
    record and its log hold the URI masked, as the MLflow run does. A resume takes the password from its own config
    (or $MLFLOW_TRACKING_URI): `tracking.` may change on resume, so the masked URI in storage is no obstacle."""
    from orchestrator.config import to_dict
    from orchestrator.report.console import RunLog
    from orchestrator.run import launch
    from orchestrator.run.plan import plan_run
    from orchestrator.tracking.tracker import NullTracker

    logged: list[str] = []
    secret = uri.format(PASSWORD)

    class Recording(NullTracker):
        """What the run sends to its MLflow run (params, tags, artifacts), as text."""

        uri, run_id = secret, "abc"

        def log_params(self, params: dict[str, Any]) -> None:
            logged.append(json.dumps(params, default=str))

        def set_tags(self, tags: dict[str, str]) -> None:
            logged.append(json.dumps(tags))

        def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
            logged.append(Path(path).read_text())

    monkeypatch.setattr(launch, "start_tracker", lambda *args, **kwargs: Recording())
    sets = [f"data.train={digits_dir}/train", f"data.val={digits_dir}/val", f"storage.path={tmp_path}/runs",
            f"data.s3.endpoint=http://minio:{PASSWORD}@127.0.0.1:9000",  # another URI's password
            "experiment=private", "tracking.enabled=false", "train.max_steps=40"]
    config = load_config(None, [*sets, f"tracking.uri={secret}"])
    plan = plan_run(config, verbose=False)
    with RunLog() as log:
        launch._open_tracking(plan, log, verbose=False)
    files = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert {"config.yaml", "orchestrator-run.json", "orchestrator.log"} <= {p.name for p in files}
    leaked = [str(p) for p in files if PASSWORD in p.read_text()] + [text for text in logged if PASSWORD in text]
    assert not leaked, leaked
    assert masked in Path(plan.place.path, "config.yaml").read_text()  # masked, not dropped
    assert any(text.startswith("run:") for text in logged)  # plan.yaml was among what was logged

    # Resumed with the password given again, or another one, or from $MLFLOW_TRACKING_URI: the same run continues
    # with what its command gives, and what it trains is still compared.
    for given in (secret, uri.format("rotated")):
        resumed = plan_run(load_config(None, [*sets, f"tracking.uri={given}"]), resume=True, verbose=False)
        assert resumed.place.uri == plan.place.uri and to_dict(resumed.config)["tracking"]["uri"] == given
    monkeypatch.setenv("MLFLOW_TRACKING_URI", secret)
    assert plan_run(load_config(None, sets), resume=True, verbose=False).place.uri == plan.place.uri
    from orchestrator.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train\.max_steps: 40 -> 80"):
        plan_run(load_config(None, [*sets[:-1], "train.max_steps=80"]), resume=True, verbose=False)


def test_best_yaml_holds_no_password_of_any_uri() -> None:
    """best.yaml is written beside the study and logged to its MLflow run: every URI's password masked."""
    from orchestrator.tuning.results import best_yaml

    config = load_config(None, [f"tracking.uri=http://me:{PASSWORD}@mlflow.internal:5000",
                                f"data.s3.endpoint=http://minio:{PASSWORD}@127.0.0.1:9000"])
    text = best_yaml(user_tree(config), {"optim.lr": 0.01})
    assert PASSWORD not in text
    assert "http://me:***@mlflow.internal:5000" in text and "http://minio:***@127.0.0.1:9000" in text
    assert "# Passwords in URIs are masked (***): give them with --set" in text  # what training it needs
    assert "masked" not in best_yaml(user_tree(load_config(None, [])), {"optim.lr": 0.01})  # none to mask


def test_a_resume_compares_the_saved_config_as_it_was_masked(tmp_path: Path) -> None:
    """The run's config.yaml keeps a URI's password masked (a model's weights URL, say): the same config resumes,
    and a changed one is refused without the password in the message."""
    from orchestrator.errors import ConfigError
    from orchestrator.run.place import RunPlace
    from pipelines.storage import open_storage

    def config(weights: str) -> Any:
        return load_config(None, ["model.entrypoint=my_models:build", f"model.weights={weights}"])

    place = RunPlace(open_storage(str(tmp_path)), "run")
    place.write_config(config(f"https://me:{PASSWORD}@host/w.pt?token={PASSWORD}"))
    assert PASSWORD not in (tmp_path / "run" / "config.yaml").read_text()
    place.check_resumable(config(f"https://me:{PASSWORD}@host/w.pt?token={PASSWORD}"))
    place.check_resumable(config("https://me:rotated@host/w.pt?token=rotated"))  # the same weights
    with pytest.raises(ConfigError, match="model.weights") as refused:
        place.check_resumable(config(f"https://me:{PASSWORD}@host/other.pt"))
    assert PASSWORD not in str(refused.value)


def test_the_ui_gets_a_sql_stores_password_through_its_environment_not_its_command_line(tmp_path: Path) -> None:
    """Any user of the machine reads a process's command line (`ps`, /proc/<pid>/cmdline): `orchestrator ui` on
    a SQL store hands `mlflow ui` the store's URI in its environment (readable by its owner only). Here the store
    is a PostgreSQL server that is not there: the real child starts, shows its command line while it imports
    MLflow, and fails on the store it was given."""
    import time

    import psutil

    from orchestrator.report.ui import free_port, start, stop

    uri = f"postgresql://mlflow:{PASSWORD}@127.0.0.1:{free_port(0)}/mlflow"
    log = tmp_path / "ui.log"
    process = start(uri, free_port(0), log)
    seen: list[str] = []
    deadline = time.monotonic() + 120  # a UI that ignored the store would serve its default one until then
    try:
        while process.poll() is None and time.monotonic() < deadline:
            try:
                parent = psutil.Process(process.pid)
                seen += [" ".join(p.cmdline()) for p in (parent, *parent.children(recursive=True))]
            except psutil.Error:  # it, or a child, ended meanwhile
                pass
            time.sleep(0.05)
    finally:
        stop(process)
    assert process.returncode not in (None, 0), log.read_text()  # it failed on the store, not at the deadline
    assert any("mlflow ui" in line for line in seen), seen
    assert not [line for line in seen if PASSWORD in line], seen
    assert "dialects/postgresql" in log.read_text()  # the store it was given is the one it tried
