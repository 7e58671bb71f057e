"""The warm local Ray cluster (`cluster.keep_warm_minutes` > 0): a `ray start --head --block`
process of this machine, started detached by one command and joined by the next ones run in the same
environment, recorded in a state file in this user's cache directory. A command takes it only when
its fingerprint matches (Ray version, Python, working directory, PYTHONPATH, auth mode, environment)
and it has the CPUs; otherwise it is stopped and a fresh one started. A small keeper process started
with the head stops the head's process tree by PID once no command has used it for the idle time;
`orchestrator cluster stop` stops it now. A command holds a shared lock while it uses the cluster,
so it is never stopped under a run. On a shared machine it is its user's alone: its files
owner-only, Ray's temp dir inside a directory of its own, every port on loopback. Ray is not
imported here: the keeper stays light."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from orchestrator.cluster.fingerprint import LISTENS
from orchestrator.report.console import RAY_DATA_CONFIG, own_ray_data_config, ray_data_config
from pipelines.storage import owner_only, private_dir, user_cache_dir

STATE, IN_USE, STARTING, HEAD_LOG, KEEPER_LOG = ("state.json", "in-use.lock", "start.lock",
                                                 "head.log", "keeper.log")
HEAD_READY_S = 90.0  # `ray start` on a busy 2-core machine takes 5-15 s
KEEPER_POLL_S = 1.0
# a keeper whose head was never recorded (its command died first) stops it after this
UNRECORDED_S = 120.0
# Unix socket paths (Ray's temp dir + session_<date>_<pid>/sockets/plasma_store) must stay under 108
# bytes.
MAX_TEMP_DIR = 40
# the private directory of Ray's temp dir when the cache's path is too long
PRIVATE_TEMP = "orchestrator-warm-"
def warm_dir() -> Path:
    """This user's directory of the warm cluster: its state file, locks and logs (private, 0700)."""
    return Path(private_dir(os.path.join(user_cache_dir(), "warm")))


def mismatch(state: dict[str, Any], wanted: dict[str, Any], needed_cpus: int) -> str | None:
    """Why the recorded cluster cannot serve this command (a phrase), or None."""
    have = state["fingerprint"]
    names = {"ray": "Ray", "python": "Python", "cwd": "working directory",
             "pythonpath": "PYTHONPATH",
             # one started before it listened on loopback
             "auth_mode": "RAY_AUTH_MODE", "listens": "listening address"}
    for key, name in names.items():
        if have.get(key) != wanted[key]:
            return f"was started with another {name} ({have.get(key)}; here {wanted[key]})"
    if have.get("env") != wanted["env"]:
        differ = sorted(k for k in have.get("env", {}).keys() | wanted["env"].keys()
                        if have.get("env", {}).get(k) != wanted["env"].get(k))
        return f"was started in another environment ({', '.join(differ[:5])} differ)"
    if state["num_cpus"] < needed_cpus:
        return f"has {state['num_cpus']} CPUs and this run needs {needed_cpus}"
    if not alive(state["head_pid"], state["head_created"]):
        return f"has lost its head process (pid {state['head_pid']})"
    if not answers(state["address"]):
        return f"does not answer at {state['address']}"
    return None


def alive(pid: int, created: float) -> bool:
    """The process `pid` runs and is the one started at `created` (not a later process given the
    same PID)."""
    try:
        process = psutil.Process(pid)
        return (abs(process.create_time() - created) < 0.5
                and process.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def answers(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False


RECORDED = ("address", "dashboard", "head_pid", "head_created", "temp_dir", "num_cpus",
            "keep_warm_minutes", "started_at", "fingerprint")


def read_state(directory: Path) -> dict[str, Any] | None:
    """The recorded cluster, or None (none, or a record this version cannot read: its keeper stops
    that one)."""
    try:
        state = json.loads((directory / STATE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and all(key in state for key in RECORDED) else None


def write_state(directory: Path, state: dict[str, Any]) -> None:
    """Atomically (the keeper reads it meanwhile); its modification time is the cluster's last
    use."""
    temporary = directory / f".{STATE}.{os.getpid()}"
    with open(temporary, "w", opener=owner_only) as out:
        out.write(json.dumps(state, indent=1))
    os.replace(temporary, directory / STATE)


def touch(directory: Path) -> None:
    try:
        os.utime(directory / STATE)
    except OSError:
        pass


def idle_s(directory: Path) -> float:
    try:
        return time.time() - (directory / STATE).stat().st_mtime
    except OSError:
        return 0.0


@dataclass
class WarmUse:
    """This command's use of the warm cluster: `state` as recorded, the in-use lock held (shared)
    until `release`."""

    state: dict[str, Any]
    lock: IO[bytes]
    reused: bool

    def release(self) -> None:
        """The command leaves the cluster: its idle time starts now; says so, with how to stop
        it."""
        if self.lock.closed:
            return
        touch(self.lock_dir)
        fcntl.flock(self.lock, fcntl.LOCK_UN)
        self.lock.close()
        print(f"Ray cluster kept warm for {self.state['keep_warm_minutes']:g} "
              f"min at {self.state['address']} for the next run; "
              "`orchestrator cluster stop` ends it now", flush=True)

    @property
    def lock_dir(self) -> Path:
        return Path(self.lock.name).parent


def take(minutes: float, num_cpus: int, needed_cpus: int, wanted: dict[str, Any]) -> WarmUse | None:
    """The warm cluster for this command: the recorded one when it matches, else a fresh one (the
    recorded one stopped first, saying why); held until `WarmUse.release`. None when the recorded
    one does not match but another command is using it: this command then starts a private cluster
    of its own."""
    directory = warm_dir()
    with open(directory / STARTING, "a+b", opener=owner_only) as starting:
        fcntl.flock(starting, fcntl.LOCK_EX)  # one command at a time finds or starts it
        # held until release
        lock = open(directory / IN_USE, "a+b", opener=owner_only)  # noqa: SIM115
        try:
            state = read_state(directory)
            reason = mismatch(state, wanted, needed_cpus) if state else None
            if state is not None and reason is None:
                touch(directory)  # a keeper about to stop it sees it used
                fcntl.flock(lock, fcntl.LOCK_SH)  # waits while a keeper stops it
                if (read_state(directory) == state
                        and alive(state["head_pid"], state["head_created"])):
                    # the latest command's idle time holds
                    if state["keep_warm_minutes"] != minutes:
                        state["keep_warm_minutes"] = minutes
                        write_state(directory, state)
                    print(f"joined the warm Ray cluster at {state['address']} (started "
                          f"{(time.time() - state['started_at']) / 60:.1f} min ago)", flush=True)
                    return WarmUse(state, lock, reused=True)
                fcntl.flock(lock, fcntl.LOCK_UN)
                state, reason = read_state(directory), "was stopped while idle"
            try:
                # no other command uses the recorded one
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"the warm Ray cluster at {state['address'] if state else '?'} {reason}, "
                      "and another command is using it: this command starts its own cluster",
                      flush=True)
                lock.close()
                return None
            if state is not None:
                stop_cluster(state, directory)
                print(f"the warm Ray cluster at {state['address']} "
                      f"{reason}: stopped it; starting a fresh one",
                      flush=True)
            state = start(directory, minutes, num_cpus, wanted)
            # from exclusive: the start lock keeps other commands out meanwhile
            fcntl.flock(lock, fcntl.LOCK_SH)
            return WarmUse(state, lock, reused=False)
        except BaseException:
            lock.close()
            raise


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports, all bound until all are picked (Ray refuses a head
    whose ports repeat)."""
    with contextlib.ExitStack() as bound:
        sockets = [bound.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


def _ray_temp_dir(directory: Path) -> Path:
    """Where Ray keeps the cluster's sessions and logs: under the cache directory, fresh for each
    cluster, when its path is short enough for Ray's Unix sockets; else in a private new directory
    under the system's temp dir. Inside a directory of this user's alone either way: `ray start`
    makes its temp dir (and every directory in it) 0777."""
    under = directory / "ray"
    if len(str(under)) <= MAX_TEMP_DIR:
        shutil.rmtree(under, ignore_errors=True)  # the logs of the clusters stopped before this one
        under.mkdir(mode=0o700)
        return under
    return Path(tempfile.mkdtemp(prefix=PRIVATE_TEMP)) / "ray"  # mkdtemp: 0700


def start(directory: Path, minutes: float, num_cpus: int, wanted: dict[str, Any]) -> dict[str, Any]:
    """`ray start --head --block` in its own session (a Ctrl+C in the terminal does not reach it),
    sized and set up as `cluster.connect_ray`'s private cluster (dashboard on localhost, its state
    API in RAY_API_SERVER_ADDRESS for every Ray process), and its keeper; recorded in the state
    file. Stopped again if anything fails. Its node IP is loopback: Ray then binds every server
    (GCS, raylet, workers, agents, dashboard) there, none on all interfaces."""
    temp_dir, (gcs, dashboard, client, agent, metrics) = _ray_temp_dir(directory), free_ports(5)
    # Ray's local-only mode (its default on macOS and Windows), for every process of the cluster:
    # `ray start` on Linux otherwise replaces a loopback node IP with the machine's, and its servers
    # listen on every interface. A driver joins in that mode too (cluster.local_only).
    env = dict(os.environ, RAY_API_SERVER_ADDRESS=f"http://127.0.0.1:{dashboard}",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    if own_ray_data_config() and (config := ray_data_config(directory)) is not None:
        # this run's file goes with the run: the cluster's workers get a copy
        env[RAY_DATA_CONFIG] = str(config)
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
               "--port", str(gcs), "--node-ip-address", LISTENS, "--num-cpus", str(num_cpus),
               "--include-dashboard", "true",
               "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
               "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent),
               "--metrics-export-port", str(metrics),
               "--min-worker-port", "0", "--max-worker-port", "0",
               "--temp-dir", str(temp_dir), "--disable-usage-stats"]
    with open(directory / HEAD_LOG, "wb", opener=owner_only) as log:
        head = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    state: dict[str, Any] = {"address": f"127.0.0.1:{gcs}",
                             "dashboard": env["RAY_API_SERVER_ADDRESS"],
                             "head_pid": head.pid,
                             "head_created": psutil.Process(head.pid).create_time(),
                             "temp_dir": str(temp_dir), "num_cpus": num_cpus,
                             "keep_warm_minutes": minutes, "started_at": time.time(),
                             "fingerprint": wanted}
    try:
        deadline = time.time() + HEAD_READY_S
        while not answers(state["address"]):
            if head.poll() is not None or time.time() > deadline:
                tail = (directory / HEAD_LOG).read_text(errors="replace")[-2000:]
                raise RuntimeError("the warm Ray cluster's head did not start "
                                   f"(log {directory / HEAD_LOG}):\n{tail}")
            time.sleep(0.1)
        with open(directory / KEEPER_LOG, "ab", opener=owner_only) as log:
            keep = [sys.executable, "-m", "orchestrator.cluster.warm", "keep", str(head.pid)]
            keeper = subprocess.Popen(keep, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        state |= {"keeper_pid": keeper.pid,
                  "keeper_created": psutil.Process(keeper.pid).create_time()}
        write_state(directory, state)
    except BaseException:
        stop_cluster(state, directory)
        raise
    return state


def _processes(state: dict[str, Any]) -> list[psutil.Process]:
    """Every process of the cluster: the head's tree, and any of its processes that lost their
    parent (each names the cluster's own temp dir on its command line), and its keeper."""
    found: dict[int, psutil.Process] = {}
    if alive(state["head_pid"], state["head_created"]):
        head = psutil.Process(state["head_pid"])
        found |= {p.pid: p for p in [head, *head.children(recursive=True)]}
    temp_dir = state["temp_dir"]
    for process in psutil.process_iter(["cmdline", "uids"]):
        try:
            line = process.info["cmdline"] or []
            ray_program = any("/ray/" in a or os.path.basename(a) in ("gcs_server", "raylet")
                              for a in line[:2])
            if (process.info["uids"].real == os.getuid() and ray_program
                    and any(a.endswith(temp_dir) or temp_dir + os.sep in a for a in line)):
                found.setdefault(process.pid, process)
        except (psutil.Error, AttributeError, TypeError):
            continue
    if state.get("keeper_pid") and alive(state["keeper_pid"], state["keeper_created"]):
        found.setdefault(state["keeper_pid"], psutil.Process(state["keeper_pid"]))
    found.pop(os.getpid(), None)  # the keeper stopping its own cluster
    return list(found.values())


def stop_cluster(state: dict[str, Any], directory: Path) -> None:
    """SIGKILL every process of the cluster by PID (never `ray stop`: other Ray instances may run
    here) and forget it; the logs stay in its temp dir under the cache directory until the next
    cluster starts."""
    processes = _processes(state)
    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            pass
    deadline = time.time() + 10
    while any(_running(p) for p in processes) and time.time() < deadline:
        time.sleep(0.05)
    if (read_state(directory) == state
            or (read_state(directory) or {}).get("head_pid") == state["head_pid"]):
        (directory / STATE).unlink(missing_ok=True)
    if not state["temp_dir"].startswith(str(directory)):  # with the private directory it lies in
        temp_dir = Path(state["temp_dir"])
        shutil.rmtree(temp_dir.parent if temp_dir.parent.name.startswith(PRIVATE_TEMP)
                      else temp_dir, ignore_errors=True)


def _running(process: psutil.Process) -> bool:
    """Not yet exited: a killed process stays a zombie until its parent (maybe not us) reaps it."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_now() -> str:
    """`orchestrator cluster stop`: the recorded cluster stopped now, even under a run (that run
    then fails)."""
    directory = warm_dir()
    state = read_state(directory)
    if state is None:
        return "no warm Ray cluster is running"
    busy = _in_use(directory)
    stop_cluster(state, directory)
    return (f"stopped the warm Ray cluster at {state['address']} (head pid {state['head_pid']})"
            + ("; a command was using it" if busy else ""))


def _in_use(directory: Path) -> bool:
    with open(directory / IN_USE, "a+b", opener=owner_only) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
        return False


def status() -> str:
    """`orchestrator cluster status`: the recorded cluster, whether it answers, and when it
    stops."""
    directory = warm_dir()
    state = read_state(directory)
    if state is None:
        return ("no warm Ray cluster is running (cluster.keep_warm_minutes "
                "> 0 keeps the one a command starts, for the next command)")
    fp = state["fingerprint"]
    up = alive(state["head_pid"], state["head_created"]) and answers(state["address"])
    idle = idle_s(directory)
    when = ("in use by a command now" if _in_use(directory) else
            f"idle {idle / 60:.1f} min; stops after {state['keep_warm_minutes']:g} min idle")
    rss = 0
    for process in _processes(state):
        try:
            rss += process.memory_info().rss
        except psutil.Error:
            pass
    return "\n".join([
        f"warm Ray cluster at {state['address']}: {'running' if up else 'NOT ANSWERING'}, "
        f"{state['num_cpus']} CPUs, {rss / 2**30:.1f} GiB of memory in its processes, "
        f"started {(time.time() - state['started_at']) / 60:.1f} min ago; {when}",
        f"  head pid {state['head_pid']}, keeper pid "
        f"{state.get('keeper_pid')}; dashboard {state['dashboard']}",
        f"  serves: Ray {fp['ray']}, {fp['python']}, working "
        f"directory {fp['cwd']}, PYTHONPATH {fp['pythonpath']}",
        f"  logs: {state['temp_dir']}/session_latest/logs (head: {directory / HEAD_LOG})",
        "  `orchestrator cluster stop` ends it now"])


def keep(head_pid: int) -> None:
    """The keeper's loop: stop the head's cluster once no command has used it for its idle time (and
    none holds it), or once the state file names another cluster; end when the head is gone."""
    directory, began = warm_dir(), time.time()
    created = psutil.Process(head_pid).create_time()
    while True:
        time.sleep(KEEPER_POLL_S)
        state = read_state(directory)
        ours = state is not None and state["head_pid"] == head_pid
        if not alive(head_pid, created):
            if ours:
                stop_cluster(state, directory)  # what is left of it
            return
        if not ours:
            if time.time() - began > UNRECORDED_S:  # never recorded, or replaced: never left behind
                stop_cluster({"head_pid": head_pid, "head_created": created,
                              "temp_dir": _head_temp_dir(head_pid)}, directory)
                return
            continue
        assert state is not None
        if idle_s(directory) < state["keep_warm_minutes"] * 60:
            continue
        with open(directory / IN_USE, "a+b", opener=owner_only) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a command runs on it: its end touches the state again
            if idle_s(directory) >= state["keep_warm_minutes"] * 60:
                print(f"{time.ctime()}: idle {idle_s(directory):.0f} "
                      f"s: stopping the cluster at {state['address']}",
                      flush=True)
                stop_cluster(state, directory)
                return


def _head_temp_dir(head_pid: int) -> str:
    """The --temp-dir of a head's `ray start` command line (to find its processes), or a path no
    process names."""
    try:
        line = psutil.Process(head_pid).cmdline()
        return line[line.index("--temp-dir") + 1]
    except (psutil.Error, ValueError, IndexError):
        return os.path.join(tempfile.gettempdir(), f"orchestrator-warm-none-{head_pid}")


if __name__ == "__main__" and sys.argv[1:2] == ["keep"]:
    keep(int(sys.argv[2]))
