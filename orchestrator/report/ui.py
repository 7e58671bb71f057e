"""`orchestrator ui`: the MLflow UI for a run's store, started from this environment's own MLflow
(not whatever `mlflow` a shell finds on PATH) on a free port, with the experiment's URL printed in
MLflow's training view. For an http(s) tracking server there is nothing to start: its URL is
printed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from orchestrator.errors import UserError
from orchestrator.tracking.links import (
    RUNS_VIEW_TAG,
    TRAINING_VIEW,
    UI_PORT,
    experiment_url,
    ui_base,
)
from orchestrator.tracking.uri import mask_password, resolve_uri

JOB_EXECUTION = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"
BACKEND_STORE = "MLFLOW_BACKEND_STORE_URI"  # the envvar of `mlflow ui/server --backend-store-uri`
# a cold MLflow server imports a lot; on a busy laptop this took over a minute
START_TIMEOUT_S = 120.0


def free_port(preferred: int = UI_PORT, host: str = "127.0.0.1") -> int:
    """`preferred` when nothing listens there, else a port the system picks."""
    for port in (preferred, 0):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise UserError(f"no free TCP port on {host} for the MLflow UI: pass --port")


def store_check(uri: str) -> None:
    """A SQLite store that does not exist is a typo or the wrong working directory, not an empty
    store."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not Path(uri[len(prefix):]).is_file():
        raise UserError(f"no MLflow store at {uri[len(prefix):]}: run `orchestrator train` "
                        "first, or pass --tracking-uri (the URI `orchestrator train` printed)")


def landing_url(uri: str, name: str | None, port: int) -> str:
    """The experiment's runs list in the training view (in the product's runs view where it holds
    one), or the experiments list when it is not known."""
    from mlflow.tracking import MlflowClient

    found = MlflowClient(tracking_uri=uri).get_experiment_by_name(name) if name else None
    if found is not None:
        return experiment_url(uri, found.experiment_id, port, view=RUNS_VIEW_TAG in found.tags)
    return f"{ui_base(uri, port)}/#/experiments?{TRAINING_VIEW}"


def start(uri: str, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """`mlflow ui` for `uri` on 127.0.0.1:`port` from this Python's MLflow, its output in
    `log_path`, in a session of its own (so Ctrl+C reaches it through this process, which stops it
    with its workers). The store's URI goes in its environment, not on its command line, which every
    user of the machine can read (`ps`): a SQL store's password would be theirs for as long as the
    UI runs. MLflow hands it on to its server workers the same way."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "mlflow", "ui", "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1"]
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=ui_environment(uri))


def ui_environment(uri: str) -> dict[str, str]:
    """This environment, with MLflow's job runner off unless the user turned it on: its seven
    consumer processes (GenAI evaluation and trace jobs, nothing a training run logs) each import
    MLflow, about 20 s of CPU that the UI's own start competes with on a laptop. `uri`: the store to
    serve, as `mlflow ui --backend-store-uri` reads it from the environment
    (MLFLOW_BACKEND_STORE_URI), over any the user exported."""
    return {JOB_EXECUTION: "false", **os.environ, BACKEND_STORE: uri}


def wait_until_up(process: subprocess.Popen[bytes], port: int, log_path: Path,
                  timeout_s: float = START_TIMEOUT_S) -> None:
    """Until the UI answers on `port`; a UI that exits or does not answer in time is a UserError
    naming its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = (log_path.read_text(errors="replace").strip().splitlines()[-1:]
                    if log_path.is_file() else [])
            raise UserError(f"the MLflow UI exited with status {process.returncode} "
                            f"({' '.join(tail)[:300]}): see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    stop(process)
    raise UserError(f"the MLflow UI did not answer on port {port} "
                    f"within {timeout_s:.0f} s: see {log_path}")


def stop(process: subprocess.Popen[bytes]) -> None:
    """The UI and its workers, politely first."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def serve(uri: str | None, experiment: str | None, port: int | None, log_path: Path) -> int:
    """Start the UI, print where to look, and wait until Ctrl+C, SIGTERM or SIGHUP (each stops it)
    or until it exits."""
    uri = resolve_uri(uri)
    if uri.startswith(("http://", "https://")):
        print("the MLflow UI is the tracking server's: "
              f"{landing_url(uri, experiment, 0)}", flush=True)
        return 0
    store_check(uri)
    port = free_port(port or UI_PORT)
    with stopped_by_signals():
        process = start(uri, port, log_path)
        try:
            wait_until_up(process, port, log_path)
            print(f"MLflow UI for {mask_password(uri)} (its log: "
                  f"{log_path}); Ctrl+C stops it", flush=True)
            print(f"open: {landing_url(uri, experiment, port)}", flush=True)
            return process.wait()
        finally:
            stop(process)


@contextmanager
def stopped_by_signals() -> Iterator[None]:
    """SIGTERM (`kill`, a service manager) and SIGHUP (the terminal closed) end the block as an
    exception, so that its cleanup stops the UI: by default Python dies at once on them, and the UI,
    in a session of its own, would keep listening. Only in the main thread (where Python runs signal
    handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
