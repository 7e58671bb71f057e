"""What reliability costs and buys, measured in one run on a local Ray cluster (2 DDP workers, MLP 64-1024-1024-10
with AdamW: a ~13 MB checkpoint):

1. throughput with a checkpoint every N steps / throughput with none (only the final one), for asynchronous
   upload (checkpoint.upload=async, the default) and synchronous upload;
2. seconds from SIGKILL of a training worker (by PID, from Ray's state API) to the first training step after the
   group restarted from its last checkpoint.

Throughput is wall-clock between reports as the driver receives them (so the checkpoint write and its upload
count), first interval dropped as warm-up. It runs with the product's defaults and sets no Ray variable.

    .venv/bin/python bench/recovery.py [--steps 400 --every 25 --rows 50000]
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import scratch_run, train_workers  # noqa: E402

from orchestrator import load_config, train  # noqa: E402
from orchestrator.run.result import TrainResult  # noqa: E402
from pipelines.prepare import prepare_synthetic  # noqa: E402


def config(data: Path, runs: Path, steps: int, every: int, upload: str, log_every: int) -> Any:
    return load_config(None, [
        *scratch_run(data, runs), "scaling.num_workers=2", "train.global_batch_size=256", "train.precision=fp32",
        "model.hidden=[1024, 1024]", f"train.max_steps={steps}", f"train.log_every={log_every}",
        f"checkpoint.every={every}", f"checkpoint.upload={upload}", "checkpoint.keep=2", "failure.max_failures=2",
    ])


def throughput(result: TrainResult) -> float:
    """Samples/s between the second and the last report, by the driver's clock."""
    history = result.history[1:]
    first, last = history[0], history[-1]
    return (last["step"] - first["step"]) * 256 / (last["elapsed_s"] - first["elapsed_s"])


def recovery(data: Path, runs: Path, steps: int, every: int) -> tuple[float, int]:
    """Kill a worker after the second checkpoint: seconds from the kill to the first step after resume, and the
    step resumed from."""
    cfg = config(data, runs, steps, every, "async", log_every=5)
    outcome: dict[str, Any] = {}
    started = time.monotonic()
    thread = threading.Thread(target=lambda: outcome.update(result=train(cfg, verbose=False)))
    thread.start()
    while len(list(runs.glob("*/checkpoint_*"))) < 2:
        time.sleep(0.05)
    workers = train_workers()
    killed_at = time.monotonic() - started
    os.kill(workers[-1].pid, signal.SIGKILL)
    thread.join()
    history = outcome["result"].history
    before = [r for r in history if r["elapsed_s"] < killed_at]
    after = [r for r in history if r["elapsed_s"] >= killed_at and "world_rank" in r][0]  # first report of restart
    resumed_from = max(r["step"] for r in before if r.get("checkpoint_path"))
    steady = throughput(outcome["result"]) / 256  # steps per second
    # The first report after the restart comes (step - resumed_from) steps after the first step.
    first_step = after["elapsed_s"] - (after["step"] - resumed_from - 1) / steady
    return first_step - killed_at, resumed_from


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=25, help="checkpoint interval (steps); reports as often")
    args = parser.parse_args()
    import ray

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp, "data")
        prepare_synthetic(str(data), rows=args.rows, shards=8, features=64, classes=10)
        ray.init(address="local", num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1",
                 logging_config=ray.LoggingConfig(log_level="WARNING"))
        try:
            rates: dict[str, float] = {}
            for name, every, upload in [("none", args.steps, "async"), ("async", args.every, "async"),
                                        ("sync", args.every, "sync"), ("none2", args.steps, "async")]:
                result = train(config(data, Path(tmp, name), args.steps, every, upload, args.every), verbose=False)
                rates[name] = throughput(result)
                print(f"checkpoints {'every ' + str(every) if every < args.steps else 'at the end only':>16} "
                      f"({upload:5} upload): {rates[name]:8,.0f} samples/s", flush=True)
            baseline = (rates["none"] + rates["none2"]) / 2  # before and after: drift on a shared machine
            print(f"ratio with a checkpoint every {args.every} steps, async upload: {rates['async'] / baseline:.3f} "
                  f"(target >= 0.95)")
            print(f"ratio with a checkpoint every {args.every} steps, sync upload:  {rates['sync'] / baseline:.3f}")
            seconds, resumed_from = recovery(data, Path(tmp, "kill"), args.steps, args.every)
            print(f"worker SIGKILL -> first step after resume: {seconds:.1f} s (resumed from the checkpoint of step "
                  f"{resumed_from})")
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
