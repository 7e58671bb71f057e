"""Samples/s of the orchestrated loop (1 Ray Train worker) vs a bare PyTorch loop, measured side by side.

Same model (MLP 64-512-512-10), same Parquet data, same batch, precision and thread count. The bare loop
reads the whole dataset into tensors first (the best case for it); the orchestrated run streams it through
Ray Data. Throughput is taken from steady-state intervals only: the first report interval (warm-up) and
the start-up/tear-down of fit() are printed separately, not mixed in.

    .venv/bin/python bench/overhead.py [--rows 200000 --steps 600 --batch 256 --threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from _common import scratch_run

from orchestrator import load_config, train
from orchestrator.models import mlp
from orchestrator.training.loop import train_step
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision
from pipelines.batches import collate_arrow
from pipelines.prepare import prepare_synthetic


def bare_loop(data: Path, cfg, steps: int, threads: int, interval: int) -> list[float]:
    """Plain PyTorch: tensors in memory, the same step function, no Ray. Returns samples/s per interval."""
    torch.set_num_threads(threads)
    x, y = collate_arrow(pq.read_table(data / "train"), ["features"], "label")
    torch.manual_seed(0)
    model = mlp(64, 10, hidden=[512, 512])
    optimizer, scheduler = build_optimizer(model, cfg.optim, steps)
    parts = Parts(model, optimizer, scheduler, Precision(cfg.train.precision, torch.device("cpu")),
                  torch.device("cpu"), cfg.optim.max_grad_norm)
    batch, rates, start, position = cfg.train.micro_batch_size, [], time.perf_counter(), 0
    for step in range(1, steps + 1):
        if position + batch > len(y):
            position = 0
        loss = train_step(parts, [(x[position:position + batch], y[position:position + batch])]).loss_sum
        position += batch
        if step % interval == 0:
            float(loss)  # same host sync the orchestrated loop does at a report
            now = time.perf_counter()
            rates.append(interval * batch / (now - start))
            start = now
    return rates[1:]  # drop warm-up, as for the orchestrated run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args()
    interval = max(10, args.steps // 10)

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        prepare_synthetic(str(data), rows=args.rows, shards=8, features=64, classes=10)
        cfg = load_config(None, [
            *scratch_run(data, f"{tmp}/runs"), "data.cache=memory",
            "model.hidden=[512, 512]", "scaling.num_workers=1", f"scaling.cpus_per_worker={args.threads}",
            f"train.global_batch_size={args.batch}", f"train.max_steps={args.steps}",
            f"train.precision={args.precision}", f"train.log_every={interval}", f"checkpoint.every={args.steps}",
        ])
        # Bare runs before and after the orchestrated one, so drift of a shared machine hits both sides.
        bare = bare_loop(data, cfg, args.steps, args.threads, interval)
        started = time.perf_counter()
        result = train(cfg, verbose=False)
        wall = time.perf_counter() - started
        bare += bare_loop(data, cfg, args.steps, args.threads, interval)
    orchestrated = [r["samples_per_s"] for r in result.history][1:]
    steady_s = sum(interval * args.batch / r for r in orchestrated) + interval * args.batch / result.history[0][
        "samples_per_s"]
    bare_med, orch_med = statistics.median(bare), statistics.median(orchestrated)
    print(f"model MLP 64-512-512-10, batch {args.batch}, {args.precision}, {args.threads} threads, "
          f"{args.steps} steps, {args.rows:,} rows")
    print(f"bare PyTorch loop      : {bare_med:10,.0f} samples/s (median of {len(bare)} intervals)")
    print(f"orchestrated, 1 worker : {orch_med:10,.0f} samples/s (median of {len(orchestrated)} intervals)")
    print(f"ratio orchestrated/bare: {orch_med / bare_med:.3f}   (target >= 0.95)")
    print(f"data wait share (orchestrated): {statistics.median(r['data_wait_frac'] for r in result.history):.1%}")
    print(f"fit() wall {wall:.1f} s, of which training steps {steady_s:.1f} s: "
          f"start-up/tear-down/reports {wall - steady_s:.1f} s")


if __name__ == "__main__":
    main()
