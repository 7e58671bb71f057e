"""Turning Arrow record batches into the micro-batches of named tensors the loop trains on: the
collate, the slicing into micro-batches and the replay of a kept pass (feed.py hands them to a rank,
epoch by epoch)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipelines.config import DataConfig
from pipelines.errors import DataError
from pipelines.rest import ROW_ID
from pipelines.tensors import (
    IGNORE_INDEX,
    LABELS,
    Batch,
    EpochBuffers,
    Padded,
    Padding,
    cat_rows,
    column_array,
    pinned,
    rows,
    take,
    tensor,
)

if TYPE_CHECKING:
    # imported where read: the host-to-device path runs on a machine without Arrow (GPU check)
    import pyarrow as pa

try:
    from ray.data.collate_fn import ArrowBatchCollateFn
# no Ray (the GPU check's torch tier): only Ray Data reads the base class (Arrow batches in)
except ImportError:
    ArrowBatchCollateFn = object  # type: ignore[misc,assignment]


def padding_of(schema: pa.Schema, features: list[str], label: str | None, named: bool = False,
               multiple: int | None = None) -> Padding:
    """Which columns the collate of batches of `schema` pads together: with named inputs, each
    variable-length token column with its mask (`attention_mask` when it is the only one, else
    `<column>_mask`) and the labels of its tokens; the labels are the first token column itself
    without a label, else a variable-length label column tags the first token column's tokens (one
    label per token). A variable-length integer label column with no token column to follow (always
    so in the classic path) is padded alone. Decided once, before iteration: the collate checks each
    batch against it."""
    import pyarrow as pa

    variable = [name for name in features if named and _is_list(schema.field(name).type)]
    labelled = None  # the token column the labels are padded and trimmed with
    groups = []
    if label is None:
        labelled = features[0] if features[0] in variable else None
    elif _is_list(schema.field(label).type):
        if not pa.types.is_integer(schema.field(label).type.value_type):
            kind = schema.field(label).type.value_type
            raise DataError(f"label column '{label}' is a variable-length list of {kind}: "
                            f"only integer labels can be padded (with {IGNORE_INDEX}, "
                            "which losses ignore); make it a fixed-size list")
        labelled = variable[0] if variable else None
        if labelled is None:
            groups.append(Padded(LABELS))
    for name in variable:
        groups.append(Padded(name, "attention_mask" if len(variable) == 1 else f"{name}_mask",
                             (LABELS,) if name == labelled else ()))
    return Padding(tuple(groups), multiple)


def _is_list(kind: pa.DataType) -> bool:
    import pyarrow as pa

    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def collate_arrow(table: pa.Table, features: list[str], label: str | None, named: bool = False,
                  padding: Padding | None = None) -> Batch:
    """A fetched Arrow table as named tensors, the targets under `labels`.

    Classic (`named` false): the feature columns stacked into one float32 `x` (one tensor per batch
    is the fastest path into torch); without a label the single column holds token windows: x =
    tokens[:-1], labels = tokens[1:]. Named: every column by its name, as `column_array` converts
    it; a variable-length column brings its mask (`attention_mask` when it is the only one, else
    `<column>_mask`); without a label, `labels` are the tokens themselves with padding ignored (the
    model shifts, as Hugging Face models do). A variable-length label column is padded with
    IGNORE_INDEX to the width of the tokens it tags (`padding_of`).

    `padding`: the layout decided before iteration (`padding_of`); this batch must have it
    (DataError else). Nothing shared is written here: Ray Data runs this in threads of its own while
    the training thread trims."""
    expected = padding_of(table.schema, features, label, named,
                          padding.multiple if padding else None)
    if padding is not None and padding != expected:
        raise DataError(f"this batch pads {_padded_keys(expected)} but the train sample's "
                        f"schema, read before iteration, padded {_padded_keys(padding)}: a "
                        "column is a variable-length list in one and not in the other (a "
                        "data.transforms call changed its kind, or data.val's column kinds "
                        "differ from data.train's); keep each column's kind in every split")
    padding = expected
    if not named:
        if label is None:
            tokens = column_array(table.column(features[0]))[0]
            return {"x": tensor(tokens[:, :-1]), LABELS: tensor(tokens[:, 1:])}
        parts = [column_array(table.column(name))[0].reshape(table.num_rows, -1)
                 .astype(np.float32, copy=False)
                 for name in features]
        x = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
        return {"x": tensor(x), LABELS: tensor(_labels(table, label, padding, {}))}
    # Only numpy here, no torch op: this runs in Ray Data's threads, and one parallel torch op there
    # would start a second intra-op thread pool, which slows every op of the training thread (to
    # 0.6x, measured).
    arrays: dict[str, np.ndarray] = {}
    masks: dict[str, np.ndarray] = {}
    for name in features:
        arrays[name], mask = column_array(table.column(name), padding.multiple)
        if mask is not None:
            masks[name] = mask
    for group in padding.groups:
        if group.mask is not None:
            arrays[group.mask] = masks[group.column]
    if label is not None:
        arrays[LABELS] = _labels(table, label, padding, masks)
    else:
        labels = arrays[features[0]].copy()
        if features[0] in masks:
            labels[masks[features[0]] == 0] = IGNORE_INDEX
        arrays[LABELS] = labels
    return {key: tensor(value) for key, value in arrays.items()}


def _labels(table: pa.Table, label: str, padding: Padding,
            masks: dict[str, np.ndarray]) -> np.ndarray:
    """The label column; a variable-length one padded with IGNORE_INDEX to the width of the tokens
    it tags."""
    values, mask = column_array(table.column(label), padding.multiple)
    if mask is None:
        return values
    values = np.where(mask == 1, values, IGNORE_INDEX)
    tokens = next((g for g in padding.groups if LABELS in g.along), None)
    if tokens is None:
        return values
    # Trimmed with its tokens: a label past its row's last token would be cut off, so such rows are
    # refused.
    token_mask = masks[tokens.column]
    longer = np.flatnonzero(mask.sum(axis=1) > token_mask.sum(axis=1))
    if len(longer):
        raise DataError(f"label column '{label}' has more labels than '{tokens.column}' has "
                        f"tokens in {len(longer)} row(s): a variable-length label tags the "
                        "tokens of its row, one each; pad or cut the labels to the tokens")
    return np.pad(values, ((0, 0), (0, token_mask.shape[1] - values.shape[1])),
                  constant_values=IGNORE_INDEX)


def _padded_keys(padding: Padding) -> list[list[str]]:
    return [list(group.keys) for group in padding.groups]


def collate_sample(table: pa.Table, data: DataConfig, named: bool) -> Batch:
    """A few rows (the driver's sample of the training data) collated as the workers collate their
    batches: for the driver's checks, the workers' memory probe and the logged model's input
    example."""
    padding = padding_of(table.schema, data.features, data.label, named, data.pad_to_multiple_of)
    return collate_arrow(table, data.features, data.label, named, padding)


@dataclass(frozen=True)
class Sample:
    """The driver's sample rows collated as the workers collate them (`batch`), or why they cannot
    be (`error`, the collate's ValueError), and the mask the collate gives each padded column
    ({column: mask key})."""

    batch: Batch | None
    error: str | None = None
    masks: dict[str, str] = field(default_factory=dict)


def inspect_sample(table: pa.Table, data: DataConfig, named: bool) -> Sample:
    """collate_sample, kept with its padding's masks or its error: what the driver's model checks
    read."""
    try:
        padding = padding_of(table.schema, data.features, data.label, named,
                             data.pad_to_multiple_of)
        batch = collate_arrow(table, data.features, data.label, named, padding)
    except ValueError as exc:
        return Sample(None, str(exc))
    return Sample(batch, None, {g.column: g.mask for g in padding.groups if g.mask is not None})


class FeatureCollate(ArrowBatchCollateFn):
    """Collate for `iter_torch_batches`: Arrow batch in, named tensors out (on the host: RankBatches
    cuts them there). Holds only immutable settings: Ray Data calls it in threads of its own."""

    def __init__(self, features: list[str], label: str | None, named: bool = False,
                 padding: Padding | None = None) -> None:
        super().__init__()
        self.features, self.label, self.named = list(features), label, named
        self.padding = padding

    def __call__(self, batch: pa.Table) -> Batch:
        out = collate_arrow(batch, self.features, self.label, self.named, self.padding)
        # the rows' ids travel with them as far as the loop (pipelines/rest.py)
        if ROW_ID in batch.column_names:
            out[ROW_ID] = torch.from_numpy(batch.column(ROW_ID).to_numpy())
        return out


# Ray Data costs about 2.5 ms per batch handed to a worker, whatever its size (measured: 0.35-0.48M
# rows/s at 256 rows, 1.3M rows/s at 1024), so workers fetch large chunks and slice micro-batches
# out of them as views.
FETCH_ROWS = 4096


def fetch_size(micro_batch_size: int) -> int:
    """Rows per fetch from Ray Data: a whole number of micro-batches, at least one, about
    FETCH_ROWS."""
    return micro_batch_size * max(1, FETCH_ROWS // micro_batch_size)


def split_batches(chunks: Iterable[Batch], size: int | Callable[[], int], drop_last: bool,
                  padding: Padding | None = None, start: int = 0) -> Iterator[Batch]:
    """Slice fetched chunks into batches of `size` rows from row `start` on, each trimmed to its own
    longest sequence. `size` may be a function, read before each batch: a size changed mid-pass (the
    autopilot's micro-batch) takes effect from the next batch, the rows a chunk has left carried
    into the next chunk's. Only the epoch's last chunk can be short (chunks are fetched without
    drop_last), so with drop_last exactly the rows of an incomplete final batch are dropped."""
    trim = padding.trim if padding is not None else (lambda batch: batch)
    size_now = size if callable(size) else (lambda: size)
    rest: Batch | None = None
    for chunk in chunks:
        count = rows(chunk)
        if start >= count:  # before the first row handed out
            start -= count
            continue
        if rest is not None:
            chunk, rest = cat_rows([rest, chunk]), None
            count = rows(chunk)
        while start < count:
            n = size_now()
            # a chunk that is one whole batch (a replayed pass): as it is
            if start == 0 and count == n:
                yield trim(chunk)
                start = count
            elif start + n > count:
                rest = take(chunk, slice(start, count))
                break
            else:
                yield trim(take(chunk, slice(start, start + n)))
                start += n
        start = 0
    if rest is not None and not drop_last:
        yield trim(rest)


class EpochReplay:
    """Keeps the rows of one complete pass to hand them out again. For a small dataset held in
    memory (`cache: memory|auto`), whose order is the same every epoch, replaying costs nothing,
    while restarting Ray Data's streaming_split costs ~0.1-0.3 s per epoch: most of an epoch's time
    for a small dataset. With `keep` false every pass streams.

    `stream()` gives the pass as fetched (chunks of any size); the replay cuts it into micro-batches
    of `micro` rows (read before each one: `resize` takes effect from the next micro-batch,
    mid-epoch too, no row lost) from the epoch's row `start` on (a resumed epoch starts where its
    checkpoint left it, cut as the interrupted run cut it). Only whole micro-batches are handed out:
    the rows of the epoch's incomplete last one are left out of it. Without `micro`, the batches are
    handed out as streamed, the short last one included (validation).

    `reshuffle(epoch)` gives the seed of a later epoch's order: this rank's pass permuted (epoch 0
    is the pass as streamed), so the rows an epoch left out are drawn into later ones like any
    other, as streaming in a new shard order would. An epoch's order depends only on the pass and
    the seed, so a worker that starts inside a later epoch (a restart) reads the pass first and then
    hands out exactly the batches an uninterrupted worker would have. A later epoch is gathered
    once, into host buffers reused from epoch to epoch (EpochBuffers: two at most while nothing
    holds older batches), and handed out as views, with no per-micro-batch gather. The rows stay in
    host memory, never a second copy of the pass on the device. With `pin` (a GPU rank) the kept
    rows are pinned and every batch is handed out pinned and contiguous, which the loop's copy to
    the device takes without waiting: a view of pinned rows as it is, a trimmed (strided) view or
    one joined across two chunks copied into pinned memory."""

    def __init__(self, keep: bool, reshuffle: Callable[[int], int] | None = None,
                 micro: int | None = None, padding: Padding | None = None,
                 pin: bool = False) -> None:
        self.keep, self.pin = keep, pin
        self.reshuffle = reshuffle
        self.micro = micro
        self.padding = padding
        self.rows: Batch | None = None  # the kept pass, in one batch
        self.buffers = EpochBuffers(pin)  # a later epoch's order of it
        self.size = micro  # rows per batch handed out: `micro`, else the first streamed batch's

    def __call__(self, stream: Callable[[], Iterable[Batch]], epoch: int = 0,
                 start: int = 0) -> Iterator[Batch]:
        """`epoch`'s micro-batches from its row `start` on: the kept pass in that epoch's order if
        there is one; else a new `stream()`, kept when `keep`. A pass left unfinished (training
        ended mid-epoch) is not kept."""
        batches = self._batches(stream, epoch, start)
        return map(pinned, batches) if self.pin else batches

    def _batches(self, stream: Callable[[], Iterable[Batch]], epoch: int,
                 start: int) -> Iterator[Batch]:
        if not self.keep:
            yield from self._cut(stream(), start)
            return
        if self.rows is None and (epoch == 0 or self.reshuffle is None):
            seen: list[Batch] = []
            yield from self._cut(_recorded(stream(), seen), start)
            self._keep(seen)
            return
        if self.rows is None:
            self._keep(list(stream()))
        yield from self._serve(self._ordered(epoch), start)

    def resize(self, micro: int) -> None:
        """Hand out micro-batches of `micro` rows from the next one on (the autopilot's choice)."""
        self.micro = self.size = micro

    def _keep(self, seen: list[Batch]) -> None:
        if seen:
            # replayed as views of these rows
            self.rows = pinned(cat_rows(seen)) if self.pin else cat_rows(seen)
            self.size = self.size or rows(seen[0])

    def _cut(self, batches: Iterable[Batch], start: int) -> Iterator[Batch]:
        if self.micro is None:  # handed out as streamed
            assert start == 0, "only micro-batches of a known size start mid-epoch"
            return iter(batches)
        return (batch  # type: ignore[arg-type, return-value]
                for batch in split_batches(batches, lambda: self.micro, False, self.padding, start)
                if rows(batch) == self.micro)

    def _ordered(self, epoch: int) -> Batch:
        """The kept rows in `epoch`'s order, gathered once."""
        assert self.rows is not None
        if self.reshuffle is None or epoch == 0:
            return self.rows
        generator = torch.Generator().manual_seed(self.reshuffle(epoch))
        order = torch.randperm(rows(self.rows), generator=generator)
        return self.buffers.gather(self.rows, order)  # pinned like the kept rows

    def _serve(self, epoch_rows: Batch, start: int) -> Iterator[Batch]:
        """Views of `epoch_rows`, each `size` rows (read before each), from row `start` on; without
        `micro` the short last batch too."""
        trim = self.padding.trim if self.padding is not None else (lambda batch: batch)
        total, position = rows(epoch_rows), start
        while position < total:
            size = self.size or total
            if position + size > total and self.micro is not None:
                return
            yield trim(take(epoch_rows, slice(position, position + size)))
            position += size


def _recorded(batches: Iterable[Batch], seen: list[Batch]) -> Iterator[Batch]:
    for batch in batches:
        seen.append(batch)
        yield batch
