"""Data options without Ray or a server: config checks, transforms, shard order, the disk cache's LRU and
versioning, and the streaming reader over local shards."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from pipelines.cache import DiskCache
from pipelines.config import DataConfig
from pipelines.errors import DataError
from pipelines.order import ShardOrder, local_shuffle_seed, shard_order
from pipelines.prepare import prepare_synthetic
from pipelines.reader import ShardDatasource
from pipelines.sources import inspect_parquet
from pipelines.storage import ObjectInfo, open_storage, resolve_filesystem
from pipelines.transforms import apply_transforms


def test_config_accepts_s3_cache_dir_and_transforms() -> None:
    cfg = DataConfig(train="s3://bucket/train", val=None, cache="/mnt/cache", cache_max_gb=2,
                     transforms=[{"normalize": {"mean": 0.5, "std": 0.25}}, {"cast": "float16"}])
    assert cfg.disk_cache == "/mnt/cache"
    assert cfg.transforms == [{"normalize": {"mean": 0.5, "std": 0.25}}, {"cast": {"dtype": "float16"}}]
    assert DataConfig.model_validate(cfg.model_dump()) == cfg  # survives the trip to the workers


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"cache": "memroy"}, "neither auto/none/memory nor a directory"),
    ({"cache": "./cache"}, "has no effect on local data"),
    ({"cache_max_gb": 3}, "cache_max_gb has no effect without a disk cache"),
    ({"transforms": [{"scale": 2}]}, "unknown transform 'scale'"),
    ({"transforms": [{"cast": "int8"}]}, "dtype"),
    ({"transforms": [{"normalize": {"std": 0}}]}, "greater than 0"),
    ({"transforms": [{"cast": {"dtype": "float32", "columns": ["nope"]}}]}, r"\['nope'\] are not in data.features"),
    ({"s3": {"secret_key": "x"}}, "Extra inputs are not permitted"),
    ({"transforms": [{"call": "no_such_module_here:fn"}]}, "cannot import module 'no_such_module_here'"),
    ({"transforms": [{"call": "pipelines.transforms"}]}, "must look like 'package.module:function'"),
    ({"transforms": [{"call": "pipelines.transforms:nothing"}]}, "has no callable 'nothing'"),
])
def test_config_refuses(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        DataConfig(**kwargs)  # type: ignore[arg-type]


def test_transforms_normalize_and_cast_lists_and_scalars() -> None:
    table = pa.table({
        "v": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(4, dtype=np.float32)), 2),
        "s": pa.array([2, 4], pa.int64()),
        "label": pa.array([0, 1]),
    })
    out = apply_transforms(table, [{"normalize": {"mean": 1.0, "std": 2.0}}, {"cast": {"dtype": "float16"}}],
                           ["v", "s"])
    assert out.column("v").to_pylist() == [[-0.5, 0.0], [0.5, 1.0]]
    assert out.column("s").to_pylist() == [0.5, 1.5]
    assert out.schema.field("v").type.value_type == pa.float16() and out.schema.field("s").type == pa.float16()
    assert out.column("label").to_pylist() == [0, 1]  # the label is never transformed


def test_a_call_transform_runs_your_function_on_each_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_transforms.py").write_text(
        "import pyarrow.compute as pc\n"
        "def scale(batch, factor=1):\n"
        "    i = batch.schema.get_field_index('s')\n"
        "    return batch.set_column(i, 's', pc.multiply(batch.column(i), factor))\n"
        "def broken(batch):\n"
        "    return batch.to_pydict()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = DataConfig(transforms=[{"call": "my_transforms:scale"},
                                 {"call": {"fn": "my_transforms:scale", "kwargs": {"factor": 3}}}])
    assert cfg.transforms == [{"call": {"fn": "my_transforms:scale", "kwargs": {}}},
                              {"call": {"fn": "my_transforms:scale", "kwargs": {"factor": 3}}}]
    out = apply_transforms(pa.table({"s": [1, 2], "label": [0, 1]}), cfg.transforms, ["s"])
    assert out.column("s").to_pylist() == [3, 6] and out.column("label").to_pylist() == [0, 1]
    with pytest.raises(DataError, match="my_transforms:broken returned dict, not a pyarrow.Table"):
        apply_transforms(pa.table({"s": [1]}), [{"call": {"fn": "my_transforms:broken"}}], ["s"])


def test_shard_order_is_a_deterministic_permutation_per_epoch() -> None:
    items = list(range(20))
    orders = [shard_order(items, seed=1, epoch=e) for e in range(3)]
    assert all(sorted(o) == items for o in orders)
    assert orders[0] != orders[1] != orders[2]
    assert orders[1] == shard_order(items, seed=1, epoch=1)  # a restart redraws the same order
    assert shard_order(items, seed=2, epoch=1) != orders[1]
    assert shard_order(items, seed=1, epoch=1, shuffle=False) == items
    assert local_shuffle_seed(0, 1, 0) == local_shuffle_seed(0, 1, 0) != local_shuffle_seed(0, 1, 1)


def test_orders_and_seeds_are_the_documented_draws() -> None:
    # Fixed expected values, not the function compared with itself: a change of the draw (dropping the epoch, or
    # the rank) changes what every resumed run and every second run reads.
    assert [shard_order(list(range(8)), seed=1, epoch=e) for e in range(3)] == [
        [5, 0, 1, 4, 2, 6, 3, 7], [6, 1, 4, 0, 3, 2, 5, 7], [6, 0, 7, 5, 1, 4, 3, 2]]
    assert [[local_shuffle_seed(0, e, r) for r in range(2)] for e in range(3)] == [
        [1684815930, 1342986804], [1341869963, 659679018], [1426735593, 420068032]]


def test_reader_follows_the_epoch_order_and_streams_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prepare_synthetic(str(tmp_path), rows=4000, shards=5, features=3, classes=2)
    info = inspect_parquet(str(tmp_path / "train"), ["features"], "label")
    epoch = {"now": 0}
    monkeypatch.setattr("pipelines.reader.current_epoch", lambda name: epoch["now"])
    source = ShardDatasource(info.storage, info.objects, info.file_rows, ["features", "label"],  # type: ignore[arg-type]
                             order=ShardOrder(seed=7, shuffle=True, epoch_clock="clock"), block_bytes=1024)
    for e in range(3):
        epoch["now"] = e
        tasks = source.get_read_tasks(1)
        assert [t.metadata.input_files[0] for t in tasks] == shard_order(info.files, 7, e)
        assert sum(t.metadata.num_rows for t in tasks) == 4000
    tables = list(tasks[0]())
    assert len(tables) > 1 and sum(len(t) for t in tables) == 800  # one shard in several small blocks


def test_resolve_filesystem_local_and_s3_roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fs, root = resolve_filesystem(str(tmp_path))
    assert root == str(tmp_path) and fs.type_name == "local"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:19")  # the service-specific one wins, as in boto3
    storage = open_storage("s3://bucket/some/prefix/")
    assert (storage.root, storage.endpoint, storage.region) == ("bucket/some/prefix", "http://127.0.0.1:19",
                                                                storage.region or "us-east-1")
    assert storage.filesystem().type_name == "s3"


def _shard(path: Path, rows: int) -> ObjectInfo:
    pq.write_table(pa.table({"x": pa.array(np.arange(rows, dtype=np.float64))}), path)
    stat = path.stat()
    return ObjectInfo(str(path), stat.st_size, str(stat.st_mtime_ns))


def test_disk_cache_hits_refetches_changed_objects_and_evicts_lru(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "src"))
    (tmp_path / "src").mkdir()
    objs = [_shard(tmp_path / "src" / f"{i}.parquet", 1000) for i in range(3)]
    cache = DiskCache(str(tmp_path / "cache"), max_gb=(objs[0].size * 2.5) / 1e9)  # room for two shards
    for obj in objs[:2]:
        assert pq.read_table(cache.open(storage, obj)).num_rows == 1000
    assert (cache.stats().misses, cache.stats().hits) == (2, 0)
    # The cache orders by the copies' mtimes: set them, so objs[0] is the older copy whatever the clock's
    # resolution; only the hit's refresh can then make objs[1] the least recently used.
    copies = [tmp_path / "cache" / "objects" / DiskCache._names(storage, obj)[1] for obj in objs[:2]]
    assert all(c.exists() for c in copies)
    os.utime(copies[0], (1_000_000_000, 1_000_000_000))
    os.utime(copies[1], (1_000_000_100, 1_000_000_100))
    cache.open(storage, objs[0])  # a hit refreshes objs[0]: objs[1] is now least recently used
    cache.open(storage, objs[2])  # over the cap: evicts objs[1]
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.evictions) == (1, 3, 1)
    assert stats.bytes_downloaded == sum(o.size for o in objs)
    cache.open(storage, objs[0])
    assert cache.stats().hits == 2  # objs[0] survived
    cache.open(storage, objs[1])
    assert cache.stats().misses == 4  # objs[1] had been evicted
    # A rewritten object (new size/version) is fetched again, never served stale.
    changed = _shard(tmp_path / "src" / "0.parquet", 10)
    assert pq.read_table(cache.open(storage, changed)).num_rows == 10
    assert cache.stats().misses == 5


def test_only_small_datasets_held_in_memory_are_replayed_by_workers() -> None:
    from pipelines.datasets import replay_epochs, use_memory_cache
    from pipelines.sources import DatasetInfo

    infos = {"train": DatasetInfo("d", ["a.parquet"], num_rows=10, num_bytes=1000, feature_dim=4, num_classes=2)}
    store = 100_000  # 1000 bytes < 5%: small
    auto, memory, none = (DataConfig(train="d", cache=c) for c in ("auto", "memory", "none"))
    assert use_memory_cache(auto, infos, store) and replay_epochs(auto, infos, store)
    assert not use_memory_cache(none, infos, store) and not replay_epochs(none, infos, store)
    # Forced into memory but large: held in the object store, not copied into every worker as well.
    assert use_memory_cache(memory, infos, 10_000) and not replay_epochs(memory, infos, 10_000)
    assert not use_memory_cache(auto, infos, 10_000)


def test_memory_cached_data_not_replayed_is_reordered_per_epoch() -> None:
    from pipelines.datasets import cache_decision, reorders_memory_blocks
    from pipelines.sources import DatasetInfo

    infos = {"train": DatasetInfo("d", ["a.parquet"], num_rows=10, num_bytes=1000, feature_dim=4, num_classes=2)}
    memory, auto, none = (DataConfig(train="d", cache=c) for c in ("memory", "auto", "none"))

    def reorders(cfg: DataConfig, store: float) -> bool:
        return reorders_memory_blocks(cfg, cache_decision(cfg, infos, store))

    # Held in memory but not small (1000 bytes > 5% of 10_000): streamed each epoch, its blocks reordered.
    assert reorders(memory, 10_000)
    assert not reorders(memory.model_copy(update={"shuffle": False}), 10_000)
    assert not reorders(memory, 100_000)  # small: replayed (and reshuffled) by the workers
    assert not reorders(auto, 100_000)
    assert not reorders(none, 10_000)  # streamed from storage in the epoch's shard order


def test_memory_blocks_are_handed_out_in_the_epoch_order(monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    import pipelines.datasets
    from pipelines.datasets import MemoryBlock, memory_blocks_source

    # Stand-ins for the object refs: the order is all that is read until a task runs.
    blocks = [MemoryBlock(pa.table({"id": np.arange(10 * i, 10 * i + 10)}), 0, 10, 80) for i in range(8)]
    epoch = {"now": 0}
    monkeypatch.setattr("pipelines.datasets.current_epoch", lambda name: epoch["now"])
    monkeypatch.setattr("ray.get", lambda ref: ref)
    source = memory_blocks_source(blocks, 3, "clock")
    assert source.estimate_inmemory_data_size() == 640
    orders = []
    for e in (0, 1, 2, 1):
        epoch["now"] = e
        tasks = source.get_read_tasks(1)
        assert [t.metadata.num_rows for t in tasks] == [10] * 8
        orders.append([next(iter(t())).column("id")[0].as_py() // 10 for t in tasks])
        assert orders[-1] == shard_order(list(range(8)), 3, e)  # the permutation shards get under cache: none
    assert orders[0] != orders[1] != orders[2] and orders[3] == orders[1]  # same epoch, same order (a restart)
    # A block seen through a slice reads only its rows.
    part = memory_blocks_source([MemoryBlock(blocks[1].ref, 2, 5, 40)], 3, "clock")
    assert next(iter(part.get_read_tasks(1)[0]())).column("id").to_pylist() == [12, 13, 14, 15, 16]
    # Ray's processes unpickle the source by its module-level name.
    assert type(source) is pipelines.datasets.MemoryBlocksDatasource
    assert type(pickle.loads(pickle.dumps(source))) is type(source)
