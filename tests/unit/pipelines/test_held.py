"""How the ranks split held small data (pipelines/held.py) as the worker asks for each split (worker.rank_shard),
without a Ray runtime: the blocks are in-memory Arrow tables and `ray.get` hands them back as they are. Training takes
equal parts (the ranks' collectives stay aligned); validation scores every row exactly once, at any world size."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
import ray
import torch

from orchestrator.training.handoff import WorkerSpec
from orchestrator.training.worker import Seat, rank_shard
from pipelines.batches import FeatureCollate
from pipelines.held import HeldRows

CPU = torch.device("cpu")
N_VAL = 7


@pytest.fixture
def blocks(monkeypatch: pytest.MonkeyPatch) -> list[pa.Table]:
    """N_VAL rows with an id column, in three blocks of uneven size; `ray.get` returns them unchanged."""
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    ids = np.arange(N_VAL)
    return [pa.table({"id": ids[a:b].astype(np.float32), "label": ids[a:b] % 2}) for a, b in ((0, 3), (3, 4), (4, 7))]


def _ids(held: HeldRows, name: str, rank: int, world: int) -> list[int]:
    """The ids rank `rank` of `world` iterates of split `name`, its shard built as the worker builds it."""
    shard = rank_shard(WorkerSpec(config={}, held={name: held}), name, Seat(world, rank, CPU, 0.0), lambda _: None)
    batches = shard.iter_torch_batches(batch_size=2, collate_fn=FeatureCollate(["id"], "label"))
    return [int(v) for batch in batches for v in batch["x"][:, 0].tolist()]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_validation_split_scores_every_row_exactly_once(blocks: list[pa.Table], world: int) -> None:
    held = HeldRows(blocks)
    parts = [_ids(held, "val", rank, world) for rank in range(world)]
    assert Counter(i for part in parts for i in part) == Counter(range(N_VAL))  # each row once, none left out
    assert max(map(len, parts)) - min(map(len, parts)) <= 1  # balanced
    assert [i for part in parts for i in part] == list(range(N_VAL))  # contiguous parts in block order


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_training_split_stays_equal_and_leaves_out_the_last_rows(blocks: list[pa.Table], world: int) -> None:
    held = HeldRows(blocks)
    parts = [_ids(held, "train", rank, world) for rank in range(world)]
    each = N_VAL // world
    assert [len(part) for part in parts] == [each] * world
    assert [i for part in parts for i in part] == list(range(each * world))
