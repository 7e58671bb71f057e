"""`--resume` across a flip of the cache decision (no Ray): replayed and streamed data give an epoch different row
orders, so a checkpoint's data position (rows into its epoch's order) holds only under the decision it was made
under. The orders here are built with the production pieces (shard_order, EpochReplay, split_batches), the
position is kept and skipped by the loop's own `micro_batches`, and the checkpoint goes through save/load."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch

from orchestrator.config import load_config
from orchestrator.errors import ConfigError
from orchestrator.models.zoo import build_model
from orchestrator.run.place import RunPlace
from orchestrator.training.checkpoint import (
    Progress,
    capture_rng,
    load_state,
    manifest_cache_decision,
    restore,
    save_state,
)
from orchestrator.training.loop import Data
from orchestrator.training.loop import run as run_loop
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.position import micro_batches
from orchestrator.training.precision import Precision
from pipelines.batches import EpochReplay, split_batches
from pipelines.config import DataConfig
from pipelines.order import local_shuffle_seed, shard_order
from pipelines.sources import DatasetInfo
from pipelines.storage import open_storage
from pipelines.tensors import Batch

SEED, MICRO, SHARDS, SHARD_ROWS = 3, 4, 8, 10
ROWS = SHARDS * SHARD_ROWS  # whole micro-batches: every row of an epoch is trained in it
CPU = torch.device("cpu")
# 1000 bytes of data: under 5% of the larger object store (auto keeps it in memory and the workers replay it),
# over 5% of the smaller one (auto streams it from storage).
INFOS = {"train": DatasetInfo("d", ["a.parquet"], num_rows=ROWS, num_bytes=1000, feature_dim=4, num_classes=2)}
LARGE_STORE, SMALL_STORE = 100_000, 10_000


def streamed(epoch: int) -> Iterator[Batch]:
    """One rank's (world size 1) pass as Ray Data streams it: the shards in the (seed, epoch) shard order, fetched
    as one chunk (fewer rows than a fetch) and cut into micro-batches."""
    shards = [torch.arange(i * SHARD_ROWS, (i + 1) * SHARD_ROWS) for i in range(SHARDS)]
    chunk = {"id": torch.cat(shard_order(shards, SEED, epoch))}
    return split_batches([chunk], MICRO, drop_last=False)


def epochs_under(replayed: bool) -> Callable[[int], Iterator[Batch]]:
    """A fresh worker's epochs (as RankBatches builds them, data.shuffle on, no shuffle buffer): replayed data is
    materialised in epoch 0's shard order and each later epoch permutes that pass per (seed, epoch, rank);
    streamed data reads every epoch in its own shard order."""
    replay = EpochReplay(keep=replayed, reshuffle=lambda epoch: local_shuffle_seed(SEED, epoch, 0), micro=MICRO)
    return lambda epoch: replay(lambda: streamed(0 if replayed else epoch), epoch)


def train_rows(epochs: Callable[[int], Iterator[Batch]], progress: Progress, count: int | None = None) -> list[int]:
    """Row ids trained from `progress` on: `count` micro-batches, or to the end of the epoch it stands in."""
    stream, ids = micro_batches(epochs, progress, CPU), []
    end = progress.rows_in_epoch + count * MICRO if count is not None else ROWS
    while progress.rows_in_epoch < end and len(ids) < 2 * ROWS:  # bounded: a wrong order must fail, not hang
        ids += next(stream)["id"].tolist()
    return ids


def test_the_replayed_and_streamed_orders_of_an_epoch_differ() -> None:
    replayed, streamed_ = (train_rows(epochs_under(r), Progress(epoch=1)) for r in (True, False))
    assert sorted(replayed) == sorted(streamed_) == list(range(ROWS))  # each order holds every row once
    assert set(replayed[:40]) != set(streamed_[:40])  # but the first 40 rows of the epoch are not the same rows


def test_old_behaviour_a_position_resumed_in_the_other_order_trains_rows_twice_and_never() -> None:
    from pipelines.datasets import replay_epochs

    auto = DataConfig(train="d", cache="auto")
    progress = Progress(epoch=1)
    # 40 rows of epoch 1 replayed (small data in a large object store), then a checkpoint.
    before = train_rows(epochs_under(replay_epochs(auto, INFOS, LARGE_STORE)), progress, count=10)
    # A driver that decides afresh on resume, in a smaller object store: streamed.
    after = train_rows(epochs_under(replay_epochs(auto, INFOS, SMALL_STORE)), Progress(**progress.saved()))
    counts = Counter(before + after)
    twice = sorted(i for i in range(ROWS) if counts[i] == 2)
    never = sorted(i for i in range(ROWS) if counts[i] == 0)
    assert twice and len(twice) == len(never)  # the skip count removed other rows than the ones trained


def test_the_cache_decision_flips_with_the_object_store_and_with_data_cache() -> None:
    from pipelines.datasets import MEMORY, REPLAY, STREAM, cache_decision

    auto, memory, none = (DataConfig(train="d", cache=c) for c in ("auto", "memory", "none"))
    assert cache_decision(auto, INFOS, LARGE_STORE) == REPLAY
    assert cache_decision(auto, INFOS, SMALL_STORE) == STREAM  # the same data, a smaller object store
    assert cache_decision(memory, INFOS, SMALL_STORE) == MEMORY  # forced into memory, too large to replay
    assert cache_decision(memory, INFOS, LARGE_STORE) == REPLAY
    assert cache_decision(none, INFOS, LARGE_STORE) == STREAM


@pytest.mark.parametrize(("first", "resumed", "changed"), [
    ("auto", "auto", "the object store shrank"),
    ("auto", "none", "data.cache changed"),
])
def test_resume_keeps_the_checkpoints_cache_decision_and_trains_every_row_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], first: str, resumed: str, changed: str) -> None:
    from orchestrator.run.trainer import resumed_cache_decision
    from orchestrator.training.resume import checkpointed_cache_decision
    from pipelines.datasets import REPLAY, STREAM, cache_decision

    # The first driver: small data in a large object store, replayed by the workers.
    decision = cache_decision(DataConfig(train="d", cache=first), INFOS, LARGE_STORE)
    assert decision == REPLAY
    progress = Progress(epoch=1, cache_decision=decision)
    before = train_rows(epochs_under(decision == REPLAY), progress, count=10)
    place = RunPlace(open_storage(str(tmp_path)), "run")  # where Ray Train writes the run's checkpoints
    run = Path(place.path)
    for step, directory in ((5, "checkpoint_00000005_aaaaaa"), (10, "checkpoint_00000010_bbbbbb")):
        (run / directory).mkdir(parents=True)
        save_state(run / directory, {"progress": progress.saved() | {"step": step}})

    # The resumed driver: the current setting alone would stream.
    store = SMALL_STORE if resumed == first else LARGE_STORE
    config = DataConfig(train="d", cache=resumed)
    assert cache_decision(config, INFOS, store) == STREAM, changed
    saved = checkpointed_cache_decision(place.storage.filesystem(), place.path)  # as build_run reads it
    kept = resumed_cache_decision(config, INFOS, store, saved)
    assert kept == REPLAY
    told = capsys.readouterr().err.strip().splitlines()
    assert len(told) == 1 and "data.cache" in told[0] and "replay" in told[0], told

    state = load_state(run / "checkpoint_00000010_bbbbbb")
    after = train_rows(epochs_under(kept == REPLAY), Progress(**state["progress"]))
    assert Counter(before + after) == Counter(range(ROWS))  # every row of the epoch exactly once


def test_no_line_when_the_decision_holds_and_none_without_a_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrator.run.trainer import resumed_cache_decision
    from orchestrator.training.resume import checkpointed_cache_decision
    from pipelines.datasets import REPLAY, STREAM

    auto = DataConfig(train="d", cache="auto")
    assert checkpointed_cache_decision(pafs.LocalFileSystem(), str(tmp_path / "new-run")) is None
    assert resumed_cache_decision(auto, INFOS, SMALL_STORE, None) == STREAM  # a new run decides afresh
    assert resumed_cache_decision(auto, INFOS, LARGE_STORE, REPLAY) == REPLAY
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match="unknown cache decision 'shuffled': resume it with the version"):
        resumed_cache_decision(auto, INFOS, LARGE_STORE, "shuffled")  # a later version's checkpoint
    # A checkpoint written before the decision was saved records none: the current decision applies.
    old = tmp_path / "old" / "checkpoint_00000004_cccccc"
    old.mkdir(parents=True)
    save_state(old, {"progress": {"step": 4, "epoch": 0, "rows_in_epoch": 8}})
    assert checkpointed_cache_decision(pafs.LocalFileSystem(), str(tmp_path / "old")) is None


def test_the_decision_read_is_the_registered_checkpoints_not_a_newer_unregistered_ones(tmp_path: Path) -> None:
    """Ray resumes from the checkpoint it registered (the worker falls back from it to an older complete one, never
    to a newer one): a newer complete directory Ray never registered (its worker died before registration) must
    not decide how the resumed run is fed."""
    from orchestrator.run.place import RAY_CHECKPOINTS
    from orchestrator.training.resume import checkpointed_cache_decision
    from pipelines.datasets import REPLAY, STREAM

    place = RunPlace(open_storage(str(tmp_path)), "run")
    run = Path(place.path)
    for step, decision in ((5, REPLAY), (10, REPLAY), (15, STREAM), (20, STREAM)):
        directory = run / f"checkpoint_{step:08d}_aaaaaa"
        directory.mkdir(parents=True)
        save_state(directory, {"progress": {"step": step, "epoch": 0, "rows_in_epoch": 0, "cache_decision": decision}})
    place.write_text(RAY_CHECKPOINTS, '{"checkpoints": ["checkpoint_00000005_aaaaaa", "checkpoint_00000010_aaaaaa"]}')
    fs = place.storage.filesystem()
    assert place.registered_step() == 10
    assert checkpointed_cache_decision(fs, place.path, place.registered_step()) == REPLAY
    # The registered one damaged: the worker loads the newest complete one before it, and so is it read.
    (run / "checkpoint_00000010_aaaaaa" / "state.pt").write_bytes(b"")
    place.write_text(RAY_CHECKPOINTS, '{"checkpoints": ["checkpoint_00000010_aaaaaa"]}')
    assert checkpointed_cache_decision(fs, place.path, place.registered_step()) == REPLAY
    # No record of Ray's: the newest complete directory.
    assert checkpointed_cache_decision(fs, place.path, None) == STREAM


def _parts() -> Parts:
    cfg = load_config(None, ["scaling.num_workers=1", "train.global_batch_size=8", "model.hidden=[8]",
                             "optim.warmup_steps=1", "train.max_steps=4"])
    model = build_model(cfg.model.name, None, 4, 2, cfg.model.kwargs)
    optimizer, scheduler = build_optimizer(model, cfg.optim, 4)
    return Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU)  # type: ignore[arg-type]


def test_a_worker_fed_in_another_order_than_its_checkpoint_starts_the_next_epoch() -> None:
    """Defence on the worker: if the data it is fed was decided otherwise than its checkpoint's (a checkpoint the
    driver could not read), the position means nothing there; it finishes the epoch early, as after a resize."""
    from pipelines.datasets import REPLAY, STREAM

    parts = _parts()
    state = {"model": parts.model.state_dict(), "optimizer": parts.optimizer.state_dict(),
             "scheduler": parts.scheduler.state_dict(), "precision": parts.precision.state_dict(),
             "rng": [capture_rng()], "micro_batch_size": MICRO,
             "progress": asdict(Progress(step=10, epoch=1, rows_in_epoch=40, cache_decision=REPLAY))}
    same = restore(parts, dict(state), REPLAY)
    assert (same.epoch, same.rows_in_epoch, same.cache_decision) == (1, 40, REPLAY)
    other = restore(parts, dict(state), STREAM)
    assert (other.epoch, other.rows_in_epoch, other.cache_decision) == (2, 0, STREAM)
    # A checkpoint from before the decision was saved: its position is kept, the current decision recorded.
    unknown = dict(state, progress={"step": 10, "samples_seen": 80, "epoch": 1, "rows_in_epoch": 40})
    old = restore(parts, unknown, STREAM)
    assert (old.epoch, old.rows_in_epoch, old.cache_decision) == (1, 40, STREAM)


class _Manifests:
    """A reporter that reads the cache decision each checkpoint's manifest records (where the driver reads it)."""

    def __init__(self) -> None:
        self.decisions: list[str | None] = []

    def publish(self, metrics: dict[str, Any]) -> None:
        pass

    def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        assert checkpoint_dir is not None
        self.decisions.append(manifest_cache_decision(pafs.LocalFileSystem(), checkpoint_dir))


def test_the_loop_saves_the_decision_the_worker_runs_under_in_every_checkpoint() -> None:
    from pipelines.datasets import MEMORY

    cfg = load_config(None, ["scaling.num_workers=1", "train.global_batch_size=8", "model.hidden=[8]",
                             "optim.warmup_steps=1", "train.max_steps=4", "train.log_every=2", "checkpoint.every=2"])
    parts = _parts()
    x = torch.randn(32, 4)
    data = [{"x": x[i:i + 8], "labels": x[i:i + 8, :2].argmax(dim=1)} for i in range(0, 32, 8)]
    reporter = _Manifests()
    run_loop(cfg, parts, Data(lambda epoch: iter(data)), reporter, Progress(cache_decision=MEMORY))
    assert reporter.decisions == [MEMORY, MEMORY]
