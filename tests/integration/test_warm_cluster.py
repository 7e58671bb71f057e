"""The local clusters a command starts. The warm path (cluster.keep_warm_minutes, warm_cluster.py) through the CLI, as a
user runs it: a second `orchestrator train` joins the first one's cluster and starts none (one Ray session, the same
head PID) and its start-up is lower; its CPUs are all free again between runs; `orchestrator cluster stop` leaves no
process of it; a recorded cluster of another Ray version is not reused; an idle one is gone after its idle time. On a
shared machine it is its user's alone: its files owner-only, every port on loopback. A notebook that sets a variable
in itself between runs trains with the new value. Each test stops what it started by PID, also on failure.
XDG_CACHE_HOME is the test's own: the user's warm cluster is not touched. The default per-command cluster
(keep_warm_minutes 0) is as private as the warm one, for a user with a fresh home."""

from __future__ import annotations

import json
import os
import re
import shutil
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

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
STARTUP = re.compile(r"^start-up ([\d.]+) s to the first step: .*?ray start ([\d.]+) s", re.M)  # a part, or alongside


@pytest.fixture()
def cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This test's cache directory (short: Ray's temp dir then lies under it); any cluster left in it is stopped
    by PID at the end."""
    root = Path(tempfile.mkdtemp(prefix="warm"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(root))  # the commands inherit it
    from orchestrator.cluster import warm as warm_cluster

    try:
        yield warm_cluster.warm_dir()
    finally:
        state = warm_cluster.read_state(warm_cluster.warm_dir())
        if state is not None:
            warm_cluster.stop_cluster(state, warm_cluster.warm_dir())
        shutil.rmtree(root, ignore_errors=True)


def overrides(tmp_path: Path, digits_dir: str, minutes: float) -> list[str]:
    return [f"data.train={digits_dir}/train", f"data.val={digits_dir}/val", f"storage.path={tmp_path}/runs",
            f"tracking.uri=sqlite:///{tmp_path}/mlruns.db", "train.max_steps=20", "optim.warmup_steps=2",
            "checkpoint.every=20", f"cluster.keep_warm_minutes={minutes}"]


def train(tmp_path: Path, digits_dir: str, minutes: float) -> subprocess.CompletedProcess[str]:
    sets = [arg for value in overrides(tmp_path, digits_dir, minutes) for arg in ("--set", value)]
    command = [str(BIN / "orchestrator"), "train", "--config", str(ROOT / "examples" / "digits.yaml"), *sets]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


# A notebook's cells: a variable set in the process, then a run through the Python API (argv: config, overrides).
NOTEBOOK = """
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
from orchestrator import load_config, train
train(load_config(sys.argv[1], sys.argv[2:]))
print(f"driver pid {os.getpid()}")
"""


def train_in_notebook(tmp_path: Path, digits_dir: str) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """The notebook's run with a model that records what each process that builds it sees of HF_HUB_OFFLINE; the
    run's output and {pid: value} of its Ray Train workers (the driver builds the model too: left out)."""
    shutil.copy(Path(__file__).with_name("env_model.py"), tmp_path)  # the user's module, in the working directory
    seen = tmp_path / "seen"
    seen.mkdir()
    model = ["model.entrypoint=env_model:build", "model.variable=HF_HUB_OFFLINE", f"model.out_dir={seen}"]
    done = subprocess.run([str(BIN / "python"), "-c", NOTEBOOK, str(ROOT / "examples" / "digits.yaml"),
                           *overrides(tmp_path, digits_dir, 5), *model],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    driver = re.search(r"^driver pid (\d+)$", done.stdout, re.M)[1]  # type: ignore[index]
    return done, {p.name: p.read_text() for p in seen.iterdir() if p.name != driver}


LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def listening_on(pids: list[int]) -> set[str]:
    """The addresses these processes accept TCP connections on."""
    found: set[str] = set()
    for pid in pids:
        try:
            found |= {c.laddr.ip for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
    return found


def mode(path: Path) -> str:
    return oct(stat.S_IMODE(path.lstat().st_mode))


def processes(state: dict[str, Any]) -> list[int]:
    """The cluster's processes now: its head's tree and its keeper."""
    head = psutil.Process(state["head_pid"])
    return [head.pid, *(p.pid for p in head.children(recursive=True)), state["keeper_pid"]]


def gone(pids: list[int], within_s: float) -> bool:
    deadline = time.time() + within_s
    while time.time() < deadline:
        if not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]:
            return True
        time.sleep(0.2)
    return False


def free_cpus(address: str) -> tuple[float, float]:
    """(available, total) CPUs of the cluster once the last run's actors are gone (polled: Ray frees them as the
    driver's job ends)."""
    before = dict(os.environ)  # before `import ray`, which sets some of its own
    import ray

    from orchestrator.cluster.local import local_only

    with local_only():  # the cluster listens on loopback only
        ray.init(address=address)
    try:
        deadline = time.time() + 20
        while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and time.time() < deadline:
            time.sleep(0.2)
        return ray.available_resources().get("CPU", 0), ray.cluster_resources()["CPU"]
    finally:
        ray.shutdown()
        os.environ.clear()  # as before: the next command starts from this test's environment, not a driver's
        os.environ.update(before)


def test_a_second_command_joins_the_first_ones_cluster_and_cluster_stop_ends_it(
        cache: Path, tmp_path: Path, digits_dir: str) -> None:
    from orchestrator.cluster.warm import HEAD_LOG, IN_USE, KEEPER_LOG, STARTING, STATE, read_state

    assert os.environ.get("HF_HUB_OFFLINE") != "1"  # what the notebook below changes
    first = train(tmp_path, digits_dir, minutes=5)
    state = read_state(cache)
    assert state is not None
    assert (f"Ray cluster kept warm for 5 min at {state['address']} for the next run; `orchestrator cluster stop` "
            "ends it now") in first.stdout.splitlines()
    # Its user's alone on a shared machine: no other local user reads its files or reaches a port of it.
    addresses = listening_on(processes(state))
    assert addresses and addresses <= LOOPBACK, addresses
    files = {p.name: mode(p) for p in cache.iterdir() if p.is_file()}
    assert {STATE, IN_USE, STARTING, HEAD_LOG, KEEPER_LOG} <= files.keys() and set(files.values()) == {"0o600"}, files
    assert mode(cache) == "0o700" and Path(state["temp_dir"]).parent == cache  # Ray makes its own temp dir 0777
    sessions = sorted(p.name for p in Path(state["temp_dir"]).glob("session_2*"))
    assert len(sessions) == 1
    available, total = free_cpus(state["address"])
    assert available == total, "the first run's actors still hold CPUs"

    second = train(tmp_path, digits_dir, minutes=5)
    assert f"joined the warm Ray cluster at {state['address']}" in second.stdout
    assert read_state(cache)["head_pid"] == state["head_pid"]  # type: ignore[index]
    assert sorted(p.name for p in Path(state["temp_dir"]).glob("session_2*")) == sessions  # no other Ray started
    # The join is the second's whole `ray start` stage: far below a start (0.4 s against 7.6 s under a loaded
    # suite). The total start-up is the bench's to compare (bench/startup.py): other stages vary more than that.
    (_, first_ray), (_, second_ray) = (
        map(float, STARTUP.search(done.stdout).groups()) for done in (first, second))  # type: ignore[union-attr]
    assert second_ray < first_ray / 3, (first.stdout, second.stdout)

    # A notebook sets HF_HUB_OFFLINE in itself, then trains: its workers see the value. The cluster's workers
    # inherit the environment it was started in, so it is replaced.
    replaced = processes(state)
    notebook, workers = train_in_notebook(tmp_path, digits_dir)
    assert workers and set(workers.values()) == {"1"}, (workers, notebook.stdout[-3000:])
    assert (f"the warm Ray cluster at {state['address']} was started in another environment (HF_HUB_OFFLINE "
            "differ): stopped it; starting a fresh one") in notebook.stdout
    assert gone(replaced, within_s=15)
    state = read_state(cache)
    assert state is not None

    pids = processes(state)
    stopped = subprocess.run([str(BIN / "orchestrator"), "cluster", "stop"], capture_output=True, text=True,
                             timeout=60)
    assert stopped.stdout.strip() == f"stopped the warm Ray cluster at {state['address']} (head pid " \
                                     f"{state['head_pid']})", stopped.stdout + stopped.stderr
    assert gone(pids, within_s=15) and read_state(cache) is None


def test_a_cluster_of_another_ray_version_is_replaced_and_an_idle_one_stops_itself(
        cache: Path, tmp_path: Path, digits_dir: str) -> None:
    from orchestrator.cluster.warm import STATE, read_state

    train(tmp_path, digits_dir, minutes=5)
    stale = read_state(cache)
    assert stale is not None
    stale_pids = processes(stale)
    stale["fingerprint"]["ray"] = "2.59.0"  # as if started before an upgrade
    (cache / STATE).write_text(json.dumps(stale))

    done = train(tmp_path, digits_dir, minutes=0.2)  # 12 s idle
    assert (f"the warm Ray cluster at {stale['address']} was started with another Ray (2.59.0; here "
            in done.stdout), done.stdout
    assert gone(stale_pids, within_s=5)
    fresh = read_state(cache)
    assert fresh is not None and fresh["head_pid"] != stale["head_pid"]
    assert "joined the warm Ray cluster" not in done.stdout

    pids = processes(fresh)
    last_used = (cache / STATE).stat().st_mtime  # the command's release (before its summary and exit)
    assert gone(pids, within_s=40) and read_state(cache) is None
    assert time.time() - last_used >= 12 - 1  # not before its idle time


# A user's script: a run's cluster, as `train` starts it by default (cluster.keep_warm_minutes 0), held until told.
PER_COMMAND = """
import json, sys
import ray
from orchestrator import load_config
from orchestrator.cluster.local import connect_ray, shutdown_local_ray
assert connect_ray(None, load_config(None, []))
print(json.dumps({"temp_dir": ray._private.worker._global_node.get_temp_dir_path()}), flush=True)
sys.stdin.readline()
shutdown_local_ray()
"""


def exposed(root: Path) -> list[str]:
    """The paths under `root` (a 1777 directory, as /tmp) that another local user can read or write: every directory
    above them lets others through, and their own mode lets others read or write."""
    found = []
    for parent, dirs, files in os.walk(root):  # links are not followed: their targets are walked as themselves
        modes = {name: Path(parent, name).lstat().st_mode for name in dirs + files}
        found += [os.path.join(parent, n) for n, m in modes.items() if not stat.S_ISLNK(m) and m & 0o066]
        dirs[:] = [n for n in dirs if modes[n] & 0o011]  # below a directory others cannot pass, nothing is theirs
    return sorted(found)


def test_the_per_command_cluster_is_its_users_alone_too(tmp_path: Path) -> None:
    """On a shared machine no other local user reaches the default cluster: every port of its processes is on
    loopback, Ray's token (~/.ray/auth_token, made on first use) is owner-only, and nothing of its temp dir (Ray makes
    its directories 0777) is readable or writable by others. A fresh user home and temp dir, as most systems make
    them (home 0755, /tmp 1777); the user's shell has set no Ray variable."""
    home, temp = Path(tempfile.mkdtemp(prefix="home")), Path(tempfile.mkdtemp(prefix="tmp"))  # short: Ray's sockets
    home.chmod(0o755)
    temp.chmod(0o1777)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "XDG_"))} | {
        "HOME": str(home), "TMPDIR": str(temp)}
    driver = subprocess.Popen([str(BIN / "python"), "-c", PER_COMMAND], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    pids = [driver.pid]
    try:
        line = driver.stdout.readline()  # type: ignore[union-attr]
        assert line, driver.communicate(timeout=30)[1][-3000:]
        temp_dir = Path(json.loads(line)["temp_dir"])
        pids += [p.pid for p in psutil.Process(driver.pid).children(recursive=True)]
        addresses, token = listening_on(pids), home / ".ray" / "auth_token"
        assert temp_dir.is_relative_to(temp) and (temp_dir / "session_latest" / "sockets").is_dir(), temp_dir
        seen = {"off loopback": sorted(addresses - LOOPBACK), "token, ~/.ray": (mode(token), mode(token.parent)),
                "others reach": exposed(temp)}
        assert addresses and seen == {"off loopback": [], "token, ~/.ray": ("0o600", "0o700"), "others reach": []}
    finally:
        driver.stdin.write("\n")  # type: ignore[union-attr]
        driver.stdin.close()  # type: ignore[union-attr]
        try:
            driver.wait(timeout=60)
        finally:
            for pid in pids:  # whatever is left of it, by PID
                try:
                    psutil.Process(pid).kill()
                except psutil.Error:
                    pass
            shutil.rmtree(home, ignore_errors=True)
            shutil.rmtree(temp, ignore_errors=True)
    assert driver.returncode == 0
