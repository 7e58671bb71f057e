"""Micro-batches of several rows of different lengths, every value checked against the rows themselves: each
micro-batch as wide as its own longest row (or the multiple of `pad_to_multiple_of` above it), no real token cut,
padding 0 in the ids, IGNORE_INDEX in the labels, and a mask that is exactly the real tokens; in streamed and in
reshuffled (replayed) epochs."""

from __future__ import annotations

from functools import partial

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipelines.batches import EpochReplay, FeatureCollate, padding_of, split_batches
from pipelines.tensors import IGNORE_INDEX

# Lengths chosen so that the longest row of a micro-batch of 3 is first, middle or last, lengths at and just past
# a multiple of 8 occur, and one micro-batch (rows 9-11) is much narrower than the fetch's longest row (19).
LENGTHS = [3, 9, 1, 2, 19, 5, 8, 16, 7, 1, 4, 2, 17, 6]


def width_for(lengths: list[int], multiple: int | None) -> int:
    longest = max(lengths)
    return -(-longest // multiple) * multiple if multiple else longest


def token_rows(lengths: list[int]) -> list[list[int]]:
    """Rows whose first token (100 + index) names them; no token is 0, the padding id."""
    rng = np.random.default_rng(0)
    return [[100 + i, *(int(t) for t in rng.integers(1, 50, n - 1))] for i, n in enumerate(lengths)]


def check_tokens(batch: dict[str, torch.Tensor], rows: list[list[int]], multiple: int | None) -> list[int]:
    """The batch's rows, checked value by value; returns their indices."""
    seen = [int(first) - 100 for first in batch["input_ids"][:, 0]]
    expected = [rows[i] for i in seen]
    width = width_for([len(r) for r in expected], multiple)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["labels"].shape == (len(seen), width)
    for row, ids, mask, labels in zip(expected, batch["input_ids"].tolist(), batch["attention_mask"].tolist(),
                                      batch["labels"].tolist(), strict=True):
        pad = width - len(row)
        assert ids == row + [0] * pad  # no real token cut, padding id 0
        assert mask == [1] * len(row) + [0] * pad  # exactly the real tokens
        assert labels == row + [IGNORE_INDEX] * pad  # padding is never a target
    return seen


@pytest.mark.parametrize("multiple", [None, 8])
def test_token_micro_batches_are_as_wide_as_their_own_longest_row_with_a_mask_of_exactly_the_real_tokens(
        multiple: int | None) -> None:
    rows = token_rows(LENGTHS)
    # Sliced, as a fetched Arrow batch can be: the list offsets do not start at 0.
    table = pa.table({"input_ids": pa.array([[7, 7], *rows], pa.list_(pa.int64()))}).slice(1)
    padding = padding_of(table.schema, ["input_ids"], None, named=True, multiple=multiple)
    chunk = FeatureCollate(["input_ids"], None, named=True, padding=padding)(table)
    assert chunk["input_ids"].shape[1] == width_for(LENGTHS, multiple)  # the fetch: its longest row
    streamed = list(split_batches([chunk], 3, drop_last=False, padding=padding))
    starts = range(0, len(LENGTHS), 3)
    assert [check_tokens(b, rows, multiple) for b in streamed] == [list(range(i, min(i + 3, 14))) for i in starts]
    assert [b["input_ids"].shape[1] for b in streamed] == [width_for(LENGTHS[i:i + 3], multiple) for i in starts]
    # Every real token reached the model once: the masks add up to the data's tokens.
    assert sum(int(b["attention_mask"].sum()) for b in streamed) == sum(LENGTHS)

    replay = EpochReplay(keep=True, reshuffle=lambda epoch: 11 + epoch, micro=3, padding=padding)
    assert len(list(replay(partial(split_batches, [chunk], 3, False, padding), 0))) == 4  # whole ones only
    reshuffled = list(replay(lambda: [], 1))
    seen = [i for batch in reshuffled for i in check_tokens(batch, rows, multiple)]
    assert len(seen) == len(set(seen)) == 12  # rows of all 5 micro-batches drawn into 4 whole ones


@pytest.mark.parametrize("multiple", [None, 8])
@pytest.mark.parametrize("named", [True, False])
def test_a_label_list_without_tokens_is_as_wide_as_its_longest_row_in_each_micro_batch(named: bool,
                                                                                       multiple: int | None) -> None:
    """E.g. a caption's ids as the target of fixed-size features: padded with IGNORE_INDEX alone, rounded up to
    the multiple like token columns."""
    targets = [[i % 5] * n for i, n in enumerate(LENGTHS)]
    features = np.arange(len(LENGTHS) * 2, dtype=np.float64)
    table = pa.table({"f": pa.FixedSizeListArray.from_arrays(pa.array(features), 2),
                      "caption": pa.array(targets, pa.list_(pa.int64()))})
    padding = padding_of(table.schema, ["f"], "caption", named, multiple)
    chunk = FeatureCollate(["f"], "caption", named, padding)(table)
    for start, batch in zip(range(0, 14, 4), split_batches([chunk], 4, False, padding), strict=True):
        expected = targets[start:start + 4]
        width = width_for([len(t) for t in expected], multiple)
        assert batch["labels"].tolist() == [t + [IGNORE_INDEX] * (width - len(t)) for t in expected]
