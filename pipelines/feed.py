"""One rank's feed: the micro-batches it trains and validates on, epoch by epoch, in the order its
`RankOrder` says, cut from its dataset shards by batches.py's collate, slicing and replay."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pipelines.batches import EpochReplay, FeatureCollate, fetch_size, padding_of, split_batches
from pipelines.config import DataConfig
from pipelines.order import local_shuffle_seed, set_epoch
from pipelines.rest import rest_of_epoch
from pipelines.tensors import Batch, Epoch, Padding, pinned

if TYPE_CHECKING:
    # imported where read: the host-to-device path runs on a machine without Arrow (GPU check)
    import pyarrow as pa


class _Ahead:
    """A pass started in a thread of its own: the batches it fetched so far, then the rest of it."""

    def __init__(self, epoch: int, start: int, batches: Iterator[Batch]) -> None:
        self.epoch, self.start, self.batches = epoch, start, batches
        self.fetched: list[Batch] = []
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def fetch(self, count: int) -> None:
        try:
            self.fetched.extend(itertools.islice(self.batches, count))
        except BaseException as exc:  # raised in the training thread, where the pass is read
            self.error = exc

    def rest(self) -> Iterator[Batch]:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        yield from self.fetched
        # the generator goes on in this thread, where the fetching one left it
        yield from self.batches


@dataclass(frozen=True)
class RankOrder:
    """What decides the order of one rank's rows in each epoch: the run's `seed` and this `rank` (a
    shuffle is seeded per (seed, epoch, rank)), the epoch clock the train reader draws each epoch's
    shard order from (None: no clock), and `replay`: the rank's first pass kept and handed out again
    (permuted per epoch under data.shuffle) instead of streamed anew."""

    seed: int
    rank: int
    epoch_clock: str | None = None
    replay: bool = False


class RankBatches:
    """The micro-batches one rank trains and validates on, epoch by epoch: fetched from its Ray
    Train dataset shards in chunks of about FETCH_ROWS, sliced into micro-batches, the epoch's shard
    order set through the epoch clock, shuffled per (seed, epoch, rank) with a shuffle buffer, and
    small in-memory data replayed (EpochReplay), as `order` says. `schema`: the configured columns'
    (the driver's sample's), from which the padded columns are decided before iteration (None only
    for data without rows)."""

    def __init__(self, data: DataConfig, train_shard: Any, val_shard: Any | None,
                 micro_batch_size: int, order: RankOrder, named: bool = False,
                 schema: pa.Schema | None = None, pin_memory: bool = False) -> None:
        self.data, self.train_shard, self.val_shard = data, train_shard, val_shard
        self.pin_memory = pin_memory
        seed, rank, replay = order.seed, order.rank, order.replay
        self.micro, self.seed, self.rank = micro_batch_size, seed, rank
        self.epoch_clock = order.epoch_clock
        self.padding = (padding_of(schema, data.features, data.label, named,
                                   data.pad_to_multiple_of)
                        if schema is not None else Padding(multiple=data.pad_to_multiple_of))
        self.collate = FeatureCollate(data.features, data.label, named, self.padding)
        # Replayed only without a shuffle buffer (its order changes per epoch as it streams); with
        # data.shuffle each later epoch replays this rank's rows in a new order, seeded per (seed,
        # epoch, rank).
        reshuffle = (lambda epoch: local_shuffle_seed(seed, epoch, rank)) if data.shuffle else None
        # Streamed whole, the incomplete last micro-batch included: EpochReplay hands out whole
        # micro-batches only.
        self.replay_train = EpochReplay(keep=replay and not data.shuffle_buffer,
                                        reshuffle=reshuffle, micro=micro_batch_size,
                                        padding=self.padding, pin=pin_memory)
        self.replay_val = EpochReplay(keep=replay, pin=pin_memory)
        # the first batches, fetched while the model is built (prefetch)
        self.ahead: _Ahead | None = None
        self.rest: tuple[int, np.ndarray, Any, int] | None = None  # see finish

    def finish(self, epoch: int, seen: np.ndarray, whole: Any, world: int) -> None:
        """Train `epoch` as the rest of an epoch that a group of another size began
        (pipelines/rest.py): the rows of `whole` (the training data unsplit) whose ids are not in
        `seen`, cut in rounds over the `world` ranks."""
        self.rest = (epoch, seen, whole, world)

    def train(self, epoch: int) -> Epoch:
        """`epoch`'s micro-batches, from the row its `start` is set to (the loop sets it on a
        resume)."""
        return Epoch(lambda start: self._epoch(epoch, start))

    def prefetch(self, epoch: int, start: int, count: int) -> None:
        """Start fetching `epoch`'s first `count` micro-batches from row `start` in a thread of its
        own, while the worker builds its model: the pipeline's first read (Ray Data's first
        execution, the split's epoch barrier) then overlaps the set-up instead of following it. The
        loop's `train(epoch)` from that row begins with them."""
        ahead = _Ahead(epoch, start, self._pass(epoch, start))
        ahead.thread = threading.Thread(target=ahead.fetch, args=(count,), name="first batches",
                                        daemon=True)
        ahead.thread.start()
        self.ahead = ahead

    def _epoch(self, epoch: int, start: int) -> Iterator[Batch]:
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return self._pass(epoch, start)
        # the position comes from the same checkpoint: a bug
        if (ahead.epoch, ahead.start) != (epoch, start):
            raise RuntimeError(f"the first batches were fetched from epoch {ahead.epoch}, row "
                               f"{ahead.start}, but training starts at epoch {epoch}, row {start}")
        return ahead.rest()

    def _pass(self, epoch: int, start: int) -> Iterator[Batch]:
        if self.rest is None or self.rest[0] != epoch:
            return self.replay_train(lambda: self._stream_train(epoch), epoch, start)
        _, seen, whole, world = self.rest
        assert start == 0, "the rest of an epoch is counted from its own start"
        if self.epoch_clock:  # the whole data read in the interrupted epoch's shard order
            set_epoch(self.epoch_clock, epoch)
        batches = rest_of_epoch(self._chunks(whole), seen, self.rank, world, lambda: self.micro,
                                self.padding.trim)
        return map(pinned, batches) if self.pin_memory else batches

    def resize(self, micro: int) -> None:
        """Cut the training micro-batches at `micro` rows from the next one on, in this pass and
        every later one (the autopilot's choice: a step then takes whole micro-batches instead of
        joining or cutting them). The chunks keep their fetch size; the rows the position counts are
        the same."""
        self.micro = micro
        self.replay_train.resize(micro)

    def val(self) -> Iterator[Batch]:
        return self.replay_val(lambda: self._batches(self.val_shard, drop_last=False))

    def _stream_train(self, epoch: int) -> Iterable[Batch]:
        # Before this rank starts the epoch: the reader draws the epoch's shard order from the clock
        # once all ranks have arrived (streaming_split's epoch barrier), so a resumed run re-reads
        # the same order.
        if self.epoch_clock:
            set_epoch(self.epoch_clock, epoch)
        # Seeded per (seed, epoch, rank): a re-streamed epoch after a restart shuffles identically.
        seed = local_shuffle_seed(self.seed, epoch, self.rank) if self.data.shuffle_buffer else None
        # The chunks as fetched: EpochReplay cuts them. Every rank holds the same number of rows
        # (equal split), so dropping the incomplete last micro-batch leaves equal batch counts on
        # every rank and the collectives aligned.
        return self._chunks(self.train_shard, shuffle_seed=seed)

    def _chunks(self, shard: Any, shuffle_seed: int | None = None) -> Iterable[Batch]:
        # On the host: micro-batches are cut, trimmed and replayed there, and the loop copies each
        # to the device.
        return shard.iter_torch_batches(
            batch_size=fetch_size(self.micro), prefetch_batches=self.data.prefetch_batches,
            collate_fn=self.collate, device="cpu", pin_memory=self.pin_memory,
            local_shuffle_buffer_size=(self.data.shuffle_buffer if shuffle_seed is not None
                                       else None),
            local_shuffle_seed=shuffle_seed)

    def _batches(self, shard: Any, drop_last: bool) -> Iterator[Batch]:
        return split_batches(self._chunks(shard), lambda: self.micro, drop_last, self.padding)
