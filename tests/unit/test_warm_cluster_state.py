"""The warm cluster's bookkeeping without Ray (warm_cluster.py): which recorded cluster may serve a command, and
the keeper and `cluster stop` ending a real process tree by PID. The "head" here is a real process tree standing
in for `ray start` (a shell with a child); tests/integration/test_warm_cluster.py runs the real Ray head."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from orchestrator import warm_cluster
from orchestrator.warm_cluster import IN_USE, fingerprint, mismatch, read_state, write_state


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the keeper inherits it
    return warm_cluster.warm_dir()


@pytest.fixture()
def head() -> Iterator[subprocess.Popen[bytes]]:
    """A process tree in its own session, as `ray start --block` and the processes it starts."""
    process = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300; wait"], start_new_session=True)
    deadline = time.time() + 10
    while not psutil.Process(process.pid).children() and time.time() < deadline:
        time.sleep(0.05)
    try:
        yield process
    finally:
        for proc in [*psutil.Process(process.pid).children(recursive=True), psutil.Process(process.pid)]:
            try:
                proc.kill()
            except psutil.Error:
                pass
        process.wait()


@pytest.fixture()
def listening() -> Iterator[str]:
    """An address that answers, as a head's GCS port does."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield f"127.0.0.1:{server.getsockname()[1]}"


def recorded(head: subprocess.Popen[bytes], address: str, minutes: float = 10.0, cpus: int = 4) -> dict[str, Any]:
    return {"address": address, "dashboard": "http://127.0.0.1:1", "head_pid": head.pid,
            "head_created": psutil.Process(head.pid).create_time(), "temp_dir": "/nonexistent/warm-test",
            "num_cpus": cpus, "keep_warm_minutes": minutes, "started_at": time.time(),
            "fingerprint": fingerprint("/src", "disabled")}


def tree(head: subprocess.Popen[bytes]) -> list[int]:
    return [head.pid, *(p.pid for p in psutil.Process(head.pid).children(recursive=True))]


def gone(pids: list[int], within_s: float) -> bool:
    deadline = time.time() + within_s
    while time.time() < deadline:
        if not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids):
            return True
        time.sleep(0.1)
    return False


def test_a_recorded_cluster_serves_only_the_environment_it_was_started_in(
        head: subprocess.Popen[bytes], listening: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    state = recorded(head, listening)
    assert mismatch(state, fingerprint("/src", "disabled"), 4) is None
    assert "another Ray (" in mismatch(state | {"fingerprint": state["fingerprint"] | {"ray": "2.59.0"}},
                                       fingerprint("/src", "disabled"), 4)
    assert "another PYTHONPATH" in mismatch(state, fingerprint("/other", "disabled"), 4)
    assert "another RAY_AUTH_MODE" in mismatch(state, fingerprint("/src", "token"), 4)
    assert "has 4 CPUs and this run needs 6" in mismatch(state, fingerprint("/src", "disabled"), 6)
    started = warm_cluster.start_environment()  # the command's own, whatever it set in itself since
    monkeypatch.setenv("SET_IN_THIS_PROCESS", "1")
    assert mismatch(state, fingerprint("/src", "disabled"), 4) is None
    reason = mismatch(state, fingerprint("/src", "disabled", started | {"AWS_ACCESS_KEY_ID": "another-key"}), 4)
    assert "another environment (AWS_ACCESS_KEY_ID differ)" in reason and "another-key" not in reason
    terminal = started | {"COLUMNS": "80", "PYTHONBREAKPOINT": "ray.util.rpdb._driver_set_trace"}
    assert mismatch(state, fingerprint("/src", "disabled", terminal), 4) is None
    monkeypatch.chdir(tmp_path)
    assert "another working directory" in mismatch(state, fingerprint("/src", "disabled"), 4)


def test_a_cluster_whose_head_is_gone_or_mute_is_not_reused(head: subprocess.Popen[bytes], listening: str) -> None:
    state = recorded(head, listening)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        mute = f"127.0.0.1:{closed.getsockname()[1]}"
    assert "does not answer" in mismatch(state | {"address": mute}, fingerprint("/src", "disabled"), 4)
    # Another process given the head's PID later is not the head.
    assert "lost its head process" in mismatch(state | {"head_created": state["head_created"] - 60},
                                               fingerprint("/src", "disabled"), 4)


def test_the_keeper_spares_a_cluster_in_use_and_stops_it_once_idle(
        cache: Path, head: subprocess.Popen[bytes], listening: str) -> None:
    pids = tree(head)
    state = recorded(head, listening, minutes=0.04)  # 2.4 s idle
    keeper = subprocess.Popen([sys.executable, "-m", "orchestrator.warm_cluster", "keep", str(head.pid)],
                              start_new_session=True)
    try:
        with open(cache / IN_USE, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)  # a command runs on it
            write_state(cache, state | {"keeper_pid": keeper.pid,
                                        "keeper_created": psutil.Process(keeper.pid).create_time()})
            assert not gone(pids, within_s=4)  # past its idle time: held, so kept
            os.utime(cache / warm_cluster.STATE)  # the command's end touches it
        began = time.time()
        assert gone(pids, within_s=10)
        assert time.time() - began >= 2.0  # not before its idle time
        assert keeper.wait(timeout=10) == 0 and read_state(cache) is None
    finally:
        keeper.kill()
        keeper.wait()


def test_cluster_stop_ends_every_process_of_it_by_pid(
        cache: Path, head: subprocess.Popen[bytes], listening: str) -> None:
    pids = tree(head)
    write_state(cache, recorded(head, listening))
    assert f"warm Ray cluster at {listening}: running, 4 CPUs, " in warm_cluster.status()
    assert warm_cluster.stop_now() == f"stopped the warm Ray cluster at {listening} (head pid {head.pid})"
    assert gone(pids, within_s=5) and read_state(cache) is None
    assert warm_cluster.status().startswith("no warm Ray cluster is running")
