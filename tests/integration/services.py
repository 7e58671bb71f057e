"""Services the integration tests start for real: a free port, a wait for a service to answer, and an
`mlflow server` tracked over HTTP as a team's cluster would (SQLite behind it, artifacts served by it), in a process
group of its own so that it stops (or crashes, for a test) with its uvicorn child."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A service's start-up, not a product figure: on a loaded 2-core machine an `mlflow server` took over 2 minutes.
def wait_for(check: Any, what: str, timeout: float = 300.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except Exception:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s")


@contextmanager
def start_mlflow_server(root: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The server's URI and process, its store and log under `root`; stopped (its whole group) on the way out."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    # One uvicorn worker: MLflow's default of 4 starts four processes that each import MLflow, which on a loaded
    # 2-core machine took the server over a minute to answer; one serves these tests' single client.
    command = [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
               "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1"]
    # Without MLflow's job runner, as cluster/README.md starts a small server: its seven consumer processes serve
    # GenAI jobs that no training run uses, and their start-up doubled the server's CPU.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(root / "server.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        uri = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: urllib.request.urlopen(f"{uri}/health", timeout=5).status == 200, "mlflow server")
            yield uri, process
        finally:
            stop_group(process, signal.SIGTERM)


def stop_group(process: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGKILL) -> None:
    """Signal the process group this module started (the mlflow CLI and its uvicorn); SIGKILL is a crashed
    server. Escalates to SIGKILL if the group has not gone within 30 s."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, sig)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
