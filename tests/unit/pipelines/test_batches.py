"""Slicing fetched chunks into micro-batches, and replaying a complete pass of an in-memory dataset."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pytest
import torch

from pipelines.batches import EpochReplay, fetch_size, split_batches


def chunks(rows: int, size: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.arange(rows)
    return [{"x": ids[i:i + size].float().unsqueeze(1), "labels": ids[i:i + size]} for i in range(0, rows, size)]


def ys(batches: Iterable[dict[str, torch.Tensor]]) -> list[list[int]]:
    return [b["labels"].tolist() for b in batches]


def test_micro_batches_are_cut_from_chunks_and_only_the_short_last_one_is_dropped() -> None:
    assert fetch_size(64) == 4096 and fetch_size(5000) == 5000
    kept = ys(split_batches(chunks(10, 4), 2, drop_last=True))
    assert kept == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert [len(y) for y in ys(split_batches(chunks(11, 4), 2, drop_last=True))] == [2, 2, 2, 2, 2]
    assert [len(y) for y in ys(split_batches(chunks(11, 4), 2, drop_last=False))] == [2, 2, 2, 2, 2, 1]


def test_a_complete_pass_is_replayed_and_an_unfinished_one_is_not_kept() -> None:
    streamed: list[int] = []

    def stream() -> Iterator[dict[str, torch.Tensor]]:
        for batch in chunks(6, 2):
            streamed.append(int(batch["labels"][0]))
            yield batch

    replay = EpochReplay(keep=True)
    first = replay(stream)
    next(first)  # training ended after one batch: nothing is kept
    assert replay.rows is None
    assert ys(replay(stream)) == [[0, 1], [2, 3], [4, 5]]
    streamed.clear()
    assert ys(replay(stream)) == [[0, 1], [2, 3], [4, 5]]
    assert streamed == []  # the replay did not touch the stream

    passing = EpochReplay(keep=False)
    for _ in range(2):
        assert ys(passing(stream)) == [[0, 1], [2, 3], [4, 5]]
    assert passing.rows is None and streamed == [0, 2, 4, 0, 2, 4]


def test_later_epochs_replay_the_pass_reshuffled_and_a_restart_inside_one_gets_the_same_batches() -> None:
    def stream() -> Iterator[dict[str, torch.Tensor]]:
        yield from chunks(12, 3)

    def seed(epoch: int) -> int:
        return 1000 + epoch

    clean = EpochReplay(keep=True, reshuffle=seed)
    epochs = [ys(clean(stream, e)) for e in range(3)]
    assert epochs[0] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]  # the pass as streamed
    for later in epochs[1:]:  # every row once, whole micro-batches, in a new order
        assert sorted(sum(later, [])) == list(range(12)) and all(len(b) == 3 for b in later)
        assert later != epochs[0]
    assert epochs[1] != epochs[2]
    # A worker restarted inside epoch 2 reads the pass, then hands out epoch 2's batches, features with labels.
    restarted = EpochReplay(keep=True, reshuffle=seed)
    batches = list(restarted(stream, 2))
    assert ys(batches) == epochs[2]
    assert all(torch.equal(b["x"][:, 0], b["labels"].float()) for b in batches)
    # Without reshuffle every epoch is the streamed pass.
    plain = EpochReplay(keep=True)
    assert [ys(plain(stream, e)) for e in range(2)] == [epochs[0], epochs[0]]


def test_replayed_epochs_reach_the_rows_of_the_incomplete_last_micro_batch() -> None:
    # 10 rows in micro-batches of 4: each epoch trains 8 rows and leaves 2 out. Streaming leaves out different rows
    # each epoch (the shard order changes); a replay must too, or those rows are never trained.
    rows = torch.arange(10)

    def stream() -> list[dict[str, torch.Tensor]]:
        return list(split_batches([{"x": rows[:, None].float(), "labels": rows}], 4, drop_last=False))

    replay = EpochReplay(keep=True, reshuffle=lambda epoch: 1000 + epoch, micro=4)
    epochs = [[b for b in replay(stream, epoch)] for epoch in range(6)]
    assert [sum(ys(e), []) for e in epochs[:1]] == [list(range(8))]  # epoch 0 as streamed
    for batches in epochs:
        ids = sum(ys(batches), [])
        assert [len(y) for y in ys(batches)] == [4, 4] and len(set(ids)) == 8  # whole micro-batches, no row twice
    assert {i for e in epochs[1:] for i in sum(ys(e), [])} == set(range(10))  # 8 and 9 are trained too


def test_a_size_changed_mid_pass_cuts_the_next_batches_at_it_and_loses_no_row() -> None:
    # The autopilot's micro-batch, chosen after 3 batches of 2: from there on batches of 4, across chunk ends (the
    # chunks were fetched at a whole number of the old size, 6 rows), every row once and in order.
    size = [2]
    batches = split_batches(chunks(26, 6), lambda: size[0], drop_last=True)
    head = [next(batches) for _ in range(3)]
    size[0] = 4
    assert ys(head) + ys(batches) == [[0, 1], [2, 3], [4, 5], [6, 7, 8, 9], [10, 11, 12, 13], [14, 15, 16, 17],
                                      [18, 19, 20, 21], [22, 23, 24, 25]]
    smaller = [4]
    batches = split_batches(chunks(10, 4), lambda: smaller[0], drop_last=False)
    first = next(batches)
    smaller[0] = 3
    assert ys([first, *batches]) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_a_replayed_pass_resized_is_cut_again_at_the_new_size_with_every_row() -> None:
    # A pass kept at micro-batches of 2 (12 rows), then the autopilot's 4: later epochs hand out whole batches of 4,
    # every row of the pass, as a pass recorded at 4 from the start would; reshuffled ones too.
    for reshuffle in (None, lambda epoch: 1000 + epoch):
        size = [2]
        replay = EpochReplay(keep=True, reshuffle=reshuffle, micro=2)
        stream = lambda size=size: split_batches(chunks(12, 6), lambda: size[0], drop_last=False)  # noqa: E731
        first = list(replay(stream, 0))
        assert [len(y) for y in ys(first)] == [2] * 6
        size[0] = 4
        replay.resize(4)
        from_start = EpochReplay(keep=True, reshuffle=reshuffle, micro=4)
        for epoch in (1, 2):
            later = ys(replay(stream, epoch))
            assert [len(y) for y in later] == [4, 4, 4] and sorted(sum(later, [])) == list(range(12))
            assert later == ys(from_start(lambda: split_batches(chunks(12, 6), 4, drop_last=False), epoch))


COLLATE_IN_A_THREAD = """
import os, threading, time
import numpy as np, pyarrow as pa, torch
from pipelines.batches import collate_arrow

torch.set_num_threads(2)
rows, width = 4096, 64  # each tensor well above one intra-op chunk (32768 elements)
rng = np.random.default_rng(0)
lengths = rng.integers(1, width, rows)
tokens = pa.array([list(rng.integers(0, 100, n)) for n in lengths], pa.list_(pa.int64()))
tags = pa.array([list(rng.integers(0, 9, n)) for n in lengths], pa.list_(pa.int64()))
features = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(rows * width), pa.float64()), width)
table = pa.table({"tokens": tokens, "windows": pa.FixedSizeListArray.from_arrays(
    pa.array(rng.integers(0, 100, rows * width)), width), "features": features, "label": rng.integers(0, 9, rows),
    "tags": tags})
cases = [(["features"], "label", False), (["windows"], None, False), (["tokens", "features"], "label", True),
         (["tokens"], None, True), (["tokens"], "tags", True), (["features"], "tags", True)]
done = threading.Event()

def collate_and_stay():  # as Ray Data's collate threads do: they live as long as the iterator
    for features, label, named in cases:
        collate_arrow(table, features, label, named)
    done.set()
    time.sleep(60)

before = len(os.listdir("/proc/self/task"))
threading.Thread(target=collate_and_stay, daemon=True).start()
done.wait()
print(len(os.listdir("/proc/self/task")) - before)
"""


def test_collate_starts_no_intra_op_thread_pool_in_the_thread_it_runs_in() -> None:
    """Ray Data collates in threads of its own. A parallel torch op there would start a second intra-op pool for
    the life of the iterator, and the training thread's ops run at about 0.6x beside it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", COLLATE_IN_A_THREAD], capture_output=True, text=True, check=True,
                          timeout=120)
    assert done.stdout.split()[-1] == "1", "collating started threads besides its own: an intra-op pool"


class FakePins:
    """torch.Tensor.pin_memory / is_pinned where no accelerator is present (a CPU torch refuses to pin): a pin
    copies into storage of its own with the same strides, as torch's does, and marks that storage pinned. The
    copies are kept, so no unpinned tensor later reuses a marked address."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []
        self.storages: set[int] = set()

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        copy = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu").copy_(tensor)
        self.kept.append(copy)
        self.storages.add(copy.untyped_storage().data_ptr())
        return copy

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self.storages


class RowShard:
    """A rank's shard as Ray Data's iter_torch_batches hands it out (collated by the product's collate, pinned when
    asked), in chunks of 37 rows: chunk ends fall inside micro-batches. Its rows: variable-length `tokens`
    (`padded`), else fixed-size `features` and a `label`."""

    def __init__(self, count: int, seed: int, padded: bool) -> None:
        import numpy as np
        import pyarrow as pa

        rng = np.random.default_rng(seed)
        if padded:
            tokens = [list(rng.integers(1, 50, n)) for n in rng.integers(2, 30, count)]
            self.table = pa.table({"tokens": pa.array(tokens, type=pa.list_(pa.int64()))})
        else:
            features = pa.FixedSizeListArray.from_arrays(rng.normal(size=count * 4).astype(np.float32), 4)
            self.table = pa.table({"features": features, "label": rng.integers(0, 3, count)})

    def iter_torch_batches(self, *, collate_fn: object, pin_memory: bool = False, **_: object
                           ) -> Iterator[dict[str, torch.Tensor]]:
        from pipelines.tensors import pinned

        for start in range(0, self.table.num_rows, 37):
            chunk = collate_fn(self.table.slice(start, 37))  # type: ignore[operator]
            yield pinned(chunk) if pin_memory else chunk


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize(("replay", "shuffle"), [(True, False), (True, True), (False, False)])
def test_every_micro_batch_handed_to_the_copy_is_pinned_and_contiguous(
        monkeypatch: pytest.MonkeyPatch, replay: bool, shuffle: bool, padded: bool) -> None:
    """With `pin` (a GPU rank) every host batch the loop copies to the device is in page-locked, contiguous
    memory: torch stages a copy from pageable or strided memory through a pageable buffer and the step waits.
    Trimmed micro-batches (views of their padded chunk), a micro-batch across two chunks, a replayed pass and a
    reshuffled one, and the validation batches alike."""
    from orchestrator.config import load_config
    from pipelines.feed import RankBatches, RankOrder

    pins = FakePins()
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor, device=None: pins.pin_memory(tensor))
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda tensor, device=None: pins.is_pinned(tensor))
    columns = ["data.features=[tokens]", "data.label=null"] if padded else ["data.features=[features]"]
    data = load_config(None, [*columns, f"data.shuffle={str(shuffle).lower()}"]).data
    train, val = RowShard(300, 0, padded), RowShard(101, 1, padded)
    batches = RankBatches(data, train, val, 8, RankOrder(seed=0, rank=0, replay=replay), named=padded,
                          schema=train.table.schema, pin_memory=True)
    handed = [b for epoch in range(3) for b in batches.train(epoch)] + list(batches.val()) + list(batches.val())
    assert sum(len(b["labels"]) for b in handed) == 3 * 296 + 2 * 101  # every micro-batch looked at
    if padded:
        assert len({b["tokens"].shape[1] for b in handed}) > 1  # trimmed to each micro-batch's own longest row
    for batch in handed:
        for key, value in batch.items():
            assert value.is_contiguous(), (key, value.shape, value.stride())
            assert value.is_pinned(), (key, value.shape)
