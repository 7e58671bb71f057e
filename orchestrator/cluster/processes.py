"""The processes of the local cluster this command started (cluster/local.py), ended together at the
run's end, so that none of them outlives the command: by their ids, which Ray's node object keeps,
and the processes below them."""

from __future__ import annotations

import contextlib
import time
from typing import Any

# How long the processes of a private cluster get after SIGTERM before SIGKILL, and after SIGKILL to
# be gone. The run is over by then (fit() returned: its checkpoints are in storage, its reports
# taken); nothing of it needs them.
PROCESS_EXIT_WAIT_S = 0.3
PROCESS_KILL_WAIT_S = 2.0


def started_processes() -> list[Any]:
    """The processes of the cluster this process started (none for one it joined or a warm one):
    Ray's own (raylet, GCS, dashboard...) and everything they started (the workers, Ray Train's
    controller, the agents)."""
    import psutil

    from orchestrator.ray_internals import started_process_ids

    found: dict[int, Any] = {}
    for pid in started_process_ids():
        try:
            process = psutil.Process(pid)
            for one in [process, *process.children(recursive=True)]:
                found.setdefault(one.pid, one)
        except psutil.Error:  # already gone
            continue
    return list(found.values())


def end_processes(processes: list[Any]) -> None:
    """Every one of `processes` ended before the command's prompt, together: SIGTERM to all, SIGKILL
    to those left after PROCESS_EXIT_WAIT_S (some of Ray's ignore SIGTERM once their driver left).
    Measured on 2 cores: 0.05-0.15 s for the 21 processes of a private cluster, against 1.3-1.6 s of
    Ray's one-by-one stop plus 1.4 s of its workers exiting after it. Only the processes this
    command's cluster started, by their ids (psutil checks each is still the process it was, not a
    reused id); polled, as psutil's wait for a process that is not a child polls slowly."""
    import psutil

    for signal_them, wait_s in (("terminate", PROCESS_EXIT_WAIT_S), ("kill", PROCESS_KILL_WAIT_S)):
        alive = [p for p in processes if running(p)]
        for process in alive:
            with contextlib.suppress(psutil.Error):
                getattr(process, signal_them)()
        deadline = time.monotonic() + wait_s
        while alive and time.monotonic() < deadline:
            time.sleep(0.01)
            alive = [p for p in alive if running(p)]
        if not alive:
            break
    # this process's own children (Ray's raylet, GCS...) reaped: no zombie left
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.wait(timeout=0)


def running(process: Any) -> bool:
    """Alive, and not a zombie waiting for its parent."""
    import psutil

    try:
        return bool(process.is_running() and process.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False
