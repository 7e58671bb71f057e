"""failure.mode=replicas (training/replicas.py) around torchft's manager, without a lighthouse: torchft's Manager is
replaced by one that hands the state and the quorum to the test, everything else is the product's (join_replicas,
the comm hook, the commit optimizer, the loop's step). A replaced replica takes its live peer's whole state, the
fp16 precision state included (the GradScaler's scale and growth count, the steps it skipped), and the live replicas
split the global batch between them; a fresh run's first step waits for every replica. Its process-level run (two
replicas, one killed) is test_replica_groups.py."""

from __future__ import annotations

import io
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

    def allreduce(self, tensor: torch.Tensor) -> Any:
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
    replicas.join_replicas(live, live_progress, 0, 2, GLOBAL, MICRO)
    # Its replacement: a fresh process, its own initial weights and a fresh scaler, nothing trained.
    fresh, fresh_progress = _parts(1), Progress()
    replicas.join_replicas(fresh, fresh_progress, 1, 2, GLOBAL, MICRO)
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
    # scale and the skips included.
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
    group = replicas.join_replicas(_parts(0), Progress(), 0, 2, GLOBAL, MICRO)
    manager = managers[0]
    assert manager.step == 0  # a fresh run: the manager starts at step 0
    # A fresh run's first quorum: alone at first, it asks again until the other replica is in.
    manager.participants = [1, 1, 2]
    assert group.begin_step(PhaseTimer(CPU)) == GLOBAL // MICRO // 2 and manager.quorums == 3
    assert group.figures() == {"replicas/live": 2, "replicas/dropped_steps": 0, "world_size": 2}
    # Later (step 5), a replica alone runs the whole global batch: 4 micro-batches of 8, not its half.
    manager.step, manager.quorums, manager.participants = 5, 0, [1]
    assert group.begin_step(PhaseTimer(CPU)) == GLOBAL // MICRO and manager.quorums == 1
    assert group.figures()["replicas/live"] == 1
    # A group resumed from a checkpoint agrees on where it is: the manager starts at the checkpoint's step.
    replicas.join_replicas(_parts(0), Progress(step=40, samples_seen=40 * GLOBAL), 1, 2, GLOBAL, MICRO)
    assert managers[1].step == 40
