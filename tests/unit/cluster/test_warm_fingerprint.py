"""The warm cluster's reuse fingerprint (warm_cluster.py), one key at a time: a command that differs from the recorded
cluster in any one of them (another Python interpreter, another Ray installed, another working directory, another
PYTHONPATH, auth mode or environment, a cluster that listened elsewhere) is not served by it, and the reason names
that key; a command that differs in none is. Each case changes what a user would change, and the fingerprint is
computed by `fingerprint` as the command computes it. No Ray is started: the recorded head is a process of this
test with a listening socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psutil
import pytest

from orchestrator.cluster.fingerprint import fingerprint, start_environment
from orchestrator.cluster.warm import mismatch

PYTHONPATH, AUTH = "/src", "disabled"


@pytest.fixture()
def recorded(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A recorded cluster whose head runs and answers, started from this command's own fingerprint."""
    head = subprocess.Popen(["sleep", "300"], start_new_session=True)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        try:
            yield {"address": f"127.0.0.1:{server.getsockname()[1]}", "dashboard": "http://127.0.0.1:1",
                   "head_pid": head.pid, "head_created": psutil.Process(head.pid).create_time(),
                   "temp_dir": str(tmp_path / "ray"), "num_cpus": 4, "keep_warm_minutes": 10.0,
                   "started_at": time.time(), "fingerprint": fingerprint(PYTHONPATH, AUTH, start_environment())}
        finally:
            head.kill()
            head.wait()


def _another_ray(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """Another Ray first on the path (a virtual environment's, a user site's): its metadata is what Python finds."""
    info = tmp_path / "ray-2.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ray\nVersion: 2.0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert version("ray") == "2.0.0"
    return fingerprint(PYTHONPATH, AUTH, start_environment())


def _another_python(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python3"))
    return fingerprint(PYTHONPATH, AUTH, start_environment())


def _another_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    monkeypatch.chdir(tmp_path)  # (the shell's PWD variable stays: the process's own directory counts)
    return fingerprint(PYTHONPATH, AUTH, start_environment())


def _another_pythonpath(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    return fingerprint(f"{PYTHONPATH}:{tmp_path}", AUTH, start_environment())


def _another_auth_mode(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    return fingerprint(PYTHONPATH, "token", start_environment())


def _another_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    return fingerprint(PYTHONPATH, AUTH, start_environment() | {"HF_HOME": str(tmp_path)})


CASES: dict[str, tuple[Callable[[pytest.MonkeyPatch, Path], dict[str, Any]], str]] = {
    "ray": (_another_ray, f"was started with another Ray ({version('ray')}; here 2.0.0)"),
    "python": (_another_python, f"was started with another Python ({sys.executable}; here "),
    "cwd": (_another_directory, f"was started with another working directory ({os.getcwd()}; here "),
    "pythonpath": (_another_pythonpath, f"was started with another PYTHONPATH ({PYTHONPATH}; here {PYTHONPATH}:"),
    "auth_mode": (_another_auth_mode, f"was started with another RAY_AUTH_MODE ({AUTH}; here token)"),
    "env": (_another_environment, "was started in another environment (HF_HOME differ)"),
}


@pytest.mark.parametrize("key", sorted(CASES))
def test_a_command_that_differs_in_one_key_starts_a_fresh_cluster(
        key: str, recorded: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert mismatch(recorded, fingerprint(PYTHONPATH, AUTH, start_environment()), 4) is None  # the same command
    change, reason = CASES[key]
    wanted = change(monkeypatch, tmp_path)
    assert {k for k in wanted if wanted[k] != recorded["fingerprint"][k]} == {key}
    found = mismatch(recorded, wanted, 4)
    assert found is not None and found.startswith(reason), found


def test_a_cluster_that_listened_elsewhere_is_not_reused(recorded: dict[str, Any]) -> None:
    """`listens` is the product's, not the command's: a cluster recorded by a version that listened on every
    interface (no such key, or another address) is not joined."""
    wanted = fingerprint(PYTHONPATH, AUTH, start_environment())
    for listened in (None, "0.0.0.0"):
        have = {k: v for k, v in recorded["fingerprint"].items() if k != "listens"}
        have |= {} if listened is None else {"listens": listened}
        found = mismatch(recorded | {"fingerprint": have}, wanted, 4)
        assert found == f"was started with another listening address ({listened}; here {wanted['listens']})"


def test_every_key_of_the_fingerprint_has_its_case() -> None:
    """A key added to the fingerprint gets a case above (or is the product's own, as `listens`)."""
    assert set(fingerprint(PYTHONPATH, AUTH)) == set(CASES) | {"listens"}
