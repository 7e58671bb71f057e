"""Variable-length columns: padded by the collate (in Ray Data's threads), trimmed per micro-batch by the training
thread, checked row by row against the rows themselves."""

from __future__ import annotations

import queue
import threading
from functools import partial

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipelines.batches import EpochReplay, FeatureCollate, padding_of, split_batches
from pipelines.errors import DataError
from pipelines.tensors import IGNORE_INDEX


def token_table(rows: int, seed: int) -> tuple[pa.Table, list[list[int]]]:
    rng = np.random.default_rng(seed)
    tokens = [list(rng.integers(1, 1000, n)) for n in rng.integers(2, 400, rows)]
    return pa.table({"input_ids": pa.array(tokens, pa.list_(pa.int64()))}), tokens


def test_collate_in_its_own_thread_beside_the_trim_leaves_every_micro_batch_intact() -> None:
    """Ray Data collates in threads of its own while the training thread trims micro-batches: the trim must see
    the same columns padded together whatever the collate is doing (a shared layout rewritten by each collate
    left `labels` untrimmed, and the loss failed on mismatched widths)."""
    tables = [token_table(512, seed) for seed in range(4)]
    padding = padding_of(tables[0][0].schema, ["input_ids"], None, named=True)
    collate = FeatureCollate(["input_ids"], None, named=True, padding=padding)
    chunks: queue.Queue = queue.Queue(maxsize=4)
    stop = threading.Event()

    def collate_forever() -> None:  # as Ray Data's prefetching collate thread does
        index = 0
        while not stop.is_set():
            table, rows = tables[index % len(tables)]
            chunk = collate(table)
            while not stop.is_set():
                try:
                    chunks.put((chunk, rows), timeout=0.1)
                    break
                except queue.Full:
                    pass
            index += 1

    thread = threading.Thread(target=collate_forever, daemon=True)
    thread.start()
    # A count, not a deadline: a loaded machine fits fewer micro-batches in a few seconds (the race showed by
    # micro-batch 17 on the old code).
    trimmed = 0
    try:
        while trimmed < 600:
            chunk, rows = chunks.get(timeout=30)
            micro = 4
            for start, batch in zip(range(0, len(rows), micro), split_batches([chunk], micro, False, padding),
                                    strict=True):
                expected = rows[start:start + micro]
                width = max(len(r) for r in expected)
                assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["labels"].shape == (
                    len(expected), width), f"micro-batch {trimmed}: {({k: tuple(v.shape) for k, v in batch.items()})}"
                for i, row in enumerate(expected):
                    assert batch["input_ids"][i, :len(row)].tolist() == row
                    assert batch["labels"][i].tolist() == row + [IGNORE_INDEX] * (width - len(row))
                trimmed += 1
    finally:
        stop.set()
        thread.join(timeout=30)
    assert trimmed >= 600


def tagged_table(rows: int, seed: int) -> tuple[pa.Table, list[list[int]], list[list[int]]]:
    """Token rows with one tag per token; tag 0 is a real class (as `O` is in named-entity tagging)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 30, rows)
    ids = [[int(x) for x in rng.choice(np.arange(1, 10**6), n, replace=False)] for n in lengths]
    tags = [[int(x) for x in rng.integers(0, 3, n)] for n in lengths]
    return pa.table({"ids": pa.array(ids, pa.list_(pa.int64())), "tags": pa.array(tags, pa.list_(pa.int64()))}), \
        ids, tags


def check_tagged(batches: list[dict[str, torch.Tensor]], ids: list[list[int]], tags: list[list[int]],
                 multiple: int | None = None) -> None:
    """Every row comes out once with its own tags at its real positions and IGNORE_INDEX elsewhere; each micro-batch
    is as wide as its longest row (rounded up to `multiple`), labels as wide as the tokens they tag."""
    tags_of = {row[0]: (row, tag) for row, tag in zip(ids, tags, strict=True)}
    seen = []
    for batch in batches:
        longest = max(int(m.sum()) for m in batch["attention_mask"])
        width = -(-longest // multiple) * multiple if multiple else longest
        assert batch["ids"].shape == batch["labels"].shape == (len(batch["ids"]), width)
        for tokens, mask, labels in zip(batch["ids"].tolist(), batch["attention_mask"], batch["labels"].tolist(),
                                        strict=True):
            row, tag = tags_of[tokens[0]]
            assert tokens[:len(row)] == row and int(mask.sum()) == len(row)
            assert labels == tag + [IGNORE_INDEX] * (width - len(row))
            seen.append(row[0])
    assert sorted(seen) == sorted(tags_of)  # and so no real position's label is lost


def test_a_variable_length_label_is_padded_with_the_ignore_index_and_trimmed_with_its_tokens() -> None:
    table, ids, tags = tagged_table(50, 0)
    for multiple in (None, 8):
        padding = padding_of(table.schema, ["ids"], "tags", named=True, multiple=multiple)
        chunk = FeatureCollate(["ids"], "tags", named=True, padding=padding)(table)
        streamed = list(split_batches([chunk], 4, False, padding))
        check_tagged(streamed, ids, tags, multiple)
        replay = EpochReplay(keep=True, reshuffle=lambda epoch: 7 + epoch, micro=5, padding=padding)
        assert len(list(replay(partial(split_batches, [chunk], 5, False, padding), 0))) == 10
        check_tagged(list(replay(lambda: [], 1)), ids, tags, multiple)  # reshuffled: cut from all rows at once


def test_a_variable_length_label_without_tokens_is_padded_and_trimmed_alone() -> None:
    """E.g. a caption's token ids as the target of fixed-size features: each micro-batch as wide as its longest
    label row, in the streamed and in the reshuffled epochs."""
    rng = np.random.default_rng(1)
    targets = [[int(x) for x in rng.integers(0, 5, n)] for n in rng.integers(1, 12, 30)]
    pixels = rng.random((30, 4))
    table = pa.table({"pixels": pa.FixedSizeListArray.from_arrays(pa.array(pixels.ravel()), 4),
                      "caption": pa.array(targets, pa.list_(pa.int64()))})
    for named, features in ((True, ["pixels"]), (False, ["pixels"])):
        padding = padding_of(table.schema, features, "caption", named)
        chunk = FeatureCollate(features, "caption", named, padding)(table)
        replay = EpochReplay(keep=True, reshuffle=lambda epoch: epoch, micro=4, padding=padding)
        streamed = list(replay(partial(split_batches, [chunk], 4, False, padding), 0))
        for batches in (streamed, list(replay(lambda: [], 1))):
            seen = []
            for batch in batches:
                x = batch["pixels" if named else "x"]
                for row, labels in zip(x.tolist(), batch["labels"].tolist(), strict=True):
                    index = int(np.flatnonzero(np.isclose(pixels[:, 0], row[0]))[0])
                    target = targets[index]
                    assert labels[:len(target)] == target and set(labels[len(target):]) <= {IGNORE_INDEX}
                    seen.append(index)
                assert batch["labels"].shape[1] == max(len(targets[i]) for i in seen[-len(x):])
            assert len(set(seen)) == len(seen) == 28  # whole micro-batches of 4 only, each row at most once


def test_each_token_column_has_its_own_mask_and_the_labels_follow_the_first() -> None:
    table, ids, tags = tagged_table(20, 2)
    rng = np.random.default_rng(3)
    extra = [list(range(1, n + 1)) for n in rng.integers(1, 60, 20)]
    table = table.append_column("extra", pa.array(extra, pa.list_(pa.int64())))
    padding = padding_of(table.schema, ["ids", "extra"], "tags", named=True)
    chunk = FeatureCollate(["ids", "extra"], "tags", True, padding)(table)
    assert sorted(chunk) == ["extra", "extra_mask", "ids", "ids_mask", "labels"]
    for start, batch in zip(range(0, 20, 3), split_batches([chunk], 3, False, padding), strict=True):
        batch["attention_mask"] = batch["ids_mask"]  # what check_tagged reads
        check_tagged([batch], ids[start:start + 3], tags[start:start + 3])
        assert batch["extra"].shape[1] == max(len(row) for row in extra[start:start + 3])


def test_labels_that_cannot_be_padded_or_trimmed_with_their_tokens_are_refused() -> None:
    ids = pa.array([[1, 2], [3]], pa.list_(pa.int64()))
    longer = pa.table({"ids": ids, "tags": pa.array([[0, 1], [0, 1]], pa.list_(pa.int64()))})
    with pytest.raises(DataError, match="label column 'tags' has more labels than 'ids' has tokens in 1 row"):
        FeatureCollate(["ids"], "tags", True, padding_of(longer.schema, ["ids"], "tags", True))(longer)
    scores = pa.table({"ids": ids, "scores": pa.array([[0.5, 1.0], [2.0]], pa.list_(pa.float32()))})
    with pytest.raises(DataError, match="label column 'scores' is a variable-length list of float"):
        padding_of(scores.schema, ["ids"], "scores", True)


def test_a_batch_padded_otherwise_than_decided_before_iteration_is_refused() -> None:
    """E.g. a data.transforms call turned a token column into a variable-length list: the trim would not cut it."""
    fixed = pa.table({"ids": pa.FixedSizeListArray.from_arrays(pa.array([1, 2, 3, 4]), 2)})
    varying = pa.table({"ids": pa.array([[1, 2], [3]], pa.list_(pa.int64()))})
    collate = FeatureCollate(["ids"], None, True, padding_of(fixed.schema, ["ids"], None, True))
    assert collate(fixed)["labels"].tolist() == [[1, 2], [3, 4]]
    with pytest.raises(DataError, match=r"this batch pads \[\['ids', 'attention_mask', 'labels'\]\] but"):
        collate(varying)
