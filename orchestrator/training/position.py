"""Where training stands (`Progress`, which checkpoints keep), the stream of micro-batches that
keeps it at the data position, and where a (re)started rank's data begins, read from a checkpoint's
state: its epoch and the rows into it that the ranks' counts locate at the same world size and epoch
order, else the rows the epoch has trained on, for a rest pass (pipelines/rest.py) that finishes it
with every row once."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from orchestrator.errors import UserError
from pipelines.rest import ROW_ID, SeenRows, unpack_ids
from pipelines.tensors import Batch, Epoch, rows, take, to_device

# The ids of the rows the checkpoint's epoch has trained on, every rank's (pipelines/rest.py:
# packed).
SEEN = "seen_rows"


@dataclass
class Progress:
    """Where training stands. `rows_in_epoch` counts this rank's rows already trained on in `epoch`,
    in the epoch order of `cache_decision` (pipelines.datasets: stream, memory or replay; None when
    unknown), which a resumed run keeps: under another decision the same count names other rows."""

    step: int = 0
    samples_seen: int = 0
    epoch: int = 0
    rows_in_epoch: int = 0
    # steps skipped for a NaN/inf loss or gradient (budget: train.max_nonfinite_steps)
    nonfinite_skipped: int = 0
    cache_decision: str | None = None
    # The autopilot's choice once its search ended (training/autopilot.py `saved`): a resume applies
    # it unsearched.
    autopilot: dict[str, Any] | None = None
    # For checkpoint.every=auto (checkpoint_interval.py), carried across restarts and `--resume`:
    # rank 0's seconds of training up to this checkpoint, the restarts from a checkpoint so far, and
    # the last checkpoint's blocking seconds.
    run_s: float = 0.0
    interruptions: int = 0
    checkpoint_cost_s: float | None = None
    stopped_at: int | None = None  # the step the user's stop (Ctrl+C) saved at
    # the claim of the attempt training now (training/fence.py), named in its manifests
    attempt: str | None = None
    # `epoch` is finished as the rest of an epoch that a group of another size (or epoch order)
    # began (pipelines/rest.py): `rows_in_epoch` then counts rows of that pass, and only `seen`
    # tells which rows are done.
    rest: bool = False
    # This rank's ids of the rows it trained on in `epoch` (with, in a rest pass, every id the epoch
    # had seen before); a checkpoint keeps the union of every rank's (SEEN), not this object.
    seen: SeenRows = field(default_factory=SeenRows, repr=False, compare=False)

    def saved(self) -> dict[str, Any]:
        """What a checkpoint keeps of it."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "seen"}


def data_position(state: dict[str, Any] | None, cache_decision: str | None,
                  world_size: int) -> tuple[int, int]:
    """(epoch, rows into it) where a rank of a `world_size` group resumes the data from a
    checkpoint's `state` ((0, 0) without one): the checkpoint's position at the same world size and
    epoch order. A position that describes another split or order would miss some rows and repeat
    others: there the epoch starts again as a rest pass, without the rows it has trained on
    (`rest_of_epoch`), or, when the checkpoint does not know them, the next epoch starts (the
    interrupted one finished early: none of its rows is seen twice)."""
    if state is None:
        return 0, 0
    progress = state["progress"]
    epoch, rows = progress["epoch"], progress["rows_in_epoch"]
    if holds(state, cache_decision, world_size):
        return epoch, rows
    return ((epoch, 0) if rest_of_epoch(state, cache_decision, world_size) is not None
            else (epoch + 1, 0))


def holds(state: dict[str, Any], cache_decision: str | None, world_size: int) -> bool:
    """Whether a checkpoint's ranks' row counts locate the data for a `world_size` group fed under
    `cache_decision`: the same world size and epoch order, and an epoch not in a rest pass (or none
    of it trained yet)."""
    progress = state["progress"]
    same = (len(state["rng"]) == world_size
            and _same_order(progress.get("cache_decision"), cache_decision))
    return ((same and not progress.get("rest"))
            or not (progress["rows_in_epoch"] or progress.get("rest")))


def rest_of_epoch(state: dict[str, Any] | None, cache_decision: str | None,
                  world_size: int) -> np.ndarray | None:
    """The ids of the rows the checkpoint's epoch has trained on, when a `world_size` group finishes
    that epoch as a rest pass (pipelines/rest.py): its position does not hold there, and the
    checkpoint knows them. None else (a checkpoint without ids, written before they were kept or of
    data whose ids a transform lost, finishes the epoch early: none of its rows is seen twice)."""
    if state is None or SEEN not in state or holds(state, cache_decision, world_size):
        return None
    return unpack_ids(state[SEEN])


def _same_order(saved: str | None, cache_decision: str | None) -> bool:
    # The driver keeps the checkpoint's decision on resume; another one here means it could not read
    # it. A checkpoint that records none (written before the decision was saved) keeps its position,
    # as it always did.
    return saved is None or cache_decision is None or saved == cache_decision


def micro_batches(
    train_batches: Callable[[int], Iterable[Batch]], progress: Progress, device: torch.device
) -> Iterator[Batch]:
    """Endless stream over epochs that keeps `progress` at the data position. On resume the rows
    already trained on are not trained again: a source that seeks (pipelines' `Epoch`, as
    RankBatches gives) starts cutting at the position, exactly as the interrupted run cut (a
    mid-epoch autopilot re-cut included); any other is re-read from the epoch's start and skipped
    here. The position counts rows, not micro-batches: a resumed run may cut micro-batches of
    another size (auto, or a changed train.micro_batch_size) and still sees every row once."""
    while True:
        produced, skip = False, progress.rows_in_epoch
        batches = train_batches(progress.epoch)
        if isinstance(batches, Epoch):
            batches.start, skip = skip, 0
        for batch in batches:
            produced = True
            if skip >= rows(batch):
                skip -= rows(batch)
                continue
            if skip:  # straddling the position: only its untrained rows
                batch, skip = take(batch, slice(skip, None)), 0
            progress.rows_in_epoch += rows(batch)
            # The rows' ids are recorded here (a checkpoint keeps them) and never reach the model.
            progress.seen.add(batch.get(ROW_ID))
            yield to_device({key: value for key, value in batch.items() if key != ROW_ID}, device)
        # a rest pass may have none left
        if not produced and progress.rows_in_epoch == 0 and not progress.rest:
            raise UserError("the training split is smaller than one micro-batch per worker: "
                            "add rows, or lower train.global_batch_size / scaling.num_workers")
        progress.epoch, progress.rows_in_epoch, progress.rest = progress.epoch + 1, 0, False
        progress.seen.clear()
