"""The rest of an epoch that a group of another size finishes (pipelines/rest.py): the trained rows' ids packed and
read back, and the rounds every rank cuts from the whole epoch so that each untrained row is trained exactly once,
an autopilot re-cut included; where a checkpoint's position holds and where a rest pass starts instead."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from orchestrator.training.position import SEEN, Progress, data_position, micro_batches, rest_of_epoch
from pipelines.config import DataConfig
from pipelines.feed import RankBatches, RankOrder
from pipelines.rest import ROW_ID, SeenRows, pack_ids, union_packed, unpack_ids, with_row_ids
from pipelines.rest import rest_of_epoch as rest_pass
from pipelines.transforms import apply_transforms

ROWS = 1200
CPU = torch.device("cpu")


def chunks(order: np.ndarray, size: int = 64) -> list[dict[str, torch.Tensor]]:
    """The epoch's rows in `order`, fetched in chunks of `size` (the last short), ids and a feature per row."""
    return [{"x": torch.from_numpy(order[i:i + size].astype(np.float32))[:, None],
             ROW_ID: torch.from_numpy(order[i:i + size].astype(np.int64))} for i in range(0, len(order), size)]


def test_ids_pack_and_unpack_exactly() -> None:
    rng = np.random.default_rng(0)
    for ids in (np.zeros(0, np.int64), np.arange(5), np.unique(rng.integers(0, 10**6, 5000))):
        packed = pack_ids(ids)
        assert packed.dtype == torch.uint8 and np.array_equal(unpack_ids(packed), ids)
    assert len(pack_ids(np.arange(10**6))) < 2000  # a contiguous run compresses to almost nothing
    seen = SeenRows()
    seen.add(torch.tensor([3, 1]))
    seen.add(np.array([7, 3]))
    seen.add(torch.tensor([100_000]))  # the bitmap grows with the largest id
    assert seen.ids().tolist() == [1, 3, 7, 100_000]  # type: ignore[union-attr]
    union = union_packed([seen.packed(), pack_ids(np.array([2, 3]))])
    assert unpack_ids(union).tolist() == [1, 2, 3, 7, 100_000]  # type: ignore[arg-type]
    seen.clear()
    assert seen.ids().tolist() == []  # type: ignore[union-attr]
    seen.add(None)  # a batch without ids: this rank's set is not known any more, and no union is kept
    seen.add(np.array([5]))
    assert seen.ids() is None and union_packed([pack_ids(np.array([1])), seen.packed()]) is None


def test_the_rest_of_an_epoch_trains_each_untrained_row_once_on_any_world_size() -> None:
    rng = np.random.default_rng(1)
    order = rng.permutation(ROWS)  # the interrupted epoch's order, the same on every rank
    seen = np.sort(order[:480])  # 4 steps of 120 rows, whichever ranks trained them
    for world, micro in ((2, 60), (3, 40), (3, 7)):
        per_rank = [[b[ROW_ID].tolist() for b in rest_pass(chunks(order), seen, r, world, lambda m=micro: m)]
                    for r in range(world)]
        assert len({len(batches) for batches in per_rank}) == 1  # every rank the same number of micro-batches
        assert all(len(b) == micro for batches in per_rank for b in batches)
        trained = [i for batches in per_rank for b in batches for i in b]
        unseen = [i for i in order if i not in set(seen)]
        assert len(set(trained)) == len(trained) and not set(trained) & set(seen)
        # Only the incomplete last round is left out: fewer rows than one micro-batch of every rank.
        assert set(trained) == set(unseen[:len(unseen) // (world * micro) * world * micro])
        # Round k is the k-th world*micro unseen rows in the epoch's order; rank r trains its r-th slice.
        assert per_rank[1][0] == unseen[micro:2 * micro]


def test_a_re_cut_mid_rest_takes_effect_from_the_next_round_and_loses_no_row() -> None:
    order = np.arange(ROWS)
    sizes = iter([10, 10, 30] + [30] * 100)  # read once per round: the autopilot re-cuts after two rounds
    size = [10]

    def micro() -> int:
        return size[0]

    out: list[list[list[int]]] = [[], []]
    passes = [rest_pass(chunks(order), np.arange(140), r, 2, micro) for r in (0, 1)]
    while True:
        size[0] = next(sizes)
        got = [next(p, None) for p in passes]
        if got[0] is None:
            break
        for r in (0, 1):
            out[r].append(got[r][ROW_ID].tolist())  # type: ignore[index]
    assert [len(b) for b in out[0][:3]] == [10, 10, 30]
    trained = sorted(i for batches in out for b in batches for i in b)
    assert trained == list(range(140, ROWS))  # 1060 rows: 2 rounds of 20, then 17 of 60, none left over


def test_a_checkpoint_holds_at_its_own_world_size_and_order_else_its_epoch_is_finished_as_a_rest() -> None:
    state = {"progress": {"epoch": 1, "rows_in_epoch": 240, "cache_decision": "stream"}, "rng": [0, 0, 0, 0],
             SEEN: pack_ids(np.arange(960))}
    assert data_position(state, "stream", 4) == (1, 240) and rest_of_epoch(state, "stream", 4) is None
    for world, decision in ((2, "stream"), (4, "replay")):  # resized, or fed in another epoch order
        assert data_position(state, decision, world) == (1, 0)
        assert np.array_equal(rest_of_epoch(state, decision, world), np.arange(960))  # type: ignore[arg-type]
    # A rest pass in progress is located by its ids at any world size, the same one included.
    rest = state | {"progress": state["progress"] | {"rest": True}}
    assert data_position(rest, "stream", 4) == (1, 0) and rest_of_epoch(rest, "stream", 4) is not None
    # Without ids (an older checkpoint, a transform that filtered rows) the epoch is finished early, as before.
    old = {k: v for k, v in state.items() if k != SEEN}
    assert data_position(old, "stream", 2) == (2, 0) and rest_of_epoch(old, "stream", 2) is None


def test_rows_keep_their_ids_through_a_call_transform_unless_it_drops_rows(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "user_transforms.py").write_text(
        "def rebuild(batch):\n"  # a function that builds a new table of the columns it knows
        "    return batch.select(['x'])\n"
        "def positive(batch):\n"
        "    return batch.filter(batch.column('x').to_numpy() > 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    table = with_row_ids(pa.table({"x": [1.0, 2.0, 3.0]}), 10)
    rebuilt = apply_transforms(table, [{"normalize": {"mean": 1.0, "std": 2.0}},
                                       {"call": {"fn": "user_transforms:rebuild", "kwargs": {}}}], ["x"])
    assert rebuilt.column(ROW_ID).to_pylist() == [10, 11, 12] and rebuilt.column("x").to_pylist() == [0, 0.5, 1]
    filtered = apply_transforms(table, [{"call": {"fn": "user_transforms:positive", "kwargs": {}}}], ["x"])
    assert filtered.column_names == ["x"]  # which rows survived is not known: the rows go on without ids


class HeldPart:
    """A rank's contiguous part of a small dataset, handed out as held data is (pipelines/held.py), each chunk with
    its rows' ids; world 1 is the data whole, what a rest pass reads."""

    def __init__(self, rank: int, world: int, rows: int = 360) -> None:
        each = rows // world
        self.ids = torch.arange(rank * each, (rank + 1) * each)

    def iter_torch_batches(self, *, batch_size: int, **_: object) -> Iterator[dict[str, torch.Tensor]]:
        for start in range(0, len(self.ids), batch_size):
            ids = self.ids[start:start + batch_size]
            yield {"x": ids[:, None].float(), "labels": ids % 3, ROW_ID: ids}


def test_a_replayed_epoch_interrupted_at_2_workers_is_finished_and_replayed_at_3_with_every_row_once() -> None:
    """Small data replayed (and reshuffled) by the workers, through RankBatches and the loop's micro_batches: 2 ranks
    train epoch 0 and 2 steps of epoch 1 (a global batch of 60); 3 ranks resume from the checkpoint those steps
    left (its state as checkpoint_state writes it), finish epoch 1 as a rest pass and replay epoch 2 from their own
    parts. Each epoch is every one of the 360 rows once."""
    data = DataConfig(train="unused", val=None, features=["x"], label="labels", shuffle=True)

    def ranks(world: int, progress: list[Progress], rest: tuple[int, np.ndarray] | None = None) -> list[Iterator]:
        streams = []
        for rank in range(world):
            batches = RankBatches(data, HeldPart(rank, world), None, 60 // world,
                                  RankOrder(seed=3, rank=rank, replay=True))
            if rest is not None:
                batches.finish(rest[0], rest[1], HeldPart(0, 1), world)
            streams.append(micro_batches(batches.train, progress[rank], CPU))
        return streams

    trained: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def steps(streams: list[Iterator], progress: list[Progress], count: int) -> None:
        for _ in range(count):
            step = [next(s)["x"][:, 0].long().tolist() for s in streams]  # the feature is the row's id
            trained[progress[0].epoch] += [i for ids in step for i in ids]  # every step lies in one epoch here

    old = [Progress(cache_decision="replay") for _ in range(2)]
    steps(ranks(2, old), old, 6 + 2)
    state = {"progress": old[0].saved(), "rng": [None, None],
             SEEN: union_packed([p.seen.packed() for p in old])}
    assert data_position(state, "replay", 3) == (1, 0)
    seen = rest_of_epoch(state, "replay", 3)
    assert seen is not None and len(seen) == 120
    new = [Progress(epoch=1, rest=True, cache_decision="replay") for _ in range(3)]
    for p in new:
        p.seen.add(seen)
    steps(ranks(3, new, (1, seen)), new, 4 + 6)  # the rest: 240 rows, 4 rounds of 3 x 20; then epoch 2
    assert new[0].epoch == 2 and not new[0].rest
    for epoch, ids in trained.items():
        assert sorted(ids) == list(range(360)), epoch
