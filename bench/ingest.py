"""Data ingest, measured side by side in one run (this machine is shared and noisy: compare ratios, not rates).

1. Ray Data rows/s into torch batches from local Parquet / raw pyarrow read + the same collate, same cores.
2. Data-wait share of step time in a 1-worker training run (from the loop's own `data_wait_frac`).
3. Second-epoch rows/s reading from an S3 endpoint (moto_server started here) with the disk cache / without.
4. Peak memory while streaming a dataset 4x the size of Ray's object store.

    .venv/bin/python bench/ingest.py [--rows 2000000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
from _common import scratch_run

from pipelines.batches import FeatureCollate, collate_arrow
from pipelines.config import DataConfig
from pipelines.datasets import build_datasets, inspect_datasets
from pipelines.prepare import prepare_synthetic

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))


def raw_pyarrow(directory: Path) -> float:
    """Rows/s of a plain pyarrow read of every shard, converted with the same collate as the workers use."""
    started, rows = time.perf_counter(), 0
    for path in sorted(directory.glob("*.parquet")):
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            rows += len(collate_arrow(pa.Table.from_batches([batch]), ["features"], "label")["labels"])
    return rows / (time.perf_counter() - started)


def ray_data_passes(cfg: DataConfig, passes: int) -> list[float]:
    """Rows/s of each full pass through Ray Data into torch batches (each pass re-executes the pipeline)."""
    infos = inspect_datasets(cfg)
    ds = build_datasets(cfg, infos, object_store_bytes=0)["train"]
    collate = FeatureCollate(cfg.features, cfg.label)
    rates = []
    for _ in range(passes):
        started, rows = time.perf_counter(), 0
        for batch in ds.iter_torch_batches(batch_size=4096, collate_fn=collate,
                                           prefetch_batches=cfg.prefetch_batches):
            rows += len(batch["labels"])
        rates.append(rows / (time.perf_counter() - started))
    return rates


def peak_rss_while(fn: Any) -> tuple[float, float]:
    """(peak RSS summed over this process and its descendants, peak of this process alone), in bytes."""
    me, peaks, done = psutil.Process(), [0.0, 0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            total = me.memory_info().rss
            for child in me.children(recursive=True):
                try:
                    total += child.memory_info().rss
                except psutil.Error:
                    pass
            peaks[0], peaks[1] = max(peaks[0], total), max(peaks[1], me.memory_info().rss)
            time.sleep(0.05)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return peaks[0], peaks[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2_000_000)
    args = parser.parse_args()
    import ray
    from ray.data import DataContext

    from orchestrator.config import load_config
    from orchestrator.run.launch import train
    from pipelines.config import S3Config

    tmp = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    prepare_synthetic(str(tmp / "local"), rows=args.rows, shards=16, features=64)
    ray.init(address="local", num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1",
             logging_config=ray.LoggingConfig(log_level="WARNING"))
    context = DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    context.execution_options.preserve_order = True
    local = DataConfig(train=str(tmp / "local" / "train"), val=None, features=["features"], cache="none")

    raw = statistics.median(raw_pyarrow(tmp / "local" / "train") for _ in range(2))
    ray_rates = ray_data_passes(local, passes=3)
    print(f"1. local Parquet -> torch, {args.rows:,} rows x 64 float32, 2 cores")
    print(f"   raw pyarrow + collate : {raw:12,.0f} rows/s")
    print(f"   Ray Data (passes)     : {', '.join(f'{r:,.0f}' for r in ray_rates)} rows/s")
    print(f"   ratio Ray Data / raw  : {statistics.median(ray_rates[1:]) / raw:.2f} warm, "
          f"{ray_rates[0] / raw:.2f} first pass   (target >= 0.6)")

    result = train(load_config(None, [
        *scratch_run(f"{tmp}/local", f"{tmp}/runs"), "data.cache=none",
        "scaling.num_workers=1", "scaling.cpus_per_worker=2", "train.global_batch_size=1024", "train.max_steps=300",
        "train.log_every=50", "checkpoint.every=300", "model.hidden=[512,512]",
    ]), verbose=False)
    waits = [r["data_wait_frac"] for r in result.history[1:]]  # the first interval holds the pipeline start
    print("2. data-wait share of step time, 1 worker (2 CPUs), MLP 64-512-512-10, batch 1024, with data.cache=none "
          "(not the default: every epoch streamed, the worst case for the pipeline)")
    print(f"   per report interval: {', '.join(f'{w:.1%}' for w in waits)}; median {statistics.median(waits):.1%}"
          "   (target <= 5%)")

    from s3_server import MotoServer

    moto = MotoServer(tmp)
    try:
        os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"})
        s3 = S3Config(endpoint=moto.url)
        import boto3

        boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1").create_bucket(Bucket="bench")
        prepare_synthetic("s3://bench/syn", rows=200_000, shards=8, features=64, s3=s3)
        remote = {"train": "s3://bench/syn/train", "val": None, "features": ["features"], "s3": s3.model_dump()}
        cached = ray_data_passes(DataConfig(**remote, cache=str(tmp / "cache")), passes=2)
        uncached = ray_data_passes(DataConfig(**remote, cache="none"), passes=2)
    finally:
        moto.stop()
    print("3. S3 endpoint (moto_server on localhost), 200,000 rows in 8 shards")
    print(f"   epoch 1 / epoch 2 rows/s: cache {cached[0]:,.0f} / {cached[1]:,.0f}; "
          f"no cache {uncached[0]:,.0f} / {uncached[1]:,.0f}")
    print(f"   second-epoch ratio cache / no cache: {cached[1] / uncached[1]:.1f}x")

    ray.shutdown()
    store = 80 * 1024**2
    prepare_synthetic(str(tmp / "big"), rows=320_000, shards=32, features=256, classes=4)
    big = DataConfig(train=str(tmp / "big" / "train"), val=None, features=["features"], cache="none")
    size = sum(p.stat().st_size for p in (tmp / "big" / "train").glob("*.parquet"))
    ray.init(address="local", num_cpus=4, object_store_memory=store, include_dashboard=False,
             logging_config=ray.LoggingConfig(log_level="WARNING"))
    DataContext.get_current().target_max_block_size = 4 * 1024**2
    DataContext.get_current().enable_progress_bars = False
    # Baseline: the same pipeline over one shard, so Ray's worker processes already exist when we measure.
    one = DataConfig(train=str(sorted((tmp / "big" / "train").glob("*.parquet"))[0]), val=None,
                     features=["features"], cache="none")
    baseline, _ = peak_rss_while(lambda: ray_data_passes(one, passes=1))
    peak, driver = peak_rss_while(lambda: ray_data_passes(big, passes=1))
    ray.shutdown()
    print(f"4. streaming {size / 2**20:,.0f} MiB of Parquet through an {store / 2**20:.0f} MiB object store "
          f"({size / store:.1f}x)")
    print(f"   peak RSS, driver + all Ray processes: {peak / 2**20:,.0f} MiB "
          f"(same pipeline over one shard {baseline / 2**20:,.0f} MiB; "
          f"growth {(peak - baseline) / 2**20:,.0f} MiB = {(peak - baseline) / size:.2f}x the dataset); "
          f"driver alone {driver / 2**20:,.0f} MiB")
    print("   (RSS counts the shared object-store pages in every process that maps them, so it over-states use)")
    subprocess.run(["rm", "-rf", str(tmp)], check=False)


if __name__ == "__main__":
    main()
