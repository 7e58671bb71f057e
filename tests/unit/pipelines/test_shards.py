"""A rank's stride of a dataset every rank reads whole: every row on exactly one rank, at any world size."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pipelines.shards import StridedShard


class Whole:
    """A dataset of `count` numbered rows as Ray Data's unsplit iterator hands it out: batches of the asked size
    (the last one short), in the same order on every rank."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.asked: list[int] = []

    def iter_torch_batches(self, *, batch_size: int, **_: Any) -> Iterator[dict[str, torch.Tensor]]:
        self.asked.append(batch_size)
        ids = torch.arange(self.count)
        for start in range(0, self.count, batch_size):
            part = ids[start:start + batch_size]
            yield {"x": part[:, None].float().repeat(1, 3), "labels": part}


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_every_row_is_on_exactly_one_rank_whatever_the_world_size(world: int) -> None:
    count = 301
    per_rank = []
    for rank in range(world):
        whole = Whole(count)
        batches = list(StridedShard(whole, rank, world).iter_torch_batches(batch_size=16, device="cpu"))
        assert whole.asked == [16 * world]  # about 16 of each fetch are this rank's
        assert all(v.is_contiguous() for b in batches for v in b.values())
        assert all(torch.equal(b["x"][:, 0].long(), b["labels"]) for b in batches)  # the columns stay together
        per_rank.append(torch.cat([b["labels"] for b in batches]).tolist())
    assert sorted(n for mine in per_rank for n in mine) == list(range(count))
    assert [len(mine) for mine in per_rank] == [len(range(rank, count, world)) for rank in range(world)]
