"""Finishing an epoch with a group of another size: the ids of the rows trained so far, and the rest
of the epoch cut anew for the group that finishes it.

Each training row carries its id (ROW_ID: its index in the dataset's shards in name order, set as
its shard is read) as far as the rank's loop, which records the ids it trains on and drops the
column before the model sees the batch. A checkpoint keeps the union of every rank's ids of the
epoch in progress. A group of another size (an elastic resize, `--resume` with another
scaling.num_workers), or one fed in another epoch order, cannot use the ranks' row counts: Ray
Data's equal split hands rows out in blocks whose assignment depends on the worker count. Instead
every rank reads the interrupted epoch whole, drops the rows already trained on, and cuts what is
left into rounds of `world x micro-batch` rows, the same on every rank; rank r trains the r-th
micro-batch of each round. Every row of the epoch is trained exactly once: only the incomplete last
round (fewer rows than one micro-step of the group) is left out, as the equal split leaves out `rows
mod workers` rows and each rank's incomplete last micro-batch. The epoch after it starts as usual.
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

    ids = np.arange(first, first + table.num_rows, dtype=np.int64)
    return table.append_column(ROW_ID, pa.array(ids))


def pack_ids(ids: np.ndarray) -> torch.Tensor:
    """A set of row ids as a compressed bitmap (uint8 tensor: what a checkpoint loads with
    weights_only)."""
    seen = SeenRows()
    seen.add(ids)
    return _compress(seen.bits)


def unpack_ids(packed: torch.Tensor) -> np.ndarray:
    """The sorted ids `pack_ids` packed."""
    return np.flatnonzero(np.unpackbits(_bits(packed)))


class SeenRows:
    """The ids of the rows a rank has trained on in the epoch in progress (with those a resumed
    epoch's checkpoint had seen before), as a bitmap: one bit per row of the dataset however the
    rows come, so an epoch of a billion rows takes 125 MB at most. `known` turns false for good once
    a batch comes without ids (a `call` transform that changed the row count): a checkpoint then
    keeps none, and a resize finishes the epoch early instead."""

    def __init__(self) -> None:
        self.bits = np.zeros(0, np.uint8)
        self.known = True

    def add(self, ids: torch.Tensor | np.ndarray | None) -> None:
        if ids is None:
            self.known = False
            return
        ids = np.asarray(ids.numpy() if hasattr(ids, "numpy") else ids, dtype=np.int64)
        if not self.known or not len(ids):
            return
        if (need := int(ids.max()) // 8 + 1) > len(self.bits):  # grown by half at least: few copies
            grown = np.zeros(max(need - len(self.bits), len(self.bits) // 2), np.uint8)
            self.bits = np.concatenate([self.bits, grown])
        np.bitwise_or.at(self.bits, ids >> 3, (128 >> (ids & 7)).astype(np.uint8))

    def clear(self) -> None:
        self.bits = np.zeros(0, np.uint8)

    def ids(self) -> np.ndarray | None:
        """This rank's ids, sorted (None when not known)."""
        return np.flatnonzero(np.unpackbits(self.bits)) if self.known else None

    def packed(self) -> torch.Tensor | None:
        """What a rank hands to a checkpoint: its bitmap compressed (None when not known)."""
        return _compress(self.bits) if self.known else None


def union_packed(per_rank: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Every rank's packed ids of the epoch as one packed set; None if any rank's are not known."""
    if any(packed is None for packed in per_rank):
        return None
    maps = [_bits(packed) for packed in per_rank]  # type: ignore[arg-type]
    union = np.zeros(max((len(m) for m in maps), default=0), np.uint8)
    for bits in maps:
        union[:len(bits)] |= bits
    return _compress(union)


def _compress(bits: np.ndarray) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(zlib.compress(bits.tobytes(), 1)), dtype=torch.uint8)


def _bits(packed: torch.Tensor) -> np.ndarray:
    return np.frombuffer(zlib.decompress(packed.numpy().tobytes()), dtype=np.uint8)


def rest_of_epoch(chunks: Iterable[Batch], seen: np.ndarray, rank: int, world: int,
                  micro: Callable[[], int],
                  trim: Callable[[Batch], Batch] = lambda batch: batch) -> Iterator[Batch]:
    """This rank's micro-batches of the rows of `chunks` (the whole epoch, in the same order on
    every rank) whose ids are not in `seen` (sorted): rank `rank`'s slice of each complete round of
    `world * micro()` such rows (`micro` read before each round: an autopilot re-cut takes effect
    from the next one)."""
    import torch

    from pipelines.tensors import cat_rows, rows, take

    pending: Batch | None = None
    for chunk in chunks:
        if ROW_ID not in chunk:
            raise RuntimeError("the epoch's rows came without their ids: it "
                               "cannot be finished without repeating some")
        keep = ~np.isin(chunk[ROW_ID].numpy(), seen)
        if not keep.all():
            chunk = take(chunk, torch.from_numpy(np.flatnonzero(keep)))
        pending = chunk if pending is None else cat_rows([pending, chunk])
        while rows(pending) >= (size := micro()) * world:
            yield trim(take(pending, slice(rank * size, (rank + 1) * size)))
            pending = take(pending, slice(size * world, None))
