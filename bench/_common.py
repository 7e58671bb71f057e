"""What every bench shares: the overrides that point a run at prepared synthetic shards and a scratch run directory,
with MLflow off (a bench measures training, not tracking), and the training workers alive in Ray (to kill one by
PID)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def scratch_run(data: Path | str, runs: Path | str, val: bool = False) -> list[str]:
    """`--set` overrides for a run on `orchestrator prepare synthetic` shards under `data`, writing under `runs`."""
    return [f"data.train={data}/train", f"data.val={data}/val" if val else "data.val=null", "data.features=[features]",
            f"storage.path={runs}", "tracking.enabled=false"]


def train_workers() -> list[Any]:
    """Ray Train's worker actors alive now (Ray's state API: each with its pid and node_id)."""
    from ray.util.state import list_actors

    return [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if a.class_name == "RayTrainWorker" and a.pid]
