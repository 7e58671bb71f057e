"""Data order guarantees on a real 2-worker Ray run, proven with an id column: every row exactly once per epoch
across ranks, shard order reshuffled per (seed, epoch), and a crash mid-epoch resumed without replaying rows."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from recording_model import read_runs

from orchestrator.config import load_config
from orchestrator.run.launch import train
from orchestrator.run.result import TrainResult
from orchestrator.run.trainer import RunFailedError
from orchestrator.training.checkpoint import load_state
from pipelines.datasets import inspect_datasets, replay_epochs, use_memory_cache
from pipelines.order import shard_order

pytestmark = pytest.mark.slow

ROWS, SHARDS, MICRO, STEPS_PER_EPOCH = 1200, 6, 50, 12  # 2 ranks x 600 rows = 12 micro-batches each, no drops
# A small object store, so that a few MB of Parquet are not "small" data (under 5% of the store): held in memory
# by `cache: memory` but streamed every epoch, not replayed by the workers.
OBJECT_STORE = 128 * 1024**2


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """This module's local Ray instance: ../conftest.py's, with a small object store."""
    from orchestrator.cluster.local import init_local, shutdown_local_ray

    here = str(Path(__file__).parents[1])  # the test model modules must import in the workers
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [here, os.environ.get("PYTHONPATH")] if p)
    init_local(num_cpus=4, object_store_memory=OBJECT_STORE, dashboard_host="127.0.0.1")
    try:
        yield
    finally:
        shutdown_local_ray()


def write_ids(out: Path, pad_bytes: int = 0, rows: int = ROWS) -> str:
    """`rows` rows in SHARDS shards: an `id` feature (the recording model logs it), 4 more features, a label, and
    optionally an unread `pad` column of incompressible bytes that only makes the files larger."""
    rng = np.random.default_rng(0)
    for i, ids in enumerate(np.array_split(np.arange(rows), SHARDS)):
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


# Rows that split unevenly: 2 ranks x 553 (the equal split leaves 1 out), each 11 micro-batches of 50 and 3 rows over.
UNEVEN, UNEVEN_STEPS = 1107, 11


@pytest.fixture(scope="module")
def uneven_id_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_ids(tmp_path_factory.mktemp("uneven-ids"), rows=UNEVEN)


@pytest.fixture(scope="module")
def large_uneven_id_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    """UNEVEN rows in ~9 MiB of files: 7% of OBJECT_STORE, over the 5% under which data counts as small."""
    return write_ids(tmp_path_factory.mktemp("large-uneven-ids"), pad_bytes=8 * 1024, rows=UNEVEN)


def run(tmp: Path, data: str, name: str, *extra: str, resume: bool = False) -> TrainResult:
    record = tmp / name
    record.mkdir(exist_ok=resume)  # a resumed run appends to the same record (its config must not change)
    return train(load_config(None, [
        f"data.train={data}", "data.val=null", "data.features=[id, x]", "data.cache=none", "data.shuffle_buffer=64",
        "scaling.num_workers=2", "train.global_batch_size=100", f"train.micro_batch_size={MICRO}",
        f"train.max_steps={3 * STEPS_PER_EPOCH}", "train.precision=fp32", "train.log_every=6", "checkpoint.every=6",
        "model.entrypoint=recording_model:build", f"model.out_dir={record}", f"model.rows={MICRO}",
        "optim.lr=0.01",
        f"storage.path={tmp}/runs", "tracking.enabled=false", *extra,
    ]), verbose=False, resume=resume)


def test_exactly_once_shuffled_per_epoch_and_exact_resume(ray_cluster: None, tmp_path: Path, id_data: str) -> None:
    clean = run(tmp_path, id_data, "clean")
    ranks = [read_runs(str(tmp_path / "clean"), r)[0] for r in (0, 1)]
    epochs = [per_rank[0] for per_rank in epoch_orders(ranks)]
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled each epoch (the shard order itself: unit-tested)
    assert_resumes_exactly(tmp_path, id_data, clean, ranks)


def epoch_orders(ranks: list[list[list[int]]], steps: int = STEPS_PER_EPOCH,
                 rows: int = ROWS) -> list[list[list[int]]]:
    """Per epoch, per rank, the ids in the order that rank trained on them (from each rank's micro-batches of
    `steps` steps an epoch). Checks that no epoch trains a row twice and that each leaves out exactly the documented
    rows: the one the equal split between the 2 ranks leaves when `rows` is odd, and each rank's incomplete last
    micro-batch (none for ROWS: every row exactly once)."""
    assert [len(calls) for calls in ranks] == [3 * steps] * 2
    documented = rows % 2 + 2 * (rows // 2 % MICRO)
    epochs = []
    for e in range(3):
        per_rank = [flat(calls[e * steps:(e + 1) * steps]) for calls in ranks]
        trained = per_rank[0] + per_rank[1]
        assert len(set(trained)) == len(trained), f"epoch {e}: a row trained on twice"
        assert set(trained) <= set(range(rows))
        assert rows - len(trained) == documented, f"epoch {e}: {rows - len(trained)} rows left out"
        epochs.append(per_rank)
    return epochs


def assert_each_rank_reordered(epochs: list[list[list[int]]]) -> None:
    """No rank trains on the same order in two of the 3 epochs (data.shuffle took effect)."""
    for rank in (0, 1):
        orders = [epochs[e][rank] for e in range(3)]
        assert orders[0] != orders[1] and orders[1] != orders[2] and orders[0] != orders[2], \
            f"rank {rank} trained on the same order in two epochs: data.shuffle had no effect"


def assert_resumes_exactly(tmp_path: Path, data: str, clean: TrainResult, ranks: list[list[list[int]]],
                           *extra: str, steps: int = STEPS_PER_EPOCH) -> None:
    """Run again with a crash in the middle of epoch 1 (call 21 of rank 0; last checkpoint at step 18, in epoch 1
    for 11 or 12 steps an epoch): same micro-batches as the clean run before and after the restart, and the same
    final weights."""
    crashed = run(tmp_path, data, "crashed", "failure.max_failures=1", f"model.marker={tmp_path}/marker",
                  "model.after_calls=21", *extra)
    assert (tmp_path / "marker").exists()
    resumed_at = set()
    for rank in (0, 1):
        before, after = read_runs(str(tmp_path / "crashed"), rank)
        assert before[:18] == ranks[rank][:18]  # same order as the clean run: deterministic per (seed, epoch)
        # The restart resumes at the last checkpoint the controller registered: usually step 18 (mid-epoch 1), but
        # the controller registers at its polls, and a crash soon after a report can lose that report's checkpoint
        # and the one before (seen in CI: step 6). From there, exactly the clean run's micro-batches, none replayed
        # and none skipped.
        step = 3 * steps - len(after)
        assert step in (0, 6, 12, 18) and after == ranks[rank][step:]
        resumed_at.add(step)
    assert len(resumed_at) == 1
    a, b = load_state(clean.checkpoint_path)["model"], load_state(crashed.checkpoint_path)["model"]  # type: ignore[arg-type]
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed run diverged from the uninterrupted one"


def test_memory_cache_of_data_not_replayed_reshuffles_per_epoch(ray_cluster: None, tmp_path: Path,
                                                                  large_uneven_id_data: str) -> None:
    """`cache: memory` on data above the replay threshold, streamed every epoch, with rows that split unevenly
    (1107 = 2 x 553 + 1; 553 = 11 x 50 + 3): each epoch leaves out exactly the documented rows and trains every
    other row once, reshuffled per epoch, and a worker restarted mid-epoch continues exactly."""
    import ray

    memory = ("data.cache=memory", "data.shuffle_buffer=null", f"train.max_steps={3 * UNEVEN_STEPS}")
    data = load_config(None, [f"data.train={large_uneven_id_data}", "data.val=null", "data.features=[id, x]",
                              *memory]).data
    infos = inspect_datasets(data)
    store = ray.cluster_resources()["object_store_memory"]
    # Held in the object store but not small: every epoch streams it again (workers do not replay their pass).
    assert use_memory_cache(data, infos, store) and not replay_epochs(data, infos, store)

    clean = run(tmp_path, large_uneven_id_data, "clean", *memory)
    ranks = [read_runs(str(tmp_path / "clean"), r)[0] for r in (0, 1)]
    assert_each_rank_reordered(epoch_orders(ranks, UNEVEN_STEPS, UNEVEN))
    # Deterministic per (seed, epoch): a second run, and a worker restarted mid-epoch, see the same order.
    assert_resumes_exactly(tmp_path, large_uneven_id_data, clean, ranks, *memory, steps=UNEVEN_STEPS)


def flat(calls: list[list[int]]) -> list[int]:
    return [v for batch in calls for v in batch]


def one_worker_order(data: str, epoch: int) -> list[int]:
    """The ids of `data` in the shard order of `epoch` (train.seed 0), read from the files: what one worker
    without a local shuffle buffer trains on in that epoch."""
    info = inspect_datasets(load_config(None, [f"data.train={data}", "data.val=null", "data.features=[id, x]"]).data)
    return [int(v) for obj in shard_order(info["train"].objects, 0, epoch)
            for v in pq.read_table(Path(data, Path(obj.path).name), columns=["id"])["id"].to_pylist()]


def test_resizes_4_2_3_mid_epoch_train_every_row_of_every_epoch_once(ray_cluster: None, tmp_path: Path,
                                                                    id_data: str) -> None:
    """4 workers, one killed in the middle of epoch 1 with no restart left (the run fails); `--resume` at 2 workers
    (scaling.* may change on resume), killed again in the rest of that epoch; `--resume` at 3 to the end. The global
    batch stays 120 rows (10 steps an epoch at every size): what the final model trained on is, in each of the 3
    epochs, every row exactly once (pipelines/rest.py)."""
    fixed = ("data.shuffle_buffer=null", "train.global_batch_size=120", "train.micro_batch_size=10", "model.rows=10",
             "train.max_steps=30", "train.log_every=1", "checkpoint.every=1", "failure.max_failures=0",
             "scaling.cpus_per_worker=0.5",  # 4 workers leave 2 of the 4 CPUs to Ray Data's read tasks
             f"model.marker={tmp_path}/marker", "model.kill_at={4: 43, 2: 19}")
    runs, resumed_from = tmp_path / "runs", []
    for workers in (4, 2):
        with pytest.raises(RunFailedError):
            run(tmp_path, id_data, "resize", *fixed, f"scaling.num_workers={workers}", resume=workers == 2)
        assert (tmp_path / f"marker-{workers}").exists()
        # Which checkpoint the next group loads: the newest Ray Train registered (it registers at the controller's
        # polls, and a worker killed soon after a report can take that report's checkpoint with it).
        snapshot = "".join(p.read_text() for p in runs.glob("*/checkpoint_manager_snapshot.json"))
        resumed_from.append(max(int(s) for s in re.findall(r"checkpoint_(\d{8})_", snapshot)))
    last = run(tmp_path, id_data, "resize", *fixed, "scaling.num_workers=3", resume=True)
    assert {r["world_size"] for r in last.history} == {3} and last.history[-1]["step"] == 30
    s2, s3 = resumed_from
    assert 10 < s2 < 20 and s2 <= s3 < 20, resumed_from  # both resumed inside epoch 1
    # Each group's micro-batches as the steps they trained (accumulation 3, 6, 4), up to the step the next resumed
    # from: what the final model has trained on. Epoch e is steps [10e, 10e + 10) at every size.
    trained: dict[int, list[int]] = {0: [], 1: [], 2: []}
    sizes = (4, 2, 3)
    for group, (first, upto) in enumerate(((0, s2), (s2, s3), (s3, 30))):
        accum = 120 // (10 * sizes[group])
        for rank in range(sizes[group]):
            # This rank's record has one list per group it was in: the earlier groups that had a rank `rank`.
            calls = read_runs(str(tmp_path / "resize"), rank)[sum(rank < size for size in sizes[:group])]
            for i, batch in enumerate(calls[:(upto - first) * accum]):
                trained[(first + i // accum) // 10] += batch
    for epoch, ids in trained.items():
        assert sorted(ids) == list(range(ROWS)), f"epoch {epoch}: not every row exactly once"


def test_memory_cache_of_small_data_replays_exactly_once_per_epoch_with_remainder_rows(
        ray_cluster: None, tmp_path: Path, uneven_id_data: str) -> None:
    """`cache: memory` on small data that the workers replay from their first pass, with rows that split unevenly:
    each epoch leaves out exactly the documented rows (the equal split's 1, each rank's incomplete last micro-batch
    of 3), trains every other row once and in a new order (the streamed case: the test above)."""
    import ray

    memory = ("data.cache=memory", "data.shuffle_buffer=null", f"train.max_steps={3 * UNEVEN_STEPS}")
    cfg = load_config(None, [f"data.train={uneven_id_data}", "data.val=null", "data.features=[id, x]", *memory]).data
    infos, store = inspect_datasets(cfg), ray.cluster_resources()["object_store_memory"]
    assert use_memory_cache(cfg, infos, store) and replay_epochs(cfg, infos, store)

    run(tmp_path, uneven_id_data, "uneven", *memory)
    ranks = [read_runs(str(tmp_path / "uneven"), r)[0] for r in (0, 1)]
    assert_each_rank_reordered(epoch_orders(ranks, UNEVEN_STEPS, UNEVEN))


def test_small_data_read_by_the_driver_makes_the_blocks_ray_datas_read_tasks_make(
        ray_cluster: None, id_data: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Data to replay under READ_HERE_BYTES is read by the driver, not by Ray Data's read tasks (whose worker
    processes a new driver must start first): the same blocks, in the same order, transforms applied, so the
    workers' split and every row's place in it are unchanged."""
    import ray

    import pipelines.datasets as datasets
    from pipelines.datasets import REPLAY, build_datasets

    cfg = load_config(None, [f"data.train={id_data}", "data.val=null", "data.features=[id, x]", "data.shuffle=true",
                             "data.transforms=[{normalize: {mean: 0.5, std: 2.0, columns: [x]}}]"]).data
    infos, store = inspect_datasets(cfg), ray.cluster_resources()["object_store_memory"]

    def blocks() -> list[pa.Table]:
        (ds,) = build_datasets(cfg, infos, store, seed=3, decision=REPLAY).values()
        return [ray.get(ref) for ref in ds.to_arrow_refs()]

    here = blocks()
    monkeypatch.setattr(datasets, "READ_HERE_BYTES", 0)  # what Ray Data's read tasks make of the same shards
    theirs = blocks()
    assert len(here) == SHARDS and [t.num_rows for t in here] == [t.num_rows for t in theirs]
    assert all(ours.equals(them) for ours, them in zip(here, theirs, strict=True))
    ids = np.concatenate([t.column("id").to_numpy() for t in here])
    assert sorted(ids) == list(range(ROWS)) and list(ids) != list(range(ROWS))  # every row, shards reordered
    x = np.concatenate([t.column("x").combine_chunks().flatten().to_numpy() for t in here])
    raw = pa.concat_tables([pq.read_table(f"{id_data}/part-{i:05d}.parquet") for i in range(SHARDS)])
    assert not np.allclose(np.sort(x), np.sort(raw.column("x").combine_chunks().flatten().to_numpy()))  # normalised


def test_held_small_data_gives_each_rank_an_equal_disjoint_part_in_row_order(ray_cluster: None,
                                                                             uneven_id_data: str) -> None:
    """Held small data (no shuffle buffer, no replicas: trainer.build_inputs) skips Ray Data's split: each rank
    takes its part of the driver's blocks itself. Every rank gets as many rows, none twice, in the blocks' order,
    and only the last `rows mod world` are left out, as Ray's equal split leaves out as many."""
    import ray

    from pipelines.batches import FeatureCollate
    from pipelines.datasets import REPLAY, build_datasets
    from pipelines.held import HeldRows

    cfg = load_config(None, [f"data.train={uneven_id_data}", "data.val=null", "data.features=[id, x]"]).data
    infos, store = inspect_datasets(cfg), ray.cluster_resources()["object_store_memory"]
    (held,) = build_datasets(cfg, infos, store, decision=REPLAY, hold=True).values()
    assert isinstance(held, HeldRows)
    order = np.concatenate([t.column("id").to_numpy() for t in ray.get(held.refs)])  # the blocks' row order
    collate = FeatureCollate(["id", "x"], "label")
    for world in (1, 2, 3):
        parts = [np.concatenate([batch["x"][:, 0].numpy() for batch in held.shard(rank, world, torch.device(
            "cpu")).iter_torch_batches(batch_size=MICRO, collate_fn=collate)]) for rank in range(world)]
        each = UNEVEN // world
        assert [len(part) for part in parts] == [each] * world, world
        assert list(np.concatenate(parts)) == list(order[:each * world])  # in order, disjoint, the rest left out
