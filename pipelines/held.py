"""Small data to replay, handed to the ranks without Ray Data's streaming split.

The driver reads such data itself (datasets.READ_HERE_BYTES) and holds its blocks in the object store. Each rank
takes its equal part of the rows straight from them: Ray Data's split coordinator would start its first execution
when the ranks first ask, and every rank would wait at its epoch barrier (1.3-2.6 s of the first batch on 2 cores),
to hand out rows each worker replays from its own memory after the first pass anyway (batches.EpochReplay).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

if TYPE_CHECKING:  # the driver imports this module before it needs torch
    import torch

    from pipelines.tensors import Batch


@dataclass(frozen=True)
class HeldRows:
    """A small dataset's blocks in the object store (ObjectRefs of Arrow tables), in the dataset's row order."""

    refs: list[Any]

    def shard(self, rank: int, world: int, device: torch.device) -> HeldShard:
        return HeldShard(self.refs, rank, world, device)


class HeldShard:
    """Rank `rank`'s part of the rows, iterated as a Ray Data shard is: the rows in block order cut into `world`
    equal contiguous parts, the last `rows mod world` left out (as many as streaming_split(equal=True) leaves out):
    each rank has the same number of rows, so the ranks' collectives stay aligned."""

    def __init__(self, refs: list[Any], rank: int, world: int, device: torch.device) -> None:
        self.refs, self.rank, self.world, self.device = refs, rank, world, device
        self._rows: pa.Table | None = None

    def rows(self) -> pa.Table:
        if self._rows is None:
            import ray

            tables = ray.get(self.refs)
            table = pa.concat_tables(tables) if tables else pa.table({})
            each = table.num_rows // self.world
            self._rows = table.slice(self.rank * each, each)
        return self._rows

    def iter_torch_batches(self, *, batch_size: int, collate_fn: Callable[[pa.Table], Batch],
                           local_shuffle_buffer_size: int | None = None, **_: Any) -> Iterator[Batch]:
        """Ray Data's iter_torch_batches over this rank's rows: `batch_size` rows at a time (the last may be
        shorter), collated, on the rank's device. Held data has no shuffle buffer (trainer.build_inputs)."""
        from pipelines.tensors import to_device  # torch: in the rank's process only

        assert not local_shuffle_buffer_size, "held data is replayed, never shuffled through a buffer"
        rows = self.rows()
        for start in range(0, rows.num_rows, batch_size):
            yield to_device(collate_fn(rows.slice(start, batch_size)), self.device)
