"""Any number of command-level interruptions and resumes, two in a row with no checkpoint between them included, end
with the uninterrupted run's weights, bitwise, and every row of every epoch trained once. The loop in-process (no
Ray): each command a fresh process's parts (other RNG state), resumed from the last checkpoint it saved; the user's
Ctrl+C is the stop notice the driver's request becomes (the next report saves, the loop ends there); a command killed
before it saved anything leaves the checkpoint before it as the latest."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_loop import Recorder, batches, config, dataset

from orchestrator.models.zoo import build_model
from orchestrator.training.cadence import Notices
from orchestrator.training.checkpoint import Progress, restore
from orchestrator.training.loop import Data, run
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.position import micro_batches
from orchestrator.training.precision import Precision

CPU = torch.device("cpu")
# 256 rows of 32 a step: 8 steps an epoch; 20 steps end mid-epoch 2. Dropout: the RNG streams must come back too.
CFG = config("train.max_steps=20", "train.log_every=2", "checkpoint.every=1000", "model.dropout=0.2",
             "data.val=null")
X, Y = dataset(256)
X = torch.cat([X, torch.arange(256.0)[:, None]], dim=1)  # the last column names the row


def source(epoch: int) -> list[dict[str, torch.Tensor]]:
    """Each epoch's rows in their own order, as a reshuffling source gives them."""
    order = torch.randperm(256, generator=torch.Generator().manual_seed(epoch))
    return batches(X[order], Y[order], CFG.train.micro_batch_size)


def fresh(seed: int) -> Parts:
    """A new command's parts: built from other RNG state than the first command's."""
    torch.manual_seed(seed)
    model = build_model(CFG.model.name, None, 17, 4, CFG.model.kwargs)
    optimizer, scheduler = build_optimizer(model, CFG.optim, 20)
    return Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU)


def stop_at_report(n: int) -> Notices:
    """Ctrl+C seen at the n-th report."""
    asked = iter(range(1, 10**6))
    return Notices(stop_requested=lambda: next(asked) >= n)


class Killed(Exception):
    pass


def killed_after(rows: int) -> Any:
    """A source whose command is killed (SIGKILL, a lost node) once `rows` rows were read: nothing saved."""
    def source_until(epoch: int) -> Any:
        for batch in source(epoch):
            yield batch
            if (seen := source_until.rows + len(batch["labels"])) >= rows:  # type: ignore[attr-defined]
                raise Killed
            source_until.rows = seen  # type: ignore[attr-defined]
    source_until.rows = 0  # type: ignore[attr-defined]
    return source_until


def command(state: dict[str, Any] | None, seed: int, notices: Notices | None = None,
            train_source: Any = source) -> tuple[Parts, dict[str, Any] | None, Progress | None]:
    """One `orchestrator train [--resume]`: the parts, the checkpoint it left last (None: none), where it resumed."""
    parts = fresh(seed)
    progress = restore(parts, copy.deepcopy(state)) if state is not None else None
    resumed = copy.deepcopy(progress)  # the loop moves `progress` on as it trains
    recorder = Recorder()
    try:
        run(CFG, parts, Data(train_source), recorder, progress, notices)
    except Killed:
        pass
    saved = [s for _, s in recorder.reports if s is not None]
    return parts, saved[-1] if saved else None, resumed


def next_rows(state: dict[str, Any]) -> list[int]:
    """The rows a command resumed from `state` trains first: its next step's."""
    progress = restore(fresh(0), copy.deepcopy(state))
    stream = micro_batches(source, progress, CPU)
    return [int(i) for _ in range(32 // CFG.train.micro_batch_size) for i in next(stream)["x"][:, -1]]


def test_three_interruptions_one_without_a_checkpoint_between_end_bitwise_as_the_clean_run() -> None:
    clean, _, _ = command(None, seed=0)
    first, at6, _ = command(None, seed=0, notices=stop_at_report(3))  # Ctrl+C: saved at step 6
    assert at6 is not None and at6["progress"]["step"] == 6
    # --resume, killed 3 steps in: nothing saved, the step-6 checkpoint is still the latest.
    _, none, _ = command(at6, seed=11, train_source=killed_after(3 * 32))
    assert none is None
    # --resume again from step 6 (the second resume of that checkpoint), Ctrl+C at its 3rd report: step 12, epoch 1.
    _, at12, resumed = command(at6, seed=22, notices=stop_at_report(3))
    assert resumed is not None and (resumed.step, resumed.samples_seen, resumed.epoch, resumed.rows_in_epoch) == (
        6, 192, 0, 192)
    assert at12 is not None and at12["progress"]["step"] == 12 and at12["progress"]["epoch"] == 1
    last, _, resumed = command(at12, seed=33)  # --resume to the end
    assert resumed is not None and (resumed.step, resumed.epoch, resumed.rows_in_epoch) == (12, 1, 128)
    for a, b in zip(clean.model.parameters(), last.model.parameters(), strict=True):
        assert torch.equal(a, b)
    # Every row of each epoch once: epoch 0's steps 1-6 and 7-8 and epoch 1's 9-12 and 13-16 tile the epochs.
    epoch0, epoch1 = source(0), source(1)
    rows = [int(i) for b in epoch0 for i in b["x"][:, -1]]
    assert next_rows(at6) == rows[192:224] and sorted(rows) == list(range(256))
    rows = [int(i) for b in epoch1 for i in b["x"][:, -1]]
    assert next_rows(at12) == rows[128:160]


@pytest.mark.parametrize("stops", [(1, 1, 1), (2, 1, 3)])
def test_a_chain_of_ctrl_c_resumes_ends_bitwise_as_the_clean_run(stops: tuple[int, ...]) -> None:
    clean, _, _ = command(None, seed=0)
    state = None
    for seed, report in enumerate(stops):  # the first command builds the clean run's model (seed 0)
        _, state, _ = command(state, seed=seed, notices=stop_at_report(report))
        assert state is not None
    last, _, _ = command(state, seed=99)
    for a, b in zip(clean.model.parameters(), last.model.parameters(), strict=True):
        assert torch.equal(a, b)
