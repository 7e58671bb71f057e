"""A rank's share of a dataset that every rank reads whole, for the splits Ray Train does not
split."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the driver imports pipelines before it needs torch
    from pipelines.tensors import Batch


class StridedShard:
    """Rows i with i % world == rank of a dataset every rank reads whole (Ray Train's unsplit
    iterator of it, in the dataset's order, which preserve_order makes the same on every rank). So
    every row is on exactly one rank at any world size: validation's figures then do not depend on
    it, where streaming_split(equal=True) leaves `rows mod world` rows out. Streamed: each rank
    reads and decodes every row, but keeps only its own, a fetch at a time."""

    def __init__(self, shard: Any, rank: int, world: int) -> None:
        self.shard, self.rank, self.world = shard, rank, world

    def iter_torch_batches(self, *, batch_size: int, pin_memory: bool = False,
                           **options: Any) -> Iterator[Batch]:
        """The whole dataset's batches of `batch_size * world` rows (about `batch_size` of them this
        rank's), each cut to this rank's rows, contiguous (pinned when asked). `options`: the
        wrapped iter_torch_batches'."""
        from pipelines.tensors import pinned, rows, take  # torch: in the rank's process only

        seen = 0  # rows of the dataset before this batch
        for batch in self.shard.iter_torch_batches(batch_size=batch_size * self.world, **options):
            first = (self.rank - seen) % self.world
            seen += rows(batch)
            if first < rows(batch):
                # a strided view: copied once, below
                mine = take(batch, slice(first, None, self.world))
                yield (pinned(mine) if pin_memory
                       else {key: value.contiguous() for key, value in mine.items()})
