"""Bytes all-reduced per sample and samples/s: DDP vs local SGD, two 2-worker runs on the same synthetic data.

The bytes come from the loop's own counter (`comm_bytes`: every gradient, parameter and normaliser all-reduce
it made, sized from the tensors), not from an estimate; samples/s is the median over reports after the first.

    .venv/bin/python bench/sync.py [--sync-every 8 --steps 400 --hidden 512]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from _common import scratch_run

from orchestrator import load_config, train


def measure(data: str, runs: str, sync: list[str], steps: int, hidden: int) -> dict[str, float]:
    cfg = load_config(None, [
        *scratch_run(data, runs, val=True), "data.cache=memory",
        f"model.hidden=[{hidden}, {hidden}]", "scaling.num_workers=2", "train.global_batch_size=256",
        f"train.max_steps={steps}", f"train.log_every={steps // 8}", f"train.eval_every={steps}",
        f"checkpoint.every={steps}", "train.precision=fp32",
        *sync,
    ])
    history = train(cfg, verbose=False).history
    last = history[-1]
    return {"samples_per_s": statistics.median(r["samples_per_s"] for r in history[1:]),
            "bytes_per_sample": last["comm_bytes"] / last["samples_seen"],
            "val_accuracy": last["val_accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    from pipelines.prepare import prepare_synthetic

    with tempfile.TemporaryDirectory() as tmp:
        prepare_synthetic(f"{tmp}/data", rows=50_000, shards=8, val_rows=5_000)
        ddp = measure(f"{tmp}/data", f"{tmp}/runs", [], args.steps, args.hidden)
        local = measure(f"{tmp}/data", f"{tmp}/runs", ["train.sync=local_sgd", f"train.sync_every={args.sync_every}"],
                        args.steps, args.hidden)
    print(f"MLP 64-{args.hidden}-{args.hidden}-10, fp32, 2 workers, global batch 256, {args.steps} steps")
    print(f"{'sync':<22}{'bytes/sample':>14}{'samples/s':>12}{'val acc':>10}")
    for name, row in (("ddp", ddp), (f"local_sgd H={args.sync_every}", local)):
        print(f"{name:<22}{row['bytes_per_sample']:>14,.0f}{row['samples_per_s']:>12,.0f}{row['val_accuracy']:>10.3f}")
    print(f"local_sgd / ddp: bytes {local['bytes_per_sample'] / ddp['bytes_per_sample']:.3f}x, "
          f"samples/s {local['samples_per_s'] / ddp['samples_per_s']:.2f}x")


if __name__ == "__main__":
    main()
