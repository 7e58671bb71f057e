"""The orchestrated run (1 Ray Train worker) vs a bare PyTorch loop, each as a command timed from start to exit.

Same model (MLP 64-512-512-10), same Parquet data, batch, precision, thread count and number of steps. The bare
loop is a fresh Python process that reads the whole dataset into tensors (its best case) and runs the same step
function with no Ray. The orchestrated run is `orchestrator train` with the product's defaults (a local Ray
cluster it starts, Ray Data streaming, checkpoints, MLflow in a SQLite file). Two ratios, side by side:

    steady state = orchestrated samples/s / bare samples/s, per report interval on the wall clock (reports,
                   checkpoints and data waits included), medians after the first interval
    end to end   = bare command's wall / orchestrated command's wall, for the same steps (start-up, Ray's
                   teardown and MLflow included)

The bare command runs before and after the orchestrated one, so drift on a shared machine hits both sides.

    .venv/bin/python bench/overhead.py [--rows 200000 --steps 600 --batch 256 --threads 2]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import scratch_run

ROOT = Path(__file__).resolve().parents[1]


def bare_loop(args: argparse.Namespace) -> None:
    """The bare command (run with --bare): prints the samples/s of each interval, as JSON."""
    import pyarrow.parquet as pq
    import torch

    from orchestrator.config import load_config
    from orchestrator.models import mlp
    from orchestrator.training.optim import build_optimizer
    from orchestrator.training.parts import Parts
    from orchestrator.training.precision import Precision, flush_denormals
    from orchestrator.training.step import train_step
    from pipelines.batches import collate_arrow

    cfg = load_config(None, overrides(args, Path(args.bare)))
    flush_denormals(cfg.train.flush_denormal)  # as the product's workers do
    torch.set_num_threads(args.threads)
    x, y = collate_arrow(pq.read_table(Path(args.bare) / "train"), ["features"], "label").values()
    torch.manual_seed(0)
    model = mlp(64, 10, hidden=[512, 512])
    optimizer, scheduler = build_optimizer(model, cfg.optim, args.steps)
    cpu = torch.device("cpu")
    parts = Parts(model, optimizer, scheduler, Precision(args.precision, cpu), cpu, cfg.optim.max_grad_norm)
    batch, interval, rates, start, position = args.batch, args.steps // 10, [], time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        if position + batch > len(y):
            position = 0
        loss = train_step(parts, [{"x": x[position:position + batch], "labels": y[position:position + batch]}]).loss_sum
        position += batch
        if step % interval == 0:
            float(loss)  # the host sync the orchestrated loop does at a report
            now = time.perf_counter()
            rates.append(interval * batch / (now - start))
            start = now
    print(json.dumps(rates))


def overrides(args: argparse.Namespace, data: Path) -> list[str]:
    return [*scratch_run(data, data.parent / "runs"), "data.cache=memory", "model.hidden=[512, 512]",
            "scaling.num_workers=1", f"scaling.cpus_per_worker={args.threads}",
            f"train.global_batch_size={args.batch}", f"train.max_steps={args.steps}",
            f"train.precision={args.precision}", f"train.log_every={args.steps // 10}",
            f"checkpoint.every={args.steps}", "optim.warmup_steps=10"]


def timed(command: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:3])} ... failed:\n{done.stdout}\n{done.stderr}")
    return wall, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--bare", help=argparse.SUPPRESS)  # internal: run the bare loop on this data directory
    args = parser.parse_args()
    if args.bare:
        bare_loop(args)
        return

    from pipelines.prepare import prepare_synthetic

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        prepare_synthetic(str(data), rows=args.rows, shards=8, features=64, classes=10)
        flags = ["--rows", str(args.rows), "--steps", str(args.steps), "--batch", str(args.batch),
                 "--threads", str(args.threads), "--precision", args.precision]
        bare_command = [sys.executable, __file__, "--bare", str(data), *flags]
        # MLflow on, in a SQLite file, as a user's run has it.
        settings = [*overrides(args, data), "tracking.enabled=true", f"tracking.uri=sqlite:///{tmp}/mlflow.db"]
        train_command = [str(ROOT / ".venv" / "bin" / "orchestrator"), "train",
                         *(arg for setting in settings for arg in ("--set", setting))]
        bare_wall, out = timed(bare_command)
        bare = json.loads(out.splitlines()[-1])[1:]
        orch_wall, orch_out = timed(train_command)
        wall, out = timed(bare_command)
        bare += json.loads(out.splitlines()[-1])[1:]
        bare_wall = (bare_wall + wall) / 2
    lines = orch_out.splitlines()
    orchestrated = [float(m.group(1).replace(",", "")) for line in lines if line.startswith("step ")
                    and (m := re.search(r"\| ([\d,]+) samples/s", line))][1:]
    bare_med, orch_med = statistics.median(bare), statistics.median(orchestrated)
    print(f"model MLP 64-512-512-10, batch {args.batch}, {args.precision}, {args.threads} threads, "
          f"{args.steps} steps, {args.rows:,} rows")
    print(f"bare PyTorch loop      : {bare_med:10,.0f} samples/s (median of {len(bare)} intervals), "
          f"command {bare_wall:.1f} s")
    print(f"orchestrated, 1 worker : {orch_med:10,.0f} samples/s (median of {len(orchestrated)} intervals), "
          f"command {orch_wall:.1f} s")
    print(f"steady state, orchestrated/bare samples/s : {orch_med / bare_med:.3f}   (target >= 0.9)")
    print(f"end to end, bare wall / orchestrated wall : {bare_wall / orch_wall:.3f}   (target >= 0.7)")
    for line in lines:
        if line.startswith(("start-up ", "time: ")):
            print(f"orchestrated {line}")


if __name__ == "__main__":
    main()
