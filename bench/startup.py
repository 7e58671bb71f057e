"""Where the seconds before the first step go, next to Ray's own floor, measured side by side in one run.

1. `orchestrator train` of the digits example (30 steps, the product's defaults) as a user types it: the command
   starts its own local cluster (target: first step <= 10 s after the command);
2. `ray.init` of a local cluster, started as the product starts one;
3. Ray Train's floor: `fit()` of an empty function on 2 workers until the function runs (no data, no model;
   median of 3, after one warm-up fit);
4. the same training on that running cluster (as with `--address`): its start-up breakdown (target <= 5 s).

The gap between 2 and the product's "worker group" stage is what the product adds to starting the group; the
other stages are its own (data inspection, MLflow, datasets, worker set-up, first batch).

    .venv/bin/python bench/startup.py
"""

from __future__ import annotations

import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from orchestrator import load_config, train
from orchestrator.cluster import connect_ray, shutdown_local_ray, train_environment
from pipelines.prepare import prepare_digits


def _empty(config: dict) -> float:
    return time.time()


def train_floor(config) -> float:  # type: ignore[no-untyped-def]
    """Seconds from fit() to an empty function running on 2 workers, with the product's Ray Train settings."""
    import ray.train
    from ray.train.torch import TorchTrainer

    with tempfile.TemporaryDirectory() as runs, train_environment(config, private_cluster=True):
        started = time.time()
        result = TorchTrainer(_empty, scaling_config=ray.train.ScalingConfig(num_workers=2),
                              run_config=ray.train.RunConfig(storage_path=runs, name="floor")).fit()
        return float(result.return_value) - started


ROOT = Path(__file__).resolve().parents[1]


def command_startup(overrides: list[str]) -> tuple[float, str]:
    """`orchestrator train` in its own process, starting its own local cluster: the product's own start-up figure
    (process start to the first step) and its breakdown line."""
    command = [str(ROOT / ".venv" / "bin" / "orchestrator"), "train", "--config", "examples/digits.yaml",
               *(arg for setting in overrides for arg in ("--set", setting))]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("start-up ")), "")
    found = re.match(r"start-up ([\d.]+) s", line)
    if done.returncode != 0 or not found:
        raise SystemExit(f"orchestrator train failed or printed no start-up line:\n{done.stdout}\n{done.stderr}")
    return float(found.group(1)), line


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        prepare_digits(f"{tmp}/digits")
        overrides = [f"data.train={tmp}/digits/train", f"data.val={tmp}/digits/val", f"storage.path={tmp}/runs",
                     f"tracking.uri=sqlite:///{tmp}/mlflow.db", "train.max_steps=30"]
        own_cluster, own_line = command_startup(overrides)
        config = load_config("examples/digits.yaml", overrides)
        started = time.time()
        connect_ray(None, config)
        ray_start = time.time() - started
        try:
            train_floor(config)  # warm-up: the first fit also starts Ray's worker processes
            floor = statistics.median(train_floor(config) for _ in range(3))
            result = train(config, verbose=False)
        finally:
            shutdown_local_ray()
    stages = result.startup
    print(f"command with its own local cluster    : {own_cluster:5.1f} s to the first step (target <= 10 s)")
    print(f"  {own_line}")
    print(f"ray.init of a local cluster           : {ray_start:5.1f} s")
    print(f"Ray Train floor, fit() -> function    : {floor:5.1f} s (empty function, 2 workers, median of 3)")
    print(f"product on the running cluster        : {sum(stages.values()):5.1f} s to the first step (target <= 5 s)")
    for stage, seconds in stages.items():
        print(f"  {stage:<36}: {seconds:5.1f} s")
    for stage, seconds in result.startup_alongside.items():  # ran at once with one of the parts above
        print(f"  {stage + ' (alongside)':<36}: {seconds:5.1f} s")
    print(f"product's worker group / Ray's floor  : {stages.get('worker group', 0.0) / floor:5.2f}")


if __name__ == "__main__":
    main()
