"""Building the Ray Datasets that Ray Train splits across workers."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipelines.cache import DiskCache
from pipelines.config import DataConfig
from pipelines.held import HeldRows
from pipelines.order import ShardOrder, current_epoch, shard_order
from pipelines.sources import DatasetInfo, inspect_parquet
from pipelines.storage import Storage, open_storage

if TYPE_CHECKING:
    import pyarrow as pa
    import ray.data

    from pipelines.batches import Sample


def inspect_datasets(cfg: DataConfig, named: bool = False) -> dict[str, DatasetInfo]:
    """Check the train (and val) shards before Ray starts; raises `DataError` naming the problem.
    `named`: the model takes the columns by name (model.inputs). A disk cache directory is checked
    here too, on the driver's node (each node checks its own again on first use)."""
    if cfg.disk_cache:
        DiskCache(cfg.disk_cache).check()
    infos = {"train": inspect_parquet(cfg.train, cfg.features, cfg.label, cfg.s3, named)}
    if cfg.val is not None:
        infos["val"] = inspect_parquet(cfg.val, cfg.features, cfg.label, cfg.s3, named)
    return infos


@dataclass(frozen=True)
class Inspection:
    """What a run's plan reads from storage, once, before Ray starts: each split's facts, the
    training data's sample rows collated as the workers collate them where the model's checks need
    them (named inputs, or token windows without a label), and the run's own storage (storage.path),
    opened as the data are."""

    datasets: dict[str, DatasetInfo]
    sample: Sample | None
    run_storage: Storage


def inspect_run(cfg: DataConfig, named: bool, run_path: str) -> Inspection:
    """inspect_datasets, the train sample collated (inspect_sample), and `run_path` opened with the
    data's S3 settings; raises `DataError` naming the problem."""
    infos = inspect_datasets(cfg, named)
    rows = infos["train"].sample
    sample = None
    if rows is not None and (named or cfg.label is None):
        # the collate imports torch and Ray Data: only named inputs and token windows need the
        # sample collated before the model's check
        from pipelines.batches import inspect_sample

        sample = inspect_sample(rows, cfg, named)
    # a local path takes no S3 settings
    return Inspection(infos, sample, open_storage(run_path, cfg.s3))


# `cache: auto` keeps a dataset in memory when its files use less than this share of the object
# store.
AUTO_CACHE_SHARE = 0.05


def is_small(infos: dict[str, DatasetInfo], object_store_bytes: float) -> bool:
    return sum(info.num_bytes for info in infos.values()) < AUTO_CACHE_SHARE * object_store_bytes


def use_memory_cache(cfg: DataConfig, infos: dict[str, DatasetInfo],
                     object_store_bytes: float) -> bool:
    if cfg.cache != "auto":
        return cfg.cache == "memory"
    return is_small(infos, object_store_bytes)


def replay_epochs(cfg: DataConfig, infos: dict[str, DatasetInfo],
                  object_store_bytes: float) -> bool:
    """Whether workers may keep their first pass and replay it every epoch: the dataset is held in
    memory (so every epoch has epoch 0's order) and small (a worker's copy is cheap even when
    `cache: memory` is forced)."""
    return use_memory_cache(cfg, infos, object_store_bytes) and is_small(infos, object_store_bytes)


# The cache decision: how the train data reaches the workers each epoch. Each gives an epoch another
# row order, so a checkpoint's data position (rows into its epoch's order) holds only under the
# decision it was made under; a resumed run keeps its checkpoint's decision
# (orchestrator.run.trainer), whatever data.cache or the object store say.
# read from storage (or the disk cache) every epoch, the shards in (seed, epoch) order
STREAM = "stream"
# decoded once into the object store, its blocks handed out again each epoch in (seed, epoch) order
MEMORY = "memory"
# decoded once in epoch 0's shard order, small: each worker replays (and reshuffles) its first pass
REPLAY = "replay"
# Each decision as a user reads it (the resumed driver's line when it keeps a checkpoint's
# decision).
CACHE_DECISIONS = {STREAM: "streamed from storage", MEMORY: "held in memory and "
                                                            "streamed again each epoch",
                   REPLAY: "held in memory and replayed by the workers"}


def cache_decision(cfg: DataConfig, infos: dict[str, DatasetInfo],
                   object_store_bytes: float) -> str:
    """What `data.cache` and the object store's size decide (STREAM, MEMORY or REPLAY)."""
    if not use_memory_cache(cfg, infos, object_store_bytes):
        return STREAM
    # replay_epochs, its memory half known
    return REPLAY if is_small(infos, object_store_bytes) else MEMORY


def reorders_memory_blocks(cfg: DataConfig, decision: str) -> bool:
    """Whether, under the cache `decision`, the train data is held in memory yet streamed again
    every epoch (not small enough for workers to replay): then each epoch hands out the decoded
    blocks in that epoch's (seed, epoch) order, as `cache: none` does with the shards. Replayed data
    keeps epoch 0's order; the workers reshuffle their own pass instead."""
    return cfg.shuffle and decision == MEMORY


@dataclass(frozen=True)
class MemoryBlock:
    """One decoded block held in Ray's object store (or the rows [start, start + rows) of it)."""

    ref: Any  # ray.ObjectRef of a pyarrow.Table
    start: int
    rows: int
    size_bytes: int


def _read_block(block: MemoryBlock) -> list[pa.Table]:
    import ray

    table = ray.get(block.ref)
    whole = block.start == 0 and block.rows == table.num_rows
    return [table if whole else table.slice(block.start, block.rows)]


def memory_blocks(ds: ray.data.Dataset) -> list[MemoryBlock]:
    """The blocks of a materialised dataset, in its order (references only: nothing is copied)."""
    blocks = []
    for bundle in ds.iter_internal_ref_bundles():
        for entry, part in zip(bundle.blocks, bundle.slices, strict=True):
            rows = entry.metadata.num_rows or 0
            start, count = (0, rows) if part is None else (part.start_offset, part.num_rows)
            size = (entry.metadata.size_bytes or 0) * count // max(rows, 1)
            blocks.append(MemoryBlock(entry.ref, start, count, size))
    return blocks


def memory_blocks_source(blocks: list[MemoryBlock], seed: int, epoch_clock: str | None) -> Any:
    """A Ray Data source over `blocks` that hands them out in the (seed, epoch) order of the epoch
    on the clock."""
    return _memory_blocks_class()(blocks, seed, epoch_clock)


@functools.cache
def _memory_blocks_class() -> type:
    """Defined on first use: importing Ray Data costs ~1 s, and the driver imports this module
    before it needs Ray. Reachable as the module attribute `MemoryBlocksDatasource` (see
    `__getattr__`), so its instances pickle by name into Ray's processes, which define it the same
    way when they unpickle one."""
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class MemoryBlocksDatasource(Datasource):
        """Blocks already decoded into the object store, handed out in the order of the epoch on
        `epoch_clock`: a permutation drawn from (seed, epoch), read when an execution (an epoch of
        streaming_split) starts, so a restarted run re-streams an epoch in the same order. A read
        task copies its block into a new object: an epoch costs a memory copy of the data, not a
        read and decode."""

        def __init__(self, blocks: list[MemoryBlock], seed: int, epoch_clock: str | None) -> None:
            self.blocks, self.seed, self.epoch_clock = blocks, seed, epoch_clock

        def get_name(self) -> str:
            return "MemoryBlocks"

        def estimate_inmemory_data_size(self) -> int | None:
            return sum(b.size_bytes for b in self.blocks)

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                           data_context: Any = None) -> list[ReadTask]:
            order = shard_order(self.blocks, self.seed, current_epoch(self.epoch_clock))
            return [ReadTask(functools.partial(_read_block, b),
                             BlockMetadata(num_rows=b.rows, size_bytes=b.size_bytes,
                                           input_files=None, exec_stats=None),
                             per_task_row_limit=per_task_row_limit)
                    for b in order]

    # not a local of this function
    MemoryBlocksDatasource.__qualname__ = MemoryBlocksDatasource.__name__
    return MemoryBlocksDatasource


def __getattr__(name: str) -> Any:
    if name == "MemoryBlocksDatasource":
        return _memory_blocks_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The name Ray Train is handed the training dataset by a second time, unsplit: every rank reads it
# whole to finish an epoch that a group of another size began (pipelines/rest.py). An iterator
# nobody reads costs nothing.
WHOLE_TRAIN = "train_whole"


# Small data to replay under this many bytes of files is read by the process that builds the
# datasets, not by Ray Data's read tasks: a new driver's first Ray Data execution starts worker
# processes of its own (2-4 s on 2 cores) to read what takes milliseconds here.
READ_HERE_BYTES = 64 * 2**20


def _read_here(source: Any, cfg: DataConfig, hold: bool) -> ray.data.Dataset | HeldRows:
    """The blocks Ray Data's materialisation would make of `source` (one per shard, in the shards'
    order, the transforms applied to each), read in this process and put into the object store: as a
    dataset, or with `hold` as HeldRows that the ranks split among themselves (held.py)."""
    import pyarrow as pa
    import ray
    from ray.data import DataContext

    from pipelines.transforms import apply_transforms

    tables = []
    for task in source.get_read_tasks(1, data_context=DataContext.get_current()):
        table = pa.concat_tables(list(task()))
        tables.append(apply_transforms(table, cfg.transforms, cfg.features) if cfg.transforms
                      else table)
    if hold:
        return HeldRows([ray.put(table) for table in tables])
    # metadata taken here: from_arrow computes it in remote tasks
    return ray.data.from_blocks(tables)


def build_datasets(
    cfg: DataConfig, infos: dict[str, DatasetInfo], object_store_bytes: float, *, seed: int = 0,
    epoch_clock: str | None = None, decision: str | None = None, hold: bool = False,
    row_ids: bool = False,
) -> dict[str, ray.data.Dataset | HeldRows]:
    """Streaming readers over the already-checked shards (nothing is read until a worker iterates),
    with the configured transforms in `map_batches`. The train shards are read in (seed, epoch)
    order when `cfg.shuffle` and `epoch_clock` names the clock the workers advance. With the memory
    cache the blocks are decoded once into the object store (by Ray Data's read tasks; small data to
    replay under READ_HERE_BYTES by this process); small data keeps the shard order of epoch 0 (the
    workers replay and reshuffle it), larger data is handed out block by block in (seed, epoch)
    order (`reorders_memory_blocks`). `decision` (a resumed run's, from its checkpoint, one of
    CACHE_DECISIONS: the driver refuses others as it reads them) replaces what `cache_decision`
    would decide now. `hold`: small data read here is returned as HeldRows for the ranks to split
    themselves (the caller knows no shuffle buffer or replica reads it). `row_ids`: each training
    row carries its id (pipelines/rest.py)."""
    import ray.data

    from pipelines.reader import ShardDatasource

    if decision is None:
        decision = cache_decision(cfg, infos, object_store_bytes)
    columns = cfg.columns
    cache = DiskCache(cfg.disk_cache, cfg.cache_max_gb) if cfg.disk_cache else None
    reorder = epoch_clock is not None and reorders_memory_blocks(cfg, decision)
    read_here = (decision == REPLAY
                 and sum(info.num_bytes for info in infos.values()) <= READ_HERE_BYTES)
    datasets = {}
    for name, info in infos.items():
        assert info.storage is not None  # set by inspect_parquet
        # Reordered blocks are decoded in name order once; the epoch's permutation is applied to the
        # blocks.
        shuffled = cfg.shuffle and name == "train" and not reorder
        source = ShardDatasource(
            info.storage, info.objects, info.file_rows, columns,
            order=ShardOrder(seed, shuffle=shuffled, epoch_clock=epoch_clock if shuffled else None),
            cache=cache if info.storage.remote else None, row_ids=row_ids and name == "train",
        )
        if read_here:
            datasets[name] = _read_here(source, cfg, hold)
            continue
        datasets[name] = _stream(source, cfg, len(info.objects))
    if decision != STREAM and not read_here:
        datasets = {name: ds.materialize() for name, ds in datasets.items()}
    if reorder:
        blocks = memory_blocks(datasets["train"])
        # The materialised dataset is dropped; the block references keep its blocks in the object
        # store.
        reordered = memory_blocks_source(blocks, seed, epoch_clock)
        datasets["train"] = ray.data.read_datasource(reordered,
                                                     override_num_blocks=max(len(blocks), 1))
    return datasets


def _stream(source: Any, cfg: DataConfig, shards: int) -> ray.data.Dataset:
    """One split's streaming dataset over its `shards` shards (`source`: their ShardDatasource),
    with the configured transforms fused into the read."""
    import ray.data

    from pipelines.transforms import apply_transforms

    # One output block per shard (split further only by DataContext.target_max_block_size): Ray
    # Data would otherwise cut every shard into pieces to reach its 200-block minimum, and each
    # block costs a fixed overhead on its way to the workers (measured: 1.6x the rows/s with 16
    # shards).
    ds = ray.data.read_datasource(source, concurrency=cfg.read_parallelism,
                                  override_num_blocks=shards)
    if cfg.transforms:
        # batch_size=None: whole blocks, fused into the read task (no extra hop through the
        # object store).
        transform = functools.partial(apply_transforms, transforms=cfg.transforms,
                                      features=cfg.features)
        ds = ds.map_batches(transform, batch_format="pyarrow", batch_size=None,
                            zero_copy_batch=True)
    return ds
