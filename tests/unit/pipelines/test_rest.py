"""The rest of an epoch that a group of another size finishes (pipelines/rest.py): the trained rows' ids packed and
read back, and the rounds every rank cuts from the whole epoch so that each untrained row is trained exactly once,
an autopilot re-cut included; where a checkpoint's position holds and where a rest pass starts instead."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from orchestrator.training.position import SEEN, data_position, rest_of_epoch
from pipelines.rest import ROW_ID, SeenRows, pack_ids, union_packed, unpack_ids, with_row_ids
from pipelines.rest import rest_of_epoch as rest_pass
from pipelines.transforms import apply_transforms

ROWS = 1200


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
    seen.add(np.array([7]))
    assert np.array_equal(np.sort(seen.ids()), [1, 3, 7])  # type: ignore[arg-type]
    assert np.array_equal(unpack_ids(union_packed([seen.ids(), np.array([2, 3])])), [1, 2, 3, 7])  # type: ignore[arg-type]
    seen.add(None)  # a batch without ids: this rank's set is not known any more, and no union is kept
    assert seen.ids() is None and union_packed([np.array([1]), seen.ids()]) is None


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
