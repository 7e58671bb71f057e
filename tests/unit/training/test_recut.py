"""The autopilot's re-cut of the data in the middle of an epoch, through the production pieces (RankBatches, the
loop's micro_batches, the checkpoint's data position): every row of every epoch is trained exactly once, whether the
pass is replayed (in its order or reshuffled) or streamed, and a run resumed after the re-cut is handed exactly the
micro-batches the uninterrupted run trained on (no short first step)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from orchestrator.training.checkpoint import Progress
from orchestrator.training.position import micro_batches
from pipelines.config import DataConfig
from pipelines.feed import RankBatches, RankOrder

CPU = torch.device("cpu")
ROWS = 100  # not a multiple of the per-worker batch (8): steps straddle epochs, positions are not multiples of 8


@dataclass
class Shard:
    """One rank's rows as Ray Data's iter_torch_batches hands them out: chunks of `batch_size`, in row order."""

    ids: torch.Tensor = field(default_factory=lambda: torch.arange(ROWS))

    def iter_torch_batches(self, *, batch_size: int, **_: Any) -> Any:
        for start in range(0, len(self.ids), batch_size):
            ids = self.ids[start:start + batch_size]
            yield {"x": ids[:, None].float(), "labels": ids}


def _rank(replay: bool, shuffle: bool, micro: int) -> RankBatches:
    data = DataConfig(train="unused", val=None, features=["x"], label="labels", shuffle=shuffle)
    return RankBatches(data, Shard(), None, micro, RankOrder(seed=7, rank=0, replay=replay))


def _steps(data: RankBatches, progress: Progress, steps: int, recut_at: int | None = None
           ) -> list[tuple[int, list[int]]]:
    """`steps` steps of 8 rows each (micro 4 x 2, or micro 8 x 1 after the re-cut after step `recut_at`): each
    step's (epoch of its first row, ids)."""
    stream = micro_batches(data.train, progress, CPU)
    out = []
    for step in range(steps):
        batch = [next(stream) for _ in range(8 // data.micro)]
        out.append((progress.epoch, [int(i) for b in batch for i in b["labels"]]))
        if step + 1 == recut_at:
            data.resize(8)
    return out


@pytest.mark.parametrize(("replay", "shuffle"), [(True, False), (True, True), (False, False)],
                         ids=["replayed", "replayed-reshuffled", "streamed"])
def test_a_recut_mid_epoch_trains_every_row_of_every_epoch_once(replay: bool, shuffle: bool) -> None:
    data = _rank(replay, shuffle, micro=4)
    progress = Progress()
    rows_seen: dict[int, list[int]] = {}
    stream = micro_batches(data.train, progress, CPU)
    for step in range(75):  # 600 rows: 6 epochs, the re-cut in the middle of epoch 3 (a replayed one)
        if step == 40:
            data.resize(8)
        for _ in range(8 // data.micro):
            batch = next(stream)  # from epoch progress.epoch
            rows_seen.setdefault(progress.epoch, []).extend(int(i) for i in batch["labels"])
    # 100 rows in micro-batches of 4, and of 8 from row 20 of epoch 3 on (80 rows left: 10 whole ones): no row
    # twice in an epoch, and none left out but an incomplete last micro-batch's (100 mod 8 = 4 rows in epochs 4
    # and 5). Before the fix, a replayed epoch dropped every micro-batch after the re-cut.
    for epoch, trained in sorted(rows_seen.items())[:6]:  # the last steps begin epoch 6
        assert len(set(trained)) == len(trained) == (96 if epoch > 3 else ROWS), (epoch, len(trained))


@pytest.mark.parametrize(("replay", "shuffle"), [(True, False), (True, True), (False, False)],
                         ids=["replayed", "replayed-reshuffled", "streamed"])
def test_a_resume_after_a_recut_is_handed_the_micro_batches_of_the_uninterrupted_run(replay: bool,
                                                                                      shuffle: bool) -> None:
    # Re-cut after step 40 (epoch 3, row 20: epoch 3 began inside step 38), interrupted after step 42 (row 36: not
    # a multiple of the new micro-batch's 8 from the epoch's start), the checkpoint's position restored into a fresh
    # worker built at the chosen micro-batch.
    straight = _steps(_rank(replay, shuffle, micro=4), Progress(), 60, recut_at=40)
    interrupted = Progress()
    assert _steps(_rank(replay, shuffle, micro=4), interrupted, 42, recut_at=40) == straight[:42]
    resumed = Progress(step=42, epoch=interrupted.epoch, rows_in_epoch=interrupted.rows_in_epoch)
    assert (resumed.epoch, resumed.rows_in_epoch) == (3, 36)
    assert _steps(_rank(replay, shuffle, micro=8), resumed, 18) == straight[42:]


@pytest.mark.parametrize(("replay", "shuffle"), [(True, True), (False, False)], ids=["replayed-reshuffled", "streamed"])
def test_the_first_batches_are_fetched_during_set_up_and_the_run_continues_from_them(replay: bool,
                                                                                     shuffle: bool) -> None:
    straight = _steps(_rank(replay, shuffle, micro=4), Progress(epoch=1, rows_in_epoch=36), 20)
    data = _rank(replay, shuffle, micro=4)
    fetched_by: list[str] = []
    shard_iter = data.train_shard.iter_torch_batches

    def recording(**kwargs: Any) -> Any:
        fetched_by.append(threading.current_thread().name)
        return shard_iter(**kwargs)

    data.train_shard.iter_torch_batches = recording  # type: ignore[method-assign]
    data.prefetch(1, 36, 2)  # what the worker starts before it builds the model, from the checkpoint's position
    assert _steps(data, Progress(epoch=1, rows_in_epoch=36), 20) == straight
    assert fetched_by[0] == "first batches"  # the pipeline's first read ran beside the set-up
    data.prefetch(1, 36, 2)
    with pytest.raises(RuntimeError, match="fetched from epoch 1, row 36, but training starts at epoch 1, row 0"):
        next(iter(data.train(1)))


def test_the_pass_is_fetched_and_kept_on_the_host_pinned_for_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replayed pass stays in host memory (pinned when the rank trains on a GPU): the loop copies each micro-batch
    to the device, so no second copy of the pass lives there, outside the memory the micro-batch probe measured."""
    # A CPU torch cannot pin (no accelerator): a pin here is a copy (test_batches.py checks what is pinned).
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor, device=None: tensor.clone())
    asked: list[dict[str, Any]] = []

    class Recording(Shard):
        def iter_torch_batches(self, **kwargs: Any) -> Any:
            asked.append(kwargs)
            return super().iter_torch_batches(**kwargs)

    data = DataConfig(train="unused", val=None, features=["x"], label="labels", shuffle=True)
    for pin in (False, True):
        rank = RankBatches(data, Recording(), None, 4, RankOrder(seed=7, rank=0, replay=True), pin_memory=pin)
        assert rank.replay_train.pin is pin  # a later epoch's gathered rows are pinned too
        assert all(b["x"].device.type == "cpu" for b in rank.train(0))  # epoch 0, as fetched
    assert [(a["device"], a["pin_memory"]) for a in asked] == [("cpu", False), ("cpu", True)]


def test_a_gpu_rank_pins_every_batch_it_hands_out_and_a_cpu_rank_none() -> None:
    """The worker's decision: a rank on a GPU has its training and validation batches pinned (test_batches.py:
    each is then pinned and contiguous); on the CPU no copy is made for a device."""
    from orchestrator.config import load_config
    from orchestrator.training.handoff import WorkerSpec
    from orchestrator.training.worker import Seat, rank_batches

    cfg = load_config(None, ["train.micro_batch_size=4", "train.global_batch_size=8", "scaling.num_workers=2"])
    spec = WorkerSpec(config={}, cache_decision="replay")
    for device, pin in (("cuda", True), ("cpu", False)):
        data = rank_batches(spec, cfg, Seat(2, 1, torch.device(device), 0.0), Shard(), Shard())
        assert (data.pin_memory, data.replay_train.pin, data.replay_val.pin) == (pin, pin, pin)
