"""Data order guarantees on a real 2-worker Ray run, proven with an id column: every row exactly once per epoch
across ranks, shard order reshuffled per (seed, epoch), and a crash mid-epoch resumed without replaying rows."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from recording_model import read_runs

from orchestrator.config import load_config
from orchestrator.launch import TrainResult, train
from orchestrator.training.checkpoint import load_state
from pipelines.datasets import inspect_datasets, replay_epochs, use_memory_cache

pytestmark = pytest.mark.slow

ROWS, SHARDS, MICRO, STEPS_PER_EPOCH = 1200, 6, 50, 12  # 2 ranks x 600 rows = 12 micro-batches each, no drops
# A small object store, so that a few MB of Parquet are not "small" data (under 5% of the store): held in memory
# by `cache: memory` but streamed every epoch, not replayed by the workers.
OBJECT_STORE = 128 * 1024**2


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """This module's local Ray instance: ../conftest.py's, with a small object store."""
    import ray

    from orchestrator.launch import pin_state_api, shutdown_local_ray

    here = str(Path(__file__).parents[1])  # the test model modules must import in the workers
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [here, os.environ.get("PYTHONPATH")] if p)
    ray.init(address="local", num_cpus=4, object_store_memory=OBJECT_STORE, include_dashboard=True,
             dashboard_host="127.0.0.1", dashboard_port=pin_state_api())
    try:
        yield
    finally:
        shutdown_local_ray()


def write_ids(out: Path, pad_bytes: int = 0) -> str:
    """ROWS rows in SHARDS shards: an `id` feature (the recording model logs it), 4 more features, a label, and
    optionally an unread `pad` column of incompressible bytes that only makes the files larger."""
    rng = np.random.default_rng(0)
    for i, ids in enumerate(np.array_split(np.arange(ROWS), SHARDS)):
        x = rng.normal(size=(len(ids), 4)).astype(np.float32)
        columns = {
            "id": pa.array(ids.astype(np.float32)),
            "x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 4),
            "label": pa.array((ids % 3).astype(np.int64)),
        }
        if pad_bytes:
            columns["pad"] = pa.array([rng.bytes(pad_bytes) for _ in ids], pa.binary())
        pq.write_table(pa.table(columns), out / f"part-{i:05d}.parquet")
    return str(out)


@pytest.fixture(scope="module")
def id_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_ids(tmp_path_factory.mktemp("ids"))


@pytest.fixture(scope="module")
def large_id_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same rows in ~9 MiB of files: 7% of OBJECT_STORE, over the 5% under which data counts as small."""
    return write_ids(tmp_path_factory.mktemp("large-ids"), pad_bytes=8 * 1024)


def run(tmp: Path, data: str, name: str, *extra: str) -> TrainResult:
    record = tmp / name
    record.mkdir()
    return train(load_config(None, [
        f"data.train={data}", "data.val=null", "data.features=[id, x]", "data.cache=none", "data.shuffle_buffer=64",
        "scaling.num_workers=2", "train.global_batch_size=100", f"train.micro_batch_size={MICRO}",
        f"train.max_steps={3 * STEPS_PER_EPOCH}", "train.precision=fp32", "train.log_every=6", "checkpoint.every=6",
        "model.entrypoint=recording_model:build", f"model.out_dir={record}", f"model.rows={MICRO}",
        "optim.lr=0.01",
        f"storage.path={tmp}/runs", "tracking.enabled=false", *extra,
    ]), verbose=False)


def test_exactly_once_shuffled_per_epoch_and_exact_resume(ray_cluster: None, tmp_path: Path, id_data: str) -> None:
    clean = run(tmp_path, id_data, "clean")
    ranks = [read_runs(str(tmp_path / "clean"), r)[0] for r in (0, 1)]
    epochs = [per_rank[0] for per_rank in epoch_orders(ranks)]
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled each epoch (the shard order itself: unit-tested)
    assert_resumes_exactly(tmp_path, id_data, clean, ranks)


def epoch_orders(ranks: list[list[list[int]]]) -> list[list[list[int]]]:
    """Per epoch, per rank, the ids in the order that rank trained on them (from each rank's micro-batches);
    checks that each epoch holds every row exactly once across the ranks."""
    assert [len(calls) for calls in ranks] == [3 * STEPS_PER_EPOCH] * 2
    epochs = []
    for e in range(3):
        per_rank = [[v for batch in calls[e * STEPS_PER_EPOCH:(e + 1) * STEPS_PER_EPOCH] for v in batch]
                    for calls in ranks]
        assert sorted(per_rank[0] + per_rank[1]) == list(range(ROWS)), f"epoch {e}: not every row exactly once"
        epochs.append(per_rank)
    return epochs


def assert_resumes_exactly(tmp_path: Path, data: str, clean: TrainResult, ranks: list[list[list[int]]],
                           *extra: str) -> None:
    """Run again with a crash in the middle of epoch 1 (call 21 of rank 0; last checkpoint at step 18 = epoch 1,
    batch 6): same micro-batches as the clean run before and after the restart, and the same final weights."""
    crashed = run(tmp_path, data, "crashed", "failure.max_failures=1", f"model.marker={tmp_path}/marker",
                  "model.after_calls=21", *extra)
    assert (tmp_path / "marker").exists()
    resumed_at = set()
    for rank in (0, 1):
        before, after = read_runs(str(tmp_path / "crashed"), rank)
        assert before[:18] == ranks[rank][:18]  # same order as the clean run: deterministic per (seed, epoch)
        # The restart resumes at the last checkpoint the controller registered (step 12 or 18, mid-epoch 1; a
        # crash soon after a report can lose that report's checkpoint): from there, exactly the clean run's
        # micro-batches, none replayed and none skipped.
        step = 3 * STEPS_PER_EPOCH - len(after)
        assert step in (12, 18) and after == ranks[rank][step:]
        resumed_at.add(step)
    assert len(resumed_at) == 1
    a, b = load_state(clean.checkpoint_path)["model"], load_state(crashed.checkpoint_path)["model"]  # type: ignore[arg-type]
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed run diverged from the uninterrupted one"


def test_memory_cache_of_data_not_replayed_reshuffles_per_epoch(ray_cluster: None, tmp_path: Path,
                                                                  large_id_data: str) -> None:
    import ray

    memory = ("data.cache=memory", "data.shuffle_buffer=null")
    data = load_config(None, [f"data.train={large_id_data}", "data.val=null", "data.features=[id, x]", *memory]).data
    infos = inspect_datasets(data)
    store = ray.cluster_resources()["object_store_memory"]
    # Held in the object store but not small: every epoch streams it again (workers do not replay their pass).
    assert use_memory_cache(data, infos, store) and not replay_epochs(data, infos, store)

    clean = run(tmp_path, large_id_data, "clean", *memory)
    ranks = [read_runs(str(tmp_path / "clean"), r)[0] for r in (0, 1)]
    epochs = epoch_orders(ranks)
    for rank in (0, 1):
        orders = [epochs[e][rank] for e in range(3)]
        assert orders[0] != orders[1] and orders[1] != orders[2] and orders[0] != orders[2], \
            f"rank {rank} trained on the same order in two epochs: data.shuffle had no effect"
    # Deterministic per (seed, epoch): a second run, and a worker restarted mid-epoch, see the same order.
    assert_resumes_exactly(tmp_path, large_id_data, clean, ranks, *memory)
