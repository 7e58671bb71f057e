"""Finishing an epoch with a group of another size: the ids of the rows trained so far, and the rest of the epoch
cut anew for the group that finishes it.

Each training row carries its id (ROW_ID: its index in the dataset's shards in name order, set as its shard is
read) as far as the rank's loop, which records the ids it trains on and drops the column before the model sees the
batch. A checkpoint keeps the union of every rank's ids of the epoch in progress. A group of another size (an
elastic resize, `--resume` with another scaling.num_workers), or one fed in another epoch order, cannot use the
ranks' row counts: Ray Data's equal split hands rows out in blocks whose assignment depends on the worker count.
Instead every rank reads the interrupted epoch whole, drops the rows already trained on, and cuts what is left
into rounds of `world x micro-batch` rows, the same on every rank; rank r trains the r-th micro-batch of each round.
Every row of the epoch is trained exactly once: only the incomplete last round (fewer rows than one micro-step of
the group) is left out, as the equal split leaves out `rows mod workers` rows and each rank's incomplete last
micro-batch. The epoch after it starts as usual.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the driver's readers import this module before they need torch
    import pyarrow as pa
    import torch

    from pipelines.tensors import Batch

ROW_ID = "__row_id"  # the column (and batch key) of each training row's id


def with_row_ids(table: pa.Table, first: int) -> pa.Table:
    """`table` with ROW_ID numbering its rows from `first` on."""
    import pyarrow as pa

    return table.append_column(ROW_ID, pa.array(np.arange(first, first + table.num_rows, dtype=np.int64)))


def pack_ids(ids: np.ndarray) -> torch.Tensor:
    """A set of row ids as a compressed bitmap (uint8 tensor: what a checkpoint loads with weights_only)."""
    import torch

    bits = np.zeros(int(ids.max()) + 1 if len(ids) else 0, dtype=bool)
    bits[ids] = True
    packed = zlib.compress(np.packbits(bits).tobytes(), 1)
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8)


def unpack_ids(packed: torch.Tensor) -> np.ndarray:
    """The sorted ids `pack_ids` packed."""
    return np.flatnonzero(np.unpackbits(np.frombuffer(zlib.decompress(packed.numpy().tobytes()), dtype=np.uint8)))


class SeenRows:
    """The ids of the rows a rank has trained on in the epoch in progress (with those a resumed epoch's checkpoint
    had seen before). `known` turns false for good once a batch comes without ids (a `call` transform that
    changed the row count): a checkpoint then keeps none, and a resize finishes the epoch early instead."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.known = True

    def add(self, ids: torch.Tensor | np.ndarray | None) -> None:
        if ids is None:
            self.known = False
        elif self.known:
            self.parts.append(ids.numpy() if hasattr(ids, "numpy") else ids)

    def clear(self) -> None:
        self.parts = []

    def ids(self) -> np.ndarray | None:
        """This rank's ids (None when not known)."""
        if not self.known:
            return None
        return np.concatenate(self.parts) if self.parts else np.zeros(0, np.int64)


def union_packed(per_rank: list[np.ndarray | None]) -> torch.Tensor | None:
    """Every rank's ids of the epoch as one packed set; None if any rank's are not known."""
    if any(ids is None for ids in per_rank):
        return None
    return pack_ids(np.unique(np.concatenate(per_rank)))  # type: ignore[arg-type]


def rest_of_epoch(chunks: Iterable[Batch], seen: np.ndarray, rank: int, world: int, micro: Callable[[], int],
                  trim: Callable[[Batch], Batch] = lambda batch: batch) -> Iterator[Batch]:
    """This rank's micro-batches of the rows of `chunks` (the whole epoch, in the same order on every rank) whose
    ids are not in `seen` (sorted): rank `rank`'s slice of each complete round of `world * micro()` such rows
    (`micro` read before each round: an autopilot re-cut takes effect from the next one)."""
    import torch

    from pipelines.tensors import cat_rows, rows, take

    pending: Batch | None = None
    for chunk in chunks:
        if ROW_ID not in chunk:
            raise RuntimeError("the epoch's rows came without their ids: it cannot be finished without repeating some")
        keep = ~np.isin(chunk[ROW_ID].numpy(), seen)
        if not keep.all():
            chunk = take(chunk, torch.from_numpy(np.flatnonzero(keep)))
        pending = chunk if pending is None else cat_rows([pending, chunk])
        while rows(pending) >= (size := micro()) * world:
            yield trim(take(pending, slice(rank * size, (rank + 1) * size)))
            pending = take(pending, slice(size * world, None))
