"""Streaming with bounded memory: a dataset several times larger than Ray's object store trains through it with
the cache off; nothing is materialised and the object store spills next to nothing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from recording_model import read_runs

from orchestrator.config import load_config
from orchestrator.run.launch import train
from orchestrator.training.checkpoint import load_state
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


def store_stats() -> Any:
    """This cluster's object store counters, as numbers (Ray's memory summary prints "Spilled ..." only once
    something has spilled, so a missing line cannot be told from a changed format)."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    # This test's own cluster, by address: other Ray instances may be running on a shared machine.
    return get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address)).store_stats


def test_dataset_larger_than_object_store_streams(small_store_ray: None, tmp_path: Path) -> None:
    data = tmp_path / "big"
    # 300k rows x 256 float32 features: ~300 MiB of Parquet, ~3.8x the 80 MiB object store.
    prepare_synthetic(str(data), rows=300_000, shards=24, features=256, classes=4)
    info = inspect_parquet(str(data / "train"), ["features"], "label")
    size = info.num_bytes
    assert size > 3.5 * OBJECT_STORE
    # The model records each training micro-batch it runs (../recording_model.py, imported by the workers from
    # the driver's working directory, the repository root): the rows trained on are counted, not computed.
    record = tmp_path / "record"
    record.mkdir()
    result = train(load_config(None, [
        f"data.train={data}/train", "data.val=null", "data.features=[features]", "data.cache=none",
        "scaling.num_workers=1", "scaling.cpus_per_worker=1", "train.global_batch_size=4096", "train.max_steps=73",
        "train.micro_batch_size=4096", "train.log_every=73", "checkpoint.every=73",
        "model.entrypoint=tests.integration.recording_model:build", f"model.out_dir={record}", "model.rows=4096",
        f"storage.path={tmp_path}/runs", "tracking.enabled=false",
    ]), verbose=False)
    assert result.metrics["step"] == 73  # 73 x 4096 rows: the whole dataset once
    (calls,) = read_runs(str(record), 0)  # one worker, never restarted
    assert [len(batch) for batch in calls] == [4096] * 73  # every step trained on a full micro-batch of rows
    assert 73 * 4096 > 0.99 * info.num_rows
    # ...all from the first pass: the stream did not end early and start the data again.
    progress = load_state(result.checkpoint_path)["progress"]  # type: ignore[arg-type]
    assert (progress["epoch"], progress["rows_in_epoch"]) == (0, 73 * 4096)
    # Blocks flowed through: had the dataset been materialised, ~300 MiB would have spilled to disk.
    stats = store_stats()
    assert stats.object_store_bytes_avail == pytest.approx(OBJECT_STORE, rel=0.05)  # this test's small store
    assert stats.spilled_bytes_total < OBJECT_STORE / 2, stats
    assert os.path.isdir(result.run_dir)
