"""Samples/s at gradient accumulation 4 vs 1 with the same micro-batch, measured side by side.

Part 1 (one process, the loop's own train_step): the two settings alternate in rounds so drift of a shared
machine hits both equally. Part 2 (--ddp): two 2-worker orchestrated runs on the same synthetic Parquet data,
where accumulation also saves 3 of every 4 gradient all-reduces.

    .venv/bin/python bench/accumulation.py [--micro 256 --rounds 5 --ddp]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from _common import scratch_run

from orchestrator import load_config, train
from orchestrator.models.zoo import mlp
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision
from orchestrator.training.step import train_step


def rate(parts: Parts, micro: int, accum: int, steps: int) -> float:
    g = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(micro, 64, generator=g), "labels": torch.randint(0, 10, (micro,), generator=g)}
               for _ in range(accum)]
    train_step(parts, batches)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        loss = train_step(parts, batches).loss_sum
    float(loss)
    return steps * accum * micro / (time.perf_counter() - start)


def in_process(micro: int, rounds: int, samples: int) -> tuple[list[float], list[float]]:
    cfg = load_config(None, ["scaling.num_workers=1", "train.precision=fp32"])
    torch.manual_seed(0)
    model = mlp(64, 10, hidden=[512, 512])
    optimizer, scheduler = build_optimizer(model, cfg.optim, 10**6)
    parts = Parts(model, optimizer, scheduler, Precision("fp32", torch.device("cpu")), torch.device("cpu"), 1.0)
    one, four = [], []
    for _ in range(rounds):
        one.append(rate(parts, micro, 1, samples // micro))
        four.append(rate(parts, micro, 4, samples // micro // 4))
    return one, four


def ddp(micro: int, steps: int) -> tuple[float, float]:
    from pipelines.prepare import prepare_synthetic

    rates = []
    with tempfile.TemporaryDirectory() as tmp:
        prepare_synthetic(f"{tmp}/data", rows=100_000, shards=8)
        for accum in (1, 4):
            cfg = load_config(None, [
                *scratch_run(f"{tmp}/data", f"{tmp}/runs"), "data.cache=memory",
                "model.hidden=[512, 512]", "scaling.num_workers=2", f"train.micro_batch_size={micro}",
                f"train.grad_accum_steps={accum}", f"train.global_batch_size={micro * accum * 2}",
                f"train.max_steps={steps // accum}", f"train.log_every={max(1, steps // accum // 5)}",
                "train.precision=fp32", f"storage.path={tmp}/runs", "tracking.enabled=false",
            ])
            history = train(cfg, verbose=False).history
            rates.append(statistics.median(r["samples_per_s"] for r in history[1:]))
    return rates[0], rates[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=256 * 200, help="samples per measurement")
    parser.add_argument("--ddp", action="store_true", help="also measure 2-worker DDP runs under Ray")
    parser.add_argument("--ddp-steps", type=int, default=800, help="micro-batches per worker per DDP run")
    args = parser.parse_args()
    torch.set_num_threads(2)
    one, four = in_process(args.micro, args.rounds, args.samples)
    print(f"MLP 64-512-512-10, fp32, micro-batch {args.micro}, {args.rounds} alternating rounds; the DDP runs with "
          "data.cache=memory (not the default: both sides fed alike, so the ratio is the step's)")
    one_rate, four_rate = statistics.median(one), statistics.median(four)
    print(f"one process  accum 1: {one_rate:9,.0f} samples/s   accum 4: {four_rate:9,.0f} samples/s   "
          f"ratio 4/1: {four_rate / one_rate:.3f}   (target >= 0.98)")
    if args.ddp:
        rate1, rate4 = ddp(args.micro, args.ddp_steps)
        print(f"2 DDP workers accum 1: {rate1:9,.0f} samples/s   accum 4: {rate4:9,.0f} samples/s   "
              f"ratio 4/1: {rate4 / rate1:.3f}")


if __name__ == "__main__":
    main()
