"""Batches of named tensors: Arrow columns to tensors that keep their meaning, and the row
operations the readers and the loop share (slice, concatenate, trim padding). No Ray here: the loop
runs these in-process too."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    import pyarrow as pa

Batch = dict[str, torch.Tensor]
# the targets' key, whatever the label column is called (the name Hugging Face models take)
LABELS = "labels"
IGNORE_INDEX = -100  # padding in targets: counted neither in a loss nor in its normaliser


@dataclass
class Epoch:
    """One epoch's micro-batches from its row `start` on, cut there (set `start` before iterating):
    a source that can seek, so that a resumed epoch is cut exactly as the interrupted one was
    (training.loop.micro_batches)."""

    cut: Callable[[int], Iterator[Batch]]
    start: int = 0

    def __iter__(self) -> Iterator[Batch]:
        return self.cut(self.start)


def rows(batch: Batch) -> int:
    return len(next(iter(batch.values())))


def take(batch: Batch, index: slice | torch.Tensor) -> Batch:
    """The same rows of every tensor (a view for a slice)."""
    return {key: value[index] for key, value in batch.items()}


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch on `device`; from pinned host memory the copy is queued without waiting
    (non_blocking)."""
    if device.type == "cpu":
        return batch
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def pinned(batch: Batch) -> Batch:
    """The batch in page-locked, contiguous host memory, from which a copy to a GPU is queued
    without waiting (from pageable or strided memory torch stages the copy through a pageable
    buffer, and the host waits for the device). Tensors that are both already are kept as they are
    (views of a pinned chunk)."""
    return {key: (value if value.is_contiguous() and value.is_pinned()
                  else value.contiguous().pin_memory())
            for key, value in batch.items()}


class EpochBuffers:
    """Host buffers that a replayed pass is gathered into in each later epoch's order (`gather`),
    reused from epoch to epoch: one gather straight into them, instead of a new copy of the pass per
    epoch (and, pinned, a second one to pin it). Two of them: the loop still holds the last epoch's
    final micro-batch when it asks for the next epoch, so each epoch is written into the buffer of
    the one before the last. A buffer is rewritten only when nothing reads it any more: no tensor
    views it (its storage's use count: a step may hold micro-batches of several short epochs, and on
    the CPU they are the very tensors it computes on), and, pinned (a GPU rank), no copy from it to
    the device is still queued (an event recorded on the current stream, the rank's device's, when
    the next epoch is asked for: by then the loop has queued the copy of every batch it was handed;
    usually long passed when the buffer's turn comes again). A buffer still viewed is replaced by a
    new one, never written."""

    KEPT = 2

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.kept: list[_Buffer] = []  # least recently gathered into first

    def gather(self, batch: Batch, order: torch.Tensor) -> Batch:
        """`batch`'s rows in `order` (a permutation of them), in a buffer of these; handed out as
        views of it, so the epoch's own hand-out counts as a use of the buffer until it ends."""
        if self.pin and self.kept and torch.cuda.is_available():
            self.kept[-1].copied = torch.cuda.Event()
            self.kept[-1].copied.record()
        buffer = self._free(batch)
        for key, value in batch.items():
            torch.index_select(value, 0, order, out=buffer.rows[key])
        self.kept.append(buffer)
        return {key: value[:] for key, value in buffer.rows.items()}

    def _free(self, batch: Batch) -> _Buffer:
        """A buffer nothing reads, the least recently used first; the last epoch's only once there
        are two (copies from its last batches may still be queued); else a new one, in place of the
        oldest when both are viewed."""
        for buffer in self.kept:
            if (buffer is not self.kept[-1] or len(self.kept) == self.KEPT) and buffer.unviewed():
                self.kept.remove(buffer)
                if buffer.copied is not None and not buffer.copied.query():
                    buffer.copied.synchronize()  # a copy from it has yet to run
                return buffer
        if len(self.kept) == self.KEPT:
            self.kept.pop(0)  # its viewers keep its memory until they are done with it
        return _Buffer.like(batch, self.pin)


@dataclass
class _Buffer:
    rows: Batch
    alone: dict[str, int]  # each tensor's storage use count with nothing viewing it
    copied: torch.cuda.Event | None = None  # pinned: recorded once every copy from it was queued

    @classmethod
    def like(cls, batch: Batch, pin: bool) -> _Buffer:
        rows = {key: torch.empty(value.shape, dtype=value.dtype) for key, value in batch.items()}
        if pin:  # once per buffer; Tensor.pin_memory, which a CPU torch's tests stand in for
            rows = {key: value.pin_memory() for key, value in rows.items()}
        return cls(rows, {key: _uses(value) for key, value in rows.items()})

    def unviewed(self) -> bool:
        return _USE_COUNT is not None and all(_uses(value) <= self.alone[key]
                                              for key, value in self.rows.items())


# How many tensors hold a storage (a tensor and each of its views): torch's own count, private. A
# torch without it takes no buffer for unviewed: each epoch then gathers into a new one, as a gather
# per epoch did.
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _uses(tensor: torch.Tensor) -> int:
    return _USE_COUNT(tensor.untyped_storage()._cdata) if _USE_COUNT is not None else 0


def chunk(batch: Batch, pieces: int) -> list[Batch]:
    """`pieces` row-wise parts (fewer when there are fewer rows), as torch.chunk cuts."""
    parts = {key: value.chunk(pieces) for key, value in batch.items()}
    return [{key: parts[key][i] for key in batch} for i in range(len(next(iter(parts.values()))))]


def pad_value(key: str) -> int:
    return IGNORE_INDEX if key == LABELS else 0


def cat_rows(batches: list[Batch]) -> Batch:
    """Rows of several batches in one; padded sequence tensors of different widths are padded to the
    widest."""
    out = {}
    for key in batches[0]:
        values = [b[key] for b in batches]
        width = max(v.shape[1] if v.dim() > 1 else 0 for v in values)
        if any(v.dim() > 1 and v.shape[1] != width for v in values):
            values = [torch.nn.functional.pad(v, (0, width - v.shape[1]), value=pad_value(key))
                      for v in values]
        out[key] = torch.cat(values)
    return out


@dataclass(frozen=True)
class Padded:
    """One variable-length column of a batch, padded to the longest row of its fetch: `column` (its
    key in the batch), its 0/1 mask under `mask` and the keys padded to the same width with it
    (`along`: the labels of its tokens). A label column with no tokens to follow (`mask` None) is
    padded with IGNORE_INDEX, and its real positions are its length."""

    column: str
    mask: str | None = None
    along: tuple[str, ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.column, *((self.mask,) if self.mask else ()), *self.along)


@dataclass(frozen=True)
class Padding:
    """Which columns are padded together (`groups`), decided from the schema before iteration, and
    the multiple their widths are rounded up to. The collate pads each group to the longest row of
    the fetch; `trim` cuts each micro-batch back to its own longest row. Immutable: Ray Data
    collates in threads of its own while the training thread trims, so nothing the trim reads may be
    written during iteration."""

    groups: tuple[Padded, ...] = ()
    multiple: int | None = None

    def trim(self, batch: Batch) -> Batch:
        if not self.groups:
            return batch
        batch = dict(batch)
        for group in self.groups:
            longest = _longest(batch, group) if rows(batch) else 0
            width = min(self._rounded(longest), batch[group.column].shape[1])
            for key in group.keys:
                batch[key] = batch[key][:, :width]
        return batch

    def _rounded(self, width: int) -> int:
        return -(-width // self.multiple) * self.multiple if self.multiple else width


def _longest(batch: Batch, group: Padded) -> int:
    """The longest row's length, worked out in numpy: batches are trimmed on the host, before they
    go to the device (RankBatches fetches to the host), so reading a width never waits for a
    device."""
    if group.mask is not None:
        return int(batch[group.mask].numpy().sum(axis=1).max())
    # positions any row uses
    real = np.flatnonzero((batch[group.column].numpy() != IGNORE_INDEX).any(axis=0))
    return int(real[-1]) + 1 if len(real) else 0


def column_array(column: pa.ChunkedArray | pa.Array, pad_multiple: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray | None]:
    """A column as an array that keeps its meaning, and a mask for a variable-length list (else
    None): integers
    -> int64, floats and booleans -> float32, fixed-size lists -> one more dimension each, Ray Data
    tensor columns -> their shape, variable-length integer lists -> padded (rows x longest) with a
    0/1 mask."""
    # here: the rows' tensor operations run where no Arrow is installed (the GPU check)
    import pyarrow as pa

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    mask = None
    # Ray Data's tensor columns: to_numpy gives (rows, *shape)
    if isinstance(array.type, pa.ExtensionType):
        values = np.asarray(array.to_numpy(zero_copy_only=False))
        if values.dtype == object:
            raise ValueError(f"column of type {array.type} holds tensors "
                             "of different shapes; pad them to one")
    elif pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        values, mask = _padded(array, pad_multiple)
    else:
        shape = []
        while pa.types.is_fixed_size_list(array.type):
            shape.append(array.type.list_size)
            array = array.flatten()  # honours the array offset; .values would not after slicing
        values = array.to_numpy(zero_copy_only=False).reshape(-1, *shape)
    if np.issubdtype(values.dtype, np.integer):
        values = values.astype(np.int64, copy=False)
    elif np.issubdtype(values.dtype, np.floating) or values.dtype == np.bool_:
        values = values.astype(np.float32, copy=False)
    else:
        raise ValueError(f"column of type {column.type} is not numeric")
    return values, mask


def _padded(array: pa.Array, multiple: int | None) -> tuple[np.ndarray, np.ndarray]:
    offsets = array.offsets.to_numpy()
    lengths = np.diff(offsets)
    flat = array.flatten().to_numpy(zero_copy_only=False)
    width = int(lengths.max()) if len(lengths) else 0
    if multiple:
        width = -(-width // multiple) * multiple
    out = np.zeros((len(array), width), dtype=flat.dtype)
    mask = np.zeros((len(array), width), dtype=np.int64)
    row = np.repeat(np.arange(len(array)), lengths)
    position = np.arange(len(flat)) - np.repeat(offsets[:-1] - offsets[0], lengths)
    out[row, position] = flat
    mask[row, position] = 1
    return out, mask


def tensor(array: np.ndarray) -> torch.Tensor:
    # Arrow buffers are read-only; torch wants writable memory, and a copy of one batch is cheap.
    array = np.ascontiguousarray(array)
    return torch.from_numpy(array if array.flags.writeable else array.copy())
