"""The Ray cluster a driver runs on: join the one given (or $RAY_ADDRESS), or start a private local
one sized for the run (or, with cluster.keep_warm_minutes, join the warm one a previous command
left: cluster/warm.py), and stop only what was started here. A local one is its user's alone on a
shared machine: every port on loopback, Ray's token and temp dir out of other users' reach."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from orchestrator.cluster.fingerprint import LISTENS, fingerprint
from orchestrator.cluster.processes import end_processes, running, started_processes
from orchestrator.cluster.warm import WarmUse, answers, stop_cluster, take, warm_dir
from orchestrator.config import Config, TrackingConfig
from orchestrator.errors import ConfigError, UserError
from orchestrator.ray_internals import (
    ensure_token,
    local_only,
    shutdown_leaving_processes,
    system_temp_dir,
    token_auth_by_default,
)
from orchestrator.tracking.uri import is_loopback, sqlite_file
from orchestrator.training.channel import ReportChannel
from pipelines.storage import private_dir, user_cache_dir

# The warm cluster this process is joined to (cluster.keep_warm_minutes), held until
# shutdown_local_ray.
_warm: WarmUse | None = None


@dataclass(frozen=True)
class ClusterChoice:
    """The Ray cluster a run gets, decided with its plan: `join` the one at `address` (--address or
    $RAY_ADDRESS), else a local one of this command's: the `warm` one kept between commands
    (cluster.keep_warm_minutes; a private one when it cannot be had) or a `private` one. A local one
    has this machine's CPUs, at least `needed`: the workers' (`workers_cpus`) and two for Ray Data's
    read tasks."""

    kind: Literal["join", "warm", "private"]
    address: str | None
    workers_cpus: int
    needed: int
    keep_warm_minutes: float

    def describe(self) -> dict[str, Any]:
        if self.kind == "join":
            return {"join": self.address}
        return {"local": self.kind, "cpus": max(os.cpu_count() or 1, self.needed),
                "keep_warm_minutes": self.keep_warm_minutes or None}


def choose_cluster(address: str | None, config: Config) -> ClusterChoice:
    """connect_ray's choice, without Ray: `address`, else $RAY_ADDRESS, else a local cluster (warm
    or private)."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    # Ray Data's read tasks need CPUs beside the workers', or ingest waits forever on a small
    # machine.
    workers_cpus = math.ceil(config.scaling.max_workers * config.scaling.cpus_per_worker)
    minutes = config.cluster.keep_warm_minutes
    kind = "join" if address else "warm" if minutes > 0 else "private"
    return ClusterChoice(kind, address, workers_cpus, workers_cpus + 2, minutes)


def connect_ray(address: str | None, config: Config) -> bool:
    """Join `address` / $RAY_ADDRESS if given, else start a private local cluster, or with
    cluster.keep_warm_minutes join the warm one (started here when none matches): choose_cluster's
    choice, carried out by connect_cluster. True for a local cluster of this command's own (private
    or warm: it cannot grow, and `shutdown_local_ray` leaves it)."""
    return connect_cluster(choose_cluster(address, config))


def connect_cluster(choice: ClusterChoice) -> bool:
    """Carry out `choice` (a run's plan holds it: run/plan.py): join its cluster, or start or join
    the local one. True for a local cluster of this command's own (private or warm)."""
    import ray

    if ray.is_initialized():
        return False
    # Ray's own INFO lines (per-report, per-epoch) would bury the progress lines; warnings still
    # show.
    logging_config = ray.LoggingConfig(log_level="WARNING")
    if choice.address:
        join_cluster(choice.address, logging_config)
        return False
    workers_cpus, needed = choice.workers_cpus, choice.needed
    if workers_cpus > (os.cpu_count() or 1):
        print(f"warning: the workers ask for {workers_cpus} CPUs "
              "(scaling.num_workers x scaling.cpus_per_worker) but this machine has "
              f"{os.cpu_count()}: they will share cores and each run slower; lower "
              "scaling.num_workers or scaling.cpus_per_worker", file=sys.stderr)
    # Local workers inherit this environment: make the user's own modules (model entrypoints)
    # importable.
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    # once, however many runs
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([os.getcwd(), *paths]))
    num_cpus = max(os.cpu_count() or 1, needed)
    if (choice.kind == "warm"
            and _join_warm(choice.keep_warm_minutes, num_cpus, needed, logging_config)):
        return True
    start_private(num_cpus, logging_config)
    return True


def start_private(num_cpus: int, logging_config: Any) -> None:
    """This command's own local cluster, as private as the warm one (warm_cluster.start): its node
    IP loopback, so that Ray binds every server there (by default the GCS, raylet and workers listen
    on every interface, the dashboard agent on 0.0.0.0), Ray's token this user's alone, and its temp
    dir out of other users' reach. The dashboard serves the state API that Ray Train's controller
    polls (pin_state_api)."""

    own_token()
    with local_only():
        init_local(num_cpus=num_cpus, dashboard_host=LISTENS, _node_ip_address=LISTENS,
                   _temp_dir=private_temp_dir(), logging_config=logging_config)


def init_local(tries: int = 3, **options: Any) -> None:
    """`ray.init(address="local", ...)` with the dashboard on a port of pin_state_api's. Between
    picking a free port and the dashboard binding it, another process may take it (a second Ray
    starting on the machine opens dozens of ports): Ray then fails at once ("Failed to find a valid
    port for dashboard after 0 retries"); so it is tried again on another free port, after the
    half-started cluster is shut down."""
    import ray

    for attempt in range(1, tries + 1):
        try:
            ray.init(address="local", include_dashboard=True, dashboard_port=pin_state_api(),
                     **options)
            return
        except Exception as exc:
            if "valid port for dashboard" not in str(exc) or attempt == tries:
                raise
            ray.shutdown()


def private_temp_dir() -> str:
    """Ray's temp dir for this user's per-command clusters: `ray` in a directory of this user's
    alone (0700) in the system's temp dir as Ray picks it (RAY_TMPDIR, TMPDIR on Linux, else /tmp:
    short enough for its Unix sockets), kept between commands as Ray's default <tmp>/ray is (each
    session's logs). Ray makes its temp dir and every directory in it 0777 (sockets, logs, runtime
    envs): behind the 0700 one, no other user reaches them."""
    mine = os.path.join(system_temp_dir(), f"orchestrator-{os.getuid()}")
    private = private_dir(mine, instead="set RAY_TMPDIR to a directory of your own")
    return os.path.join(private, "ray")


def join_cluster(address: str, logging_config: Any) -> None:
    """ray.init on the cluster at `address` (--address or RAY_ADDRESS). A host:port where nothing
    listens is named at once (Ray itself retries for minutes), and a refused join says what usually
    refuses it (join_refused)."""
    import ray
    from ray.exceptions import AuthenticationError

    if re.fullmatch(r"[\w.-]+:\d+", address) and not answers(address):
        raise UserError(f"no Ray cluster answers at {address} (--address or "
                        "RAY_ADDRESS): start it (`ray start --head`) or give "
                        "the address `ray status` shows on its head node")
    try:
        ray.init(address=address, logging_config=logging_config)
    except (ConnectionError, AuthenticationError) as exc:
        raise UserError(join_refused(address, exc, os.environ)) from None
    if (warning := open_cluster(ray.get_runtime_context().gcs_address, os.environ)) is not None:
        print(warning, file=sys.stderr, flush=True)


def join_refused(address: str, exc: BaseException, environ: Mapping[str, str]) -> str:
    """The one line for a join Ray refused. A cluster with token auth refuses a process without its
    token: Ray raises at once where RAY_AUTH_MODE=token here finds no token, and after about 20 s of
    retries where the mode is unset or `disabled` (the cause, deep in its chain of exceptions, is an
    `InvalidAuthToken` from the GCS); the line then names the fix instead of that chain."""
    chain: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    if any(type(e).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(e)
           for e in chain):
        mode = "" if environ.get("RAY_AUTH_MODE") == "token" else "export RAY_AUTH_MODE=token and "
        return (f"could not join the Ray cluster at {address}: it runs with token "
                "auth and refused this command's token (none found, or another): "
                f"{mode}set RAY_AUTH_TOKEN to the cluster's token, or put it in the "
                "file ~/.ray/auth_token (or the file RAY_AUTH_TOKEN_PATH names); "
                "`ray get-auth-token` on its head prints it (cluster/README.md)")
    hint = ("; if it runs with token auth (`ray start` turns it on where ~/.ray/auth_token "
            "exists), export RAY_AUTH_MODE=token here too (cluster/README.md)"
            if "RAY_AUTH_MODE" not in environ else "")
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"could not join the Ray cluster at {address}: {first}{hint}"


def open_cluster(gcs_address: str, environ: Mapping[str, str]) -> str | None:
    """One warning line when the cluster this command joined takes work from its network without
    token auth: Ray's security statement is that whoever reaches its GCS, dashboard or Ray Client
    port runs code as its user. Joined without a token (RAY_AUTH_MODE is not `token` here, as it
    must be to join a cluster that asks for one), at an address other than loopback. None for a
    cluster that asks for a token or listens on loopback only."""
    host = gcs_address.rpartition(":")[0] or gcs_address
    if environ.get("RAY_AUTH_MODE") == "token" or is_loopback(host):
        return None
    return (f"warning: the Ray cluster at {gcs_address} runs without token auth: whoever "
            "reaches its ports (GCS, dashboard, Ray Client) runs code as its user; start "
            "it with RAY_AUTH_MODE=token and export that here too (cluster/README.md)")


def _join_warm(minutes: float, num_cpus: int, needed: int, logging_config: Any) -> bool:
    """Join the warm cluster that matches this command (warm_cluster.take starts one if none does);
    False when it cannot be had (another command uses a cluster of another environment): a private
    one is started instead."""
    global _warm
    import ray

    wanted = fingerprint(os.environ["PYTHONPATH"], os.environ.get("RAY_AUTH_MODE", "token"))
    own_token()  # the head started below and this process's join agree on the mode
    use = take(minutes, num_cpus, needed, wanted)
    if use is None:
        return False
    os.environ["RAY_API_SERVER_ADDRESS"] = use.state["dashboard"]  # see pin_state_api
    try:
        with local_only():
            ray.init(address=use.state["address"], logging_config=logging_config)
    except BaseException:
        os.environ.pop("RAY_API_SERVER_ADDRESS", None)
        stop_cluster(use.state, warm_dir())  # a cluster this process cannot join serves none
        use.lock.close()
        raise
    _warm = use
    return True


def own_token() -> None:
    """As Ray's own local cluster (`ray.init()` without an address) does: token auth unless
    RAY_AUTH_MODE says otherwise, a token made if missing; but the token is this user's alone
    (private_token). Set in this process's environment, for the cluster it starts and the join."""
    if "RAY_AUTH_MODE" not in os.environ:
        token_auth_by_default()
    private_token()


def private_token() -> None:
    """With token auth, the token (~/.ray/auth_token) that joins this user's clusters: made when
    missing, as Ray's own local cluster makes it, but this user's alone. Ray writes it with the
    process's umask (0644 on most systems: any local user could read it and join the warm cluster as
    this user); one written so before is made 0600 too."""
    # the file 0600, a missing ~/.ray 0700; process-wide, so for this short call only
    before = os.umask(0o077)
    try:
        token = ensure_token()
    finally:
        os.umask(before)
    if token is not None and token.is_file() and token.stat().st_mode & 0o077:
        token.chmod(0o600)


def job_package() -> str | None:
    """The working directory Ray gave this process as the driver of a Ray job with a runtime-env
    `working_dir` (Ray's extracted copy of the uploaded package); None for any other process."""
    try:
        job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    except ValueError:
        return None
    if not isinstance(job, dict) or not (job.get("runtime_env") or {}).get("working_dir"):
        return None
    try:
        return os.getcwd()
    except FileNotFoundError:  # already removed
        return None


@contextmanager
def outside_job_package(tracking: TrackingConfig) -> Iterator[None]:
    """A Ray job's driver starts in Ray's copy of the uploaded package, and its own `ray.init` has
    every node's runtime-env agent install the job's env: an agent that shares this host's session
    directory (another node on the same machine) deletes that copy and extracts it again
    (`overwrite=True`), so from then on the process has no working directory (`os.getcwd()` raises
    FileNotFoundError, as MLflow's SQLite store does for every client), and a file written there
    before is gone. So for the block the driver works from a directory that outlives `ray.init`: the
    SQLite store's (MLflow's default artifact root `./mlruns` then lies beside the store, as in a
    local run), else this user's cache directory; then back to the package's path. Enter it once the
    config's paths are resolved (the data's, storage's and the store's are); a relative SQLite store
    would be written into the package: refused. Anything else than a Ray job's driver stays where it
    is."""
    package = job_package()
    if package is None:
        yield
        return
    store = sqlite_file(tracking.uri) if tracking.enabled else None
    if store is not None and not os.path.isabs(store):
        raise ConfigError(f"tracking.uri sqlite:///{store} is relative: in a Ray job it would "
                          "be written into the job's working directory, Ray's temporary copy "
                          "of the package, which Ray deletes; set tracking.uri to an "
                          "absolute path (sqlite:////path/mlruns.db) or a tracking server")
    if store is not None and not os.path.isdir(os.path.dirname(store)):
        raise ConfigError(f"tracking.uri sqlite:///{store}: no directory {os.path.dirname(store)} "
                          "on this node; create it, or give a path that exists")
    os.chdir(os.path.dirname(store) if store else user_cache_dir())
    try:
        yield
    finally:
        if os.path.isdir(package):  # extracted again by then, or never removed
            os.chdir(package)


# Ray Train settings for the runs this process fits. Ray passes these variables from the process
# that calls `fit()` to the run's controller and workers, so they hold on a local cluster, under
# `ray job submit` and in a Tune trial alike. A value the user exported wins.
TRAIN_DEFAULTS = {
    # How often the controller polls the workers (Ray's default: 2 s). A checkpoint's report waits
    # for the poll after the previous one, a finished or failed worker group is noticed at a poll,
    # and the group's start is paced by it: at 2 s a short run spends seconds waiting on its
    # controller (see bench/overhead.py).
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",  # otherwise every worker print appears twice
}


@contextmanager
def train_environment(config: Config, private_cluster: bool) -> Iterator[None]:
    """TRAIN_DEFAULTS, and the Ray Train settings the config names, in this process's environment
    while it builds and fits one run; restored afterwards, so the next run in the same process
    starts from the user's own. On a `private_cluster` (the local one `connect_ray` started) no node
    is ever drained: Ray Train's drain watcher, one more actor per worker-group start, is left
    out."""
    wanted = {name: value for name, value in TRAIN_DEFAULTS.items() if name not in os.environ}
    if private_cluster or not config.checkpoint.on_preemption:
        wanted["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
    if config.failure.worker_start_timeout_s is not None:
        timeout_s = config.failure.worker_start_timeout_s
        wanted["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(timeout_s)
    if config.checkpoint.preemption_poll_s is not None:
        wanted["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = str(config.checkpoint.preemption_poll_s)
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def report_channel() -> ReportChannel:
    """The run's report channel, held by this process (the driver, or a Tune trial's actor) on the
    address its Ray node has: the one the run's workers reach it by (a private cluster's is the
    loopback)."""
    import ray

    return ReportChannel(ray.util.get_node_ip_address())


def pin_state_api() -> int:
    """A free dashboard port, exported as RAY_API_SERVER_ADDRESS for the local cluster about to
    start.

    Ray Train's placement-group cleaner looks its cluster up with no address; when another Ray
    instance runs on the same machine that lookup fails, the cleaner dies, and every run whose
    controller is killed (each trial ASHA stops) keeps its CPUs for good. Ray processes inherit this
    environment, so they find this cluster."""
    import socket

    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        # Not a port Ray gives another of its components by default: it refuses to start with one
        # port twice (the dashboard agent's 52365 is in Linux's ephemeral range, and a cluster that
        # just ended has freed it).
        if port not in RAY_DEFAULT_PORTS:
            break
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    return port


# GCS, dashboard, Ray Client, dashboard agent (Ray 2.60's defaults)
RAY_DEFAULT_PORTS = {6379, 8265, 10001, 52365}


def shutdown_local_ray() -> None:
    """Stop the local cluster `connect_ray` started and forget its state-API address, so nothing
    started later in this process (or inherited by its children) looks for a cluster that is gone. A
    warm cluster is left (this driver's job ends, and its actors and CPUs with it), its idle time
    starting now, and the command says so."""
    global _warm
    started = started_processes()
    if not shutdown_leaving_processes():
        # what Ray's own stop left: its workers, still exiting
        started = [p for p in started if running(p)]
    os.environ.pop("RAY_API_SERVER_ADDRESS", None)
    if _warm is not None:
        use, _warm = _warm, None
        use.release()
    end_processes(started)
