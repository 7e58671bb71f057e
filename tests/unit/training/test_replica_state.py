"""failure.mode=replicas (training/replicas.py) around torchft's manager, without a lighthouse: torchft's Manager is
replaced by one that hands the state and the quorum to the test, everything else is the product's (join_replicas,
the comm hook, the commit optimizer, the loop's step). A replaced replica takes its live peer's whole state, the
fp16 precision state included (the GradScaler's scale and growth count, the steps it skipped), and the live replicas
split the global batch between them; a fresh run's first step waits for every replica. Its process-level run (two
replicas, one killed) is test_replica_groups.py."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from orchestrator.config import load_config
from orchestrator.training import replicas
from orchestrator.training.checkpoint import Progress, unwrap
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision
from orchestrator.training.step import train_step
from orchestrator.training.timing import PhaseTimer
from pipelines.tensors import Epoch

pytest.importorskip("torchft")  # the `replicas` extra

CPU = torch.device("cpu")
GLOBAL, MICRO = 32, 8


class Manager:
    """torchft's Manager as join_replicas uses it: the state callbacks it is given, a quorum the test sets (the
    live replicas, asked again at step 0), and an all-reduce over a quorum of one (the tensor as it is)."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs, self.step, self.quorums, self.participants = kwargs, None, 0, [2]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]

    def start_quorum(self) -> None:
        self.quorums += 1

    def num_participants(self) -> int:
        return self.participants[min(self.quorums, len(self.participants)) - 1]

    def current_step(self) -> int:
        return self.step or 0

    def participating_rank(self) -> int:
        return 0

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = None) -> Any:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(tensor)
        return done

    def should_commit(self) -> bool:
        return True


@pytest.fixture()
def managers(monkeypatch: pytest.MonkeyPatch) -> list[Manager]:
    made: list[Manager] = []

    def manager(**kwargs: Any) -> Manager:
        made.append(Manager(**kwargs))
        return made[-1]

    monkeypatch.setattr(replicas, "Manager", manager)
    return made


def _parts(seed: int) -> Parts:
    """An fp16 replica on the CPU (torch's CPU GradScaler; the config refuses fp16 on CPU, the state is the same)."""
    cfg = load_config(None, ["optim.warmup_steps=2", "train.max_steps=50"])
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer, scheduler = build_optimizer(model, cfg.optim, 50)
    return Parts(model, optimizer, scheduler, Precision("fp16", CPU), CPU, cfg.optim.max_grad_norm)


def _batches(seed: int, steps: int, overflow: tuple[int, ...] = ()) -> list[dict[str, torch.Tensor]]:
    """A step's micro-batch each; at the steps `overflow`, inputs so large that fp16 gradients overflow."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        x = torch.randn(MICRO, 16, generator=g) * (1e3 if i in overflow else 1.0)
        out.append({"x": x, "labels": x[:, :4].argmax(dim=1)})
    return out


def _rows() -> replicas.StepRows:
    """Numbered micro-batches, 10 an epoch: micro-batch n holds the value n."""
    return replicas.StepRows(lambda epoch: ({"x": torch.full((MICRO, 16), float(10 * epoch + i)),
                                             "labels": torch.arange(MICRO) % 4} for i in range(10)),
                             GLOBAL // MICRO, MICRO, None, CPU)


def _numbers(batches: list[dict[str, torch.Tensor]] | None) -> list[int]:
    assert batches is not None
    return [int(batch["x"][0, 0]) for batch in batches]


def _weights(parts: Parts) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in unwrap(parts.model).state_dict().items()}


def test_a_replaced_replica_takes_its_peers_whole_state_fp16_scale_and_skips_included(
        managers: list[Manager]) -> None:
    # The live replica: 8 fp16 steps, 3 of which overflowed (the scaler skipped them and halved its scale each
    # time: 65536 -> 8192), then 2 clean ones (its growth count at 2).
    live, live_progress = _parts(0), Progress()
    for batch in _batches(1, 8, overflow=(1, 2, 5)):
        train_step(live, [batch])
        live_progress.step += 1
        live_progress.samples_seen += GLOBAL
    scaler = live.precision.scaler
    assert scaler is not None and scaler.get_scale() == 65536 / 8 and live.precision.skipped_steps == 3
    assert scaler.state_dict()["_growth_tracker"] == 2
    live_group = replicas.join_replicas(live, live_progress, 0, 2, _rows())
    # Its replacement: a fresh process, its own initial weights and a fresh scaler, nothing trained.
    fresh, fresh_progress = _parts(1), Progress()
    fresh_group = replicas.join_replicas(fresh, fresh_progress, 1, 2, _rows())
    assert fresh.precision.scaler.get_scale() == 65536  # type: ignore[union-attr]
    # The peer's state as torchft's transport carries it (serialised), into the newcomer's first step.
    sent = io.BytesIO()
    torch.save(managers[0].kwargs["state_dict"](), sent)
    sent.seek(0)
    managers[1].kwargs["load_state_dict"](torch.load(sent, weights_only=False))
    assert fresh.precision.state_dict() == live.precision.state_dict()
    assert fresh.precision.scaler.get_scale() == 8192  # type: ignore[union-attr]
    assert fresh.precision.skipped_steps == 3
    assert (fresh_progress.step, fresh_progress.samples_seen) == (8, 8 * GLOBAL)
    assert fresh.scheduler.state_dict() == live.scheduler.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(_weights(fresh).values(), _weights(live).values(), strict=True))
    # From here the two are one replica: the same steps, one of them overflowing, leave both bitwise alike, the
    # scale and the skips included (each in a quorum of one: this manager's all-reduce leaves the tensor as it is).
    for group in (live_group, fresh_group):
        group.manager.participants, group.manager.step = [1], 8  # (torchft's heal sets the step too)
        group.begin_step(PhaseTimer(CPU), 50)
    for batch in _batches(2, 4, overflow=(1,)):
        for parts in (live, fresh):
            train_step(parts, [batch])
    assert fresh.precision.state_dict() == live.precision.state_dict()
    assert live.precision.skipped_steps == 4 and live.precision.scaler.get_scale() == 4096  # type: ignore[union-attr]
    for key, value in _weights(live).items():
        assert torch.equal(value, _weights(fresh)[key]), key
    state_live, state_fresh = live.optimizer.state_dict(), fresh.optimizer.state_dict()
    for index, moments in state_live["state"].items():
        for name, value in moments.items():
            assert torch.equal(value, state_fresh["state"][index][name]), (index, name)


def test_the_live_replicas_split_the_global_batch_and_a_fresh_run_waits_for_every_one(
        managers: list[Manager]) -> None:
    group = replicas.join_replicas(_parts(0), Progress(), 0, 2, _rows())
    manager = managers[0]
    assert manager.step == 0  # a fresh run: the manager starts at step 0
    # A fresh run's first quorum: alone at first, it asks again until the other replica is in.
    manager.participants = [1, 1, 2]
    assert _numbers(group.begin_step(PhaseTimer(CPU), 50)) == [0, 1] and manager.quorums == 3
    assert group.report({}) == {"replicas/live": 2, "replicas/dropped_steps": 0, "world_size": 2}
    # Later (step 5), a replica alone runs the whole global batch: the step's 4 micro-batches, not its half.
    manager.step, manager.quorums, manager.participants = 5, 0, [1]
    assert _numbers(group.begin_step(PhaseTimer(CPU), 50)) == [20, 21, 22, 23] and manager.quorums == 1
    assert group.report({})["replicas/live"] == 1
    # A group resumed from a checkpoint agrees on where it is: the manager starts at the checkpoint's step.
    replicas.join_replicas(_parts(0), Progress(step=40, samples_seen=40 * GLOBAL), 1, 2, _rows())
    assert managers[1].step == 40


def test_a_steps_rows_follow_from_its_number_wherever_a_replica_starts_reading() -> None:
    """StepRows over seekable epochs (RankBatches' `Epoch`) of 10 micro-batches, 4 a step: a replica that joins at
    step 7 (micro-batches 28-31: epoch 2 from its row 64, then epoch 3's first two) takes exactly what one that read
    from the start takes, going straight there when the epoch's length is known, reading the first epoch to learn it
    otherwise; a redone step takes the same rows again; an epoch of another length is refused."""
    opened: list[tuple[int, int]] = []

    def epochs(epoch: int, length: int = 10) -> Epoch:
        def cut(start: int) -> Iterator[dict[str, torch.Tensor]]:
            opened.append((epoch, start))
            return ({"x": torch.full((MICRO, 1), float(10 * epoch + i))} for i in range(start // MICRO, length))
        return Epoch(cut)

    reader = replicas.StepRows(epochs, 4, MICRO, None, CPU)
    assert [_numbers(reader.share(step, rank, live)) for step, rank, live in
            [(0, 0, 2), (0, 1, 2), (1, 0, 1), (6, 1, 2), (7, 0, 1)]] == \
        [[0, 1], [2, 3], [4, 5, 6, 7], [26, 27], [28, 29, 30, 31]]
    assert _numbers(reader.share(7, 1, 2)) == [30, 31]  # the step redone by two: the same rows, split
    assert reader.position(8) == (3, 2 * MICRO)
    opened.clear()
    assert _numbers(replicas.StepRows(epochs, 4, MICRO, 10, CPU).share(7, 0, 2)) == [28, 29]
    assert opened == [(2, 8 * MICRO)]
    opened.clear()
    assert _numbers(replicas.StepRows(epochs, 4, MICRO, None, CPU).share(7, 1, 2)) == [30, 31]
    assert opened == [(0, 0), (1, 0), (2, 0), (3, 0)]
    uneven = replicas.StepRows(lambda epoch: epochs(epoch, 10 - epoch), 4, MICRO, None, CPU)
    with pytest.raises(RuntimeError, match="epoch 1 gave 9 micro-batches"):
        uneven.share(4, 0, 1)


def test_a_step_the_quorum_drops_is_redone_with_the_same_rows_and_lr(managers: list[Manager]) -> None:
    parts = _parts(0)
    group = replicas.join_replicas(parts, Progress(), 0, 2, _rows())
    manager = managers[0]
    verdicts = iter([True, False, True])
    manager.should_commit = lambda: next(verdicts)  # type: ignore[method-assign]  # a peer fails in the 2nd step
    seen = []
    for _ in range(3):
        batches = group.begin_step(PhaseTimer(CPU), 50)
        lr = parts.optimizer.param_groups[0]["lr"]
        if group.step_done(train_step(parts, batches or []), GLOBAL):
            manager.step = manager.current_step() + 1  # as torchft's manager counts a committed step
        seen.append((_numbers(batches), lr))
    assert seen[0][0] == [0, 1] and seen[1] == seen[2] == ([4, 5], seen[1][1]) and seen[1][1] != seen[0][1]
    assert parts.scheduler.last_epoch == 2 and group.optimizer.dropped == 1
