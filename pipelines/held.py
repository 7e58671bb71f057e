"""Small data to replay, handed to the ranks without Ray Data's streaming split.

The driver reads such data itself (datasets.READ_HERE_BYTES) and holds its blocks in the object
store. Each rank takes its part of the rows straight from them (equal parts to train on, every row
once to validate on): Ray Data's split coordinator would start its first execution when the ranks
first ask, and every rank would wait at its epoch barrier (1.3-2.6 s of the first batch on 2 cores),
to hand out rows each worker replays from its own memory after the first pass anyway
(batches.EpochReplay).
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
    """A small dataset's blocks in the object store (ObjectRefs of Arrow tables), in the dataset's
    row order."""

    refs: list[Any]

    def shard(self, rank: int, world: int, device: torch.device, *,
              equal: bool = True) -> HeldShard:
        return HeldShard(self.refs, rank, world, device, equal=equal)


def rank_rows(rows: int, rank: int, world: int, equal: bool) -> tuple[int, int]:
    """(first row, row count) of rank `rank`'s contiguous part of `rows` rows. `equal`: `rows //
    world` each, the last `rows mod world` left out; else every row on exactly one rank, the first
    `rows mod world` ranks one more."""
    each, extra = divmod(rows, world)
    if equal:
        return rank * each, each
    return rank * each + min(rank, extra), each + (rank < extra)


class HeldShard:
    """Rank `rank`'s part of the rows, iterated as a Ray Data shard is: the rows in block order cut
    into `world` contiguous parts. `equal` (training): equal parts, the last `rows mod world` left
    out (as many as streaming_split(equal=True) leaves out), so the ranks' collectives stay aligned.
    Not `equal` (validation): every row scored exactly once, the accuracy the same at any world
    size; `evaluate` adds the ranks' sums, so their row counts may differ by one."""

    def __init__(self, refs: list[Any], rank: int, world: int, device: torch.device, *,
                 equal: bool = True) -> None:
        self.refs, self.rank, self.world, self.device, self.equal = refs, rank, world, device, equal
        self._rows: pa.Table | None = None

    def rows(self) -> pa.Table:
        if self._rows is None:
            import ray

            tables = ray.get(self.refs)
            table = pa.concat_tables(tables) if tables else pa.table({})
            self._rows = table.slice(*rank_rows(table.num_rows, self.rank, self.world, self.equal))
        return self._rows

    def iter_torch_batches(self, *, batch_size: int, collate_fn: Callable[[pa.Table], Batch],
                           local_shuffle_buffer_size: int | None = None, device: Any = "auto",
                           pin_memory: bool = False, **_: Any) -> Iterator[Batch]:
        """Ray Data's iter_torch_batches over this rank's rows: `batch_size` rows at a time (the
        last may be shorter), collated, on `device` ("auto": the rank's), pinned when asked. Held
        data has no shuffle buffer (trainer.build_inputs)."""
        from pipelines.tensors import pinned, to_device  # torch: in the rank's process only

        assert not local_shuffle_buffer_size, ("held data is replayed, never shuffled through a "
                                               "buffer")
        rows = self.rows()
        for start in range(0, rows.num_rows, batch_size):
            batch = collate_fn(rows.slice(start, batch_size))
            yield (to_device(batch, self.device) if device == "auto"
                   else pinned(batch) if pin_memory else batch)
