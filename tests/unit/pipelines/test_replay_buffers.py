"""A reshuffled replay gathers each later epoch into host buffers it reuses (pipelines/tensors.py EpochBuffers): no
new copy of the pass per epoch, never a rewrite of rows a consumer still holds. The device side (a copy still in
flight) is in tests/unit/training/test_gpu.py."""

from __future__ import annotations

import pytest
import torch
from test_batches import FakePins, chunks

from pipelines.batches import EpochReplay
from pipelines.tensors import Batch

ROWS, MICRO = 24, 4


def seed(epoch: int) -> int:
    return 100 + epoch


def stream() -> list[Batch]:
    return chunks(ROWS, 7)  # rows i: x = [i], labels = i


@pytest.mark.parametrize("pin", [False, True])
def test_a_reshuffled_replay_gathers_every_epoch_into_two_buffers_it_reuses(monkeypatch: pytest.MonkeyPatch,
                                                                           pin: bool) -> None:
    """Consumed as the loop does (it still holds an epoch's last micro-batch when it asks for the next epoch), the
    epochs after the first alternate between two buffers; each still hands out every row once, in the order the
    epoch's seed draws (the rows a gather per epoch gave), each key's rows gathered alike."""
    if pin:  # a CPU torch cannot pin: FakePins keeps every pinned copy, so no address is reused by chance
        pins = FakePins()
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor, device=None: pins.pin_memory(tensor))
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda tensor, device=None: pins.is_pinned(tensor))
    replay = EpochReplay(keep=True, reshuffle=seed, micro=MICRO, pin=pin)
    orders: list[list[int]] = []
    storages: list[set[int]] = []
    held: Batch | None = None
    for epoch in range(5):
        labels, pointers = [], set()
        for batch in replay(stream, epoch):
            assert torch.equal(batch["x"][:, 0], batch["labels"].float())
            assert not pin or all(value.is_pinned() for value in batch.values())
            labels += batch["labels"].tolist()
            pointers |= {value.untyped_storage().data_ptr() for value in batch.values()}
            held = batch
        orders.append(labels)
        storages.append(pointers)
    assert held is not None
    assert orders[0] == list(range(ROWS))  # the pass as streamed
    for epoch in range(1, 5):
        drawn = torch.randperm(ROWS, generator=torch.Generator().manual_seed(seed(epoch)))
        assert orders[epoch] == drawn.tolist()
    assert len({tuple(order) for order in orders}) == 5
    assert all(len(pointers) == 2 for pointers in storages[1:])  # one buffer per key
    assert storages[1] == storages[3] and storages[2] == storages[4] and not storages[1] & storages[2]


def test_rows_a_consumer_still_holds_are_never_overwritten() -> None:
    """A step may take micro-batches across several epochs when an epoch is shorter than a step: every batch it
    holds keeps its rows while later epochs are gathered (a buffer still viewed is replaced, not rewritten)."""
    replay = EpochReplay(keep=True, reshuffle=seed, micro=MICRO)
    held: list[Batch] = []
    seen: list[Batch] = []
    for epoch in range(5):
        for batch in replay(stream, epoch):
            held.append(batch)
            seen.append({key: value.clone() for key, value in batch.items()})
    assert all(torch.equal(h[key], s[key]) for h, s in zip(held, seen, strict=True) for key in s)


def test_a_buffer_is_reused_once_its_viewers_are_gone() -> None:
    """Held across epochs, the buffers are replaced; let go, the replay is back to two."""
    replay = EpochReplay(keep=True, reshuffle=seed, micro=MICRO)
    held = [batch for epoch in range(4) for batch in replay(stream, epoch)]
    pointers = {batch["labels"].untyped_storage().data_ptr() for batch in held[ROWS // MICRO:]}
    assert len(pointers) == 3  # epochs 1-3, each in a buffer of its own
    del held
    later = [{b["labels"].untyped_storage().data_ptr() for b in replay(stream, epoch)} for epoch in range(4, 8)]
    assert later[0] == later[2] and later[1] == later[3] and later[0] != later[1]
