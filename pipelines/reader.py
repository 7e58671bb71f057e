"""The Ray Data source that streams Parquet shards from local disk or S3, optionally through the
disk cache.

One read task per shard, created when an epoch's execution starts (see `order.py`), in that epoch's
shard order; with `preserve_order` Ray Data hands blocks to `streaming_split` in that order. A task
opens its shard through the cache (or straight from the store) and yields record batches as it
decodes them, so blocks flow through the object store and nothing holds the dataset.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from pipelines.cache import DiskCache
from pipelines.errors import DataError, corrupt_parquet
from pipelines.order import ShardOrder, current_epoch, shard_order
from pipelines.rest import with_row_ids
from pipelines.storage import ObjectInfo, Storage, storage_error


def read_shard(storage: Storage, obj: ObjectInfo, cache: DiskCache | None, columns: list[str],
               batch_rows: int, first_row: int | None = None) -> Iterator[pa.Table]:
    """Decode one shard batch by batch (the read task body); with `first_row` (the shard's first
    row's index in the dataset) each row carries its id (rest.ROW_ID)."""
    try:
        source = (cache.open(storage, obj) if cache
                  else storage.filesystem().open_input_file(obj.path))
        with source:
            # pre_buffer coalesces the column-chunk reads: fewer round trips to an object store.
            parquet = pq.ParquetFile(source, pre_buffer=storage.remote)
            for batch in parquet.iter_batches(batch_size=batch_rows, columns=columns,
                                              use_threads=False):
                table = pa.Table.from_batches([batch])
                if first_row is not None:
                    table, first_row = with_row_ids(table, first_row), first_row + table.num_rows
                yield table
    except pa.ArrowInvalid as exc:
        raise corrupt_parquet(storage.uri_of(obj.path), exc) from None
    except OSError as exc:
        if storage.remote:
            raise storage_error(exc, storage, "reading", obj.path) from None
        raise


class ShardDatasource(Datasource):
    """Parquet shards in (seed, epoch) order; re-lists remote objects each epoch when caching, so a
    shard whose size/ETag changed is re-fetched rather than served stale. `row_ids`: each row
    carries its index in the shards in their given (name) order (rest.ROW_ID), whatever the epoch's
    order."""

    def __init__(self, storage: Storage, objects: list[ObjectInfo], file_rows: list[int],
                 columns: list[str], *, order: ShardOrder | None = None,
                 cache: DiskCache | None = None, block_bytes: int = 16 << 20,
                 row_ids: bool = False) -> None:
        self.storage = storage
        self.objects = objects
        self.rows = dict(zip([o.path for o in objects], file_rows, strict=True))
        self.columns = columns
        self.order = order or ShardOrder()  # None: the shards' own order
        self.cache = cache
        self.block_bytes = block_bytes
        starts = np.cumsum([0, *file_rows])[:-1].tolist() if row_ids else [None] * len(objects)
        self.first_rows = dict(zip([o.path for o in objects], starts, strict=True))

    def estimate_inmemory_data_size(self) -> int | None:
        return sum(o.size for o in self.objects)

    def _current_objects(self) -> list[ObjectInfo]:
        if self.cache is None or not self.storage.remote:
            return self.objects
        listed = {o.path: o for o in self.storage.list_objects(".parquet")}
        gone = [o.path for o in self.objects if o.path not in listed]
        if gone:
            raise DataError(f"shard(s) {[self.storage.uri_of(p) for p in gone[:3]]} disappeared "
                            "during the run: do not delete training data while training")
        return [listed[o.path] for o in self.objects]

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        order = self.order
        epoch = current_epoch(order.epoch_clock) if order.shuffle else 0
        context_max = getattr(data_context, "target_max_block_size", None)
        target = min(self.block_bytes, context_max or self.block_bytes)
        tasks = []
        for obj in shard_order(self._current_objects(), order.seed, epoch, order.shuffle):
            rows = self.rows.get(obj.path, 0)
            # Yield blocks near the target block size: small blocks keep memory bounded while
            # streaming.
            batch_rows = max(256, min(65536, target * max(rows, 1) // max(obj.size * 2, 1)))
            read = functools.partial(read_shard, self.storage, obj, self.cache, self.columns,
                                     batch_rows, self.first_rows.get(obj.path))
            meta = BlockMetadata(num_rows=rows, size_bytes=obj.size,
                                 input_files=(self.storage.uri_of(obj.path),), exec_stats=None)
            tasks.append(ReadTask(read, meta, per_task_row_limit=per_task_row_limit))
        return tasks
