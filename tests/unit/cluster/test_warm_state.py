"""The warm cluster's bookkeeping without Ray (warm_cluster.py): which recorded cluster may serve a command, and
the keeper and `cluster stop` ending a real process tree by PID. The "head" here is a real process tree standing
in for `ray start` (a shell with a child); tests/integration/test_warm_cluster.py runs the real Ray head."""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from orchestrator.cluster import warm as warm_cluster
from orchestrator.cluster.fingerprint import command_environment, fingerprint
from orchestrator.cluster.warm import IN_USE, STATE, mismatch, read_state, write_state


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
    before_loopback = {k: v for k, v in state["fingerprint"].items() if k != "listens"}  # every interface
    assert "another listening address (None; here 127.0.0.1)" in mismatch(
        state | {"fingerprint": before_loopback}, fingerprint("/src", "disabled"), 4)
    # What a command has now (the shell's environment, with the credential, endpoint and device variables as this
    # process holds them: an earlier test's mlflow.set_tracking_uri leaves MLFLOW_TRACKING_URI set in it).
    started = command_environment()
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
    keeper = subprocess.Popen([sys.executable, "-m", "orchestrator.cluster.warm", "keep", str(head.pid)],
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


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_a_credential_endpoint_or_device_variable_set_in_the_process_is_another_environment(
        head: subprocess.Popen[bytes], listening: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A notebook that changes os.environ between two runs: the cluster's workers inherit the environment it was
    started in, so a changed AWS_*, MLFLOW_*, HF_* or CUDA_VISIBLE_DEVICES value is another environment (the cluster
    is replaced, and the run sees the new value); set or removed alike. What the product sets in itself for MLflow
    (each tracking process sets it again) is not."""
    state = recorded(head, listening)
    for name in ("AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_TOKEN", "HF_TOKEN", "CUDA_VISIBLE_DEVICES"):
        with monkeypatch.context() as notebook:
            notebook.setenv(name, "set-in-the-notebook")
            assert mismatch(state, fingerprint("/src", "disabled"), 4) == \
                f"was started in another environment ({name} differ)"
            assert mismatch(recorded(head, listening), fingerprint("/src", "disabled"), 4) is None
            with_it = recorded(head, listening)
            notebook.delenv(name)
            assert mismatch(with_it, fingerprint("/src", "disabled"), 4) == \
                f"was started in another environment ({name} differ)"
    from orchestrator.tracking.client import PROCESS_SETTINGS

    for name, value in PROCESS_SETTINGS.items():
        monkeypatch.setenv(name, value)
    assert mismatch(state, fingerprint("/src", "disabled"), 4) is None


def test_the_warm_clusters_files_and_directories_are_its_owners_alone(cache: Path, tmp_path: Path) -> None:
    """On a shared machine: its directory 0700 and its files 0600; Ray's temp dir, which `ray start` makes 0777,
    inside a directory of this user's alone also when the cache's path is too long for it (under /tmp), and that
    directory removed with the cluster."""
    write_state(cache, {"address": "127.0.0.1:1"})
    assert not warm_cluster._in_use(cache)
    assert mode(cache) == 0o700
    assert {p.name: oct(mode(p)) for p in cache.iterdir()} == {STATE: "0o600", IN_USE: "0o600"}

    from ray._common.utils import try_to_create_directory

    long = tmp_path / ("x" * warm_cluster.MAX_TEMP_DIR)
    long.mkdir()
    temp = warm_cluster._ray_temp_dir(long)  # too long for Ray's sockets: under the system's temp dir
    try_to_create_directory(str(temp))  # what `ray start --temp-dir` does with it: chmod 0777
    assert len(str(temp)) <= warm_cluster.MAX_TEMP_DIR and temp.parent.parent == Path(tempfile.gettempdir())
    assert oct(mode(temp.parent)) == "0o700" and temp.parent.stat().st_uid == os.getuid()
    warm_cluster.stop_cluster({"head_pid": os.getpid(), "head_created": 0.0, "temp_dir": str(temp)}, long)
    assert not temp.parent.exists()


def test_the_ray_token_a_warm_cluster_is_joined_with_is_its_owners_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Token auth: the token (~/.ray/auth_token) is the cluster's password. Made when missing, as Ray's own local
    cluster makes it, but 0600 in a 0700 directory (Ray writes it with the default umask: 0644); one an earlier
    `ray.init()` wrote 0644 is kept, made 0600."""
    from ray._private.authentication import authentication_token_setup as tokens

    from orchestrator.cluster.local import private_token

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    # Token mode for this call only: the test process's own Ray stays in the suite's mode.
    monkeypatch.setattr(tokens, "get_authentication_mode", lambda: tokens.AuthenticationMode.TOKEN)
    token = tmp_path / ".ray" / "auth_token"
    private_token()
    assert (oct(mode(token)), oct(mode(token.parent)), len(token.read_text())) == ("0o600", "0o700", 64)
    made = token.read_text()
    token.chmod(0o644)
    private_token()
    assert oct(mode(token)) == "0o600" and token.read_text() == made


def test_the_heads_ports_are_distinct_and_free() -> None:
    # Ray refuses a head whose components share a port ("used by other components"): ports picked one at a time,
    # each socket closed before the next pick, may come back twice.
    ports = warm_cluster.free_ports(64)
    assert len(set(ports)) == 64
    for port in ports[:4]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # still free once picked
