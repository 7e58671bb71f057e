"""What every bench shares: the overrides that point a run at prepared synthetic shards and a scratch run directory,
with MLflow off (a bench measures training, not tracking)."""

from __future__ import annotations

from pathlib import Path


def scratch_run(data: Path | str, runs: Path | str, val: bool = False) -> list[str]:
    """`--set` overrides for a run on `orchestrator prepare synthetic` shards under `data`, writing under `runs`."""
    return [f"data.train={data}/train", f"data.val={data}/val" if val else "data.val=null", "data.features=[features]",
            f"storage.path={runs}", "tracking.enabled=false"]
