"""`orchestrator ui` stopped the ways a user or a service manager stops it: the MLflow server it started (its own
session, with its uvicorn worker) goes with it, and nothing listens on its port. A real `orchestrator ui` on an empty
SQLite store (MLflow creates the schema); no Ray."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # an MLflow server's start: 10-60 s on a loaded 2-core machine


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:`port` (a closed server's port may linger in TIME_WAIT,
    which a new server binds through SO_REUSEADDR: what matters is that nothing listens)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_terminated_ui_stops_its_mlflow_server(tmp_path: Path, sig: signal.Signals) -> None:
    store = tmp_path / "mlruns.db"
    store.touch()
    output = tmp_path / "out.txt"
    # This checkout's code (not whatever the environment installed), as `orchestrator` runs it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH")] if p)}
    with open(output, "w") as out:
        ui = subprocess.Popen([sys.executable, "-m", "orchestrator", "ui", "--tracking-uri", f"sqlite:///{store}"],
                              stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True, env=env)
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while not (found := re.search(r"^open: http://127\.0\.0\.1:(\d+)/", output.read_text(), re.MULTILINE)):
            assert ui.poll() is None and time.monotonic() < deadline, output.read_text()
            time.sleep(0.5)
        port = int(found[1])
        children = psutil.Process(ui.pid).children(recursive=True)
        assert children and listening(port)  # `mlflow ui` and its server answer there

        ui.send_signal(sig)
        ui.wait(timeout=60)
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
        assert not listening(port), f"port {port} still listened on after {sig.name}"
    finally:
        for process in [*children, ui]:  # whatever is left of what this test started, by pid
            try:
                process.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        ui.wait(timeout=10)
