"""Streaming with bounded memory: a dataset several times larger than Ray's object store trains through it with
the cache off; nothing is materialised and the object store spills next to nothing."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.config import load_config
from orchestrator.launch import train
from pipelines.prepare import prepare_synthetic
from pipelines.sources import inspect_parquet

pytestmark = pytest.mark.slow

OBJECT_STORE = 80 * 1024**2


@pytest.fixture(scope="module")
def small_store_ray() -> Iterator[None]:
    import ray
    from ray.data import DataContext

    ray.init(address="local", num_cpus=4, object_store_memory=OBJECT_STORE, include_dashboard=True,
             dashboard_host="127.0.0.1")
    # Small blocks so many are in flight at once: that is what exercises back-pressure.
    DataContext.get_current().target_max_block_size = 2 * 1024**2
    try:
        yield
    finally:
        ray.shutdown()


def spilled_bytes() -> int:
    import ray
    from ray._private.internal_api import memory_summary

    # This test's own cluster, by address: other Ray instances may be running on a shared machine.
    summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    match = re.search(r"Spilled (\d+) MiB", summary)
    return int(match.group(1)) * 1024**2 if match else 0


def test_dataset_larger_than_object_store_streams(small_store_ray: None, tmp_path: Path) -> None:
    data = tmp_path / "big"
    # 300k rows x 256 float32 features: ~300 MiB of Parquet, ~3.8x the 80 MiB object store.
    prepare_synthetic(str(data), rows=300_000, shards=24, features=256, classes=4)
    size = inspect_parquet(str(data / "train"), ["features"], "label").num_bytes
    assert size > 3.5 * OBJECT_STORE
    result = train(load_config(None, [
        f"data.train={data}/train", "data.val=null", "data.features=[features]", "data.cache=none",
        "scaling.num_workers=1", "scaling.cpus_per_worker=1", "train.global_batch_size=4096", "train.max_steps=73",
        "train.log_every=73", "checkpoint.every=73", "model.hidden=[8]", f"storage.path={tmp_path}/runs",
        "tracking.enabled=false",
    ]), verbose=False)
    assert result.metrics["step"] == 73  # 73 x 4096 rows: the whole dataset once
    assert result.metrics["samples_seen"] > size / (256 * 4) * 0.99
    # Blocks flowed through: had the dataset been materialised, ~300 MiB would have spilled to disk.
    assert spilled_bytes() < OBJECT_STORE / 2
    assert os.path.isdir(result.run_dir)
