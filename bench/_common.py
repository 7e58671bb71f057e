"""What every bench shares: the overrides that point a run at prepared synthetic shards and a scratch run directory,
with MLflow off (a bench measures training, not tracking), the training workers alive in Ray (to kill one by PID),
a free local port, and a wait for something to be seen."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any


def scratch_run(data: Path | str, runs: Path | str, val: bool = False) -> list[str]:
    """`--set` overrides for a run on `orchestrator prepare synthetic` shards under `data`, writing under `runs`."""
    return [f"data.train={data}/train", f"data.val={data}/val" if val else "data.val=null", "data.features=[features]",
            f"storage.path={runs}", "tracking.enabled=false"]


def train_workers(address: str | None = None) -> list[Any]:
    """Ray Train's worker actors alive now (Ray's state API: each with its pid and node_id), on the cluster at
    `address` (its GCS; needed where another Ray instance runs on this machine too)."""
    from ray.util.state import list_actors

    return [a for a in list_actors(address=address, filters=[("state", "=", "ALIVE")])
            if a.class_name == "RayTrainWorker" and a.pid]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(check: Any, what: str, timeout: float) -> Any:
    """`check()`'s first truthy value, polled every 0.2 s (an exception counts as not yet); TimeoutError after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = check()
        except Exception:  # a node or the state API going away
            found = None
        if found:
            return found
        time.sleep(0.2)
    raise TimeoutError(f"{what} not seen within {timeout:.0f} s")
