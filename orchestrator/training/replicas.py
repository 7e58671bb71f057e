"""failure.mode=replicas on the worker side: the torchft wiring that lets one worker fail while the
others keep stepping. Each Ray Train worker is one replica group (Ray's `TorchftConfig` gives each
its own process group of one and starts torchft's lighthouse). A torchft `Manager` forms a quorum of
the live replicas at the start of every step; the model's gradients are averaged over that quorum
(torchft's DDP comm hook) and the optimizer steps only when the quorum agrees the step committed. A
restarted worker copies model, optimizer, schedule and step count from a live peer in its first
quorum, before its first forward, instead of reading the checkpoint.

Every row is trained exactly once (`StepRows`): a step's rows follow from its number, and the live
replicas split them by their rank in the step's quorum. A step the quorum did not commit is redone
with the same rows and the same LR, a survivor takes a lost replica's share, a restarted replica
joins at its peers' step with their rows, and one that restarts after its peers finished takes their
final state instead of training on its own."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport
from torchft.optim import OptimizerWrapper

from orchestrator.errors import UserError
from orchestrator.training.checkpoint import Progress, unwrap
from orchestrator.training.parts import Parts
from orchestrator.training.timing import PhaseTimer
from pipelines.tensors import Batch, Epoch, to_device

# How long a live replica waits in a collective for a peer that died before the quorum drops it; the
# restarted replica's first quorum and state transfer must fit in it too (torchft's example uses the
# same on loaded machines).
TIMEOUT = timedelta(seconds=30)
# How long a fresh run's first step waits for every replica to join its quorum (they start together,
# give or take their data pipelines' start).
START_WAIT_S = 60.0
# How long a replica that finished waits for a peer that is being replaced (Ray's replacement and
# the newcomer's set-up: about 10 s on a loaded 2-core machine), so that the newcomer takes the
# final state from it.
END_WAIT_S = 180.0


class StepRows:
    """The run's training micro-batches as one numbered sequence that every replica reads alike (the
    whole dataset, in the same order, epoch after epoch): step s trains numbers s*G to (s+1)*G - 1
    (G: the global batch's micro-batches), and the step's quorum splits them in order between the
    live replicas. So which rows a step trains depends on its number only, never on which replicas
    happen to be live or since when.

    `epochs(e)` gives epoch e's micro-batches (an `Epoch` can start at a row; any other source is
    read from its start). `per_epoch`: the micro-batches of an epoch when the driver knows its rows
    (then a replica that joins in a later epoch goes straight there), else learnt from the first
    epoch read whole, and checked on every later one."""

    def __init__(self, epochs: Callable[[int], Iterable[Batch]], per_step: int, micro: int,
                 per_epoch: int | None, device: torch.device) -> None:
        self.epochs, self.per_step, self.micro, self.device = epochs, per_step, micro, device
        self.per_epoch = per_epoch
        self.batches: Iterator[tuple[int, Batch]] | None = None
        self.next = 0  # the number of the micro-batch `batches` gives next

    def share(self, step: int, rank: int, participants: int) -> list[Batch]:
        """Replica `rank`'s part of step `step` among `participants` live replicas, on the
        device."""
        count = self.per_step // participants
        first = step * self.per_step + rank * count
        return [to_device(self._at(number), self.device) for number in range(first, first + count)]

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, rows into it) where step `step` starts, once the epoch's length is known (else
        (0, 0))."""
        if not self.per_epoch:
            return 0, 0
        epoch, index = divmod(step * self.per_step, self.per_epoch)
        return epoch, index * self.micro

    def _at(self, number: int) -> Batch:
        # a redone step, or a first read: start where it is
        if self.batches is None or number < self.next:
            self.batches = self._from(number)
        # the other replicas' shares in between are read and passed over
        for found, batch in self.batches:
            if found == number:
                self.next = number + 1
                return batch
        raise AssertionError("the sequence of micro-batches is endless")

    def _from(self, number: int) -> Iterator[tuple[int, Batch]]:
        epoch, index = divmod(number, self.per_epoch) if self.per_epoch else (0, 0)
        while True:
            batches = self.epochs(epoch)
            if isinstance(batches, Epoch):
                batches.start = index * self.micro
            else:
                batches = itertools.islice(batches, index, None)
            count = index
            for batch in batches:
                yield epoch * (self.per_epoch or 0) + count, batch
                count += 1
            if count == 0:
                raise UserError("the training split is smaller than one micro-batch: "
                                "add rows, or lower train.micro_batch_size")
            if self.per_epoch is None:
                self.per_epoch = count
            elif count != self.per_epoch:
                raise RuntimeError(f"epoch {epoch} gave {count} micro-batches where every epoch "
                                   f"must give {self.per_epoch} under failure.mode=replicas "
                                   "(the steps' rows are numbered by them): a transform that "
                                   "drops rows at random cannot run in this mode")
            epoch, index = epoch + 1, 0


class _QuorumDDP(DistributedDataParallel):
    """torchft's DDP with a comm hook that survives the failure it is there for: torchft 0.2.0's own
    hook asserts (`assert fut._fut`) when a peer dies inside the all-reduce (gloo: "Connection reset
    by peer"), killing the survivor too. Here the error stays with the manager, whose
    `should_commit` then drops the step."""

    # No annotations: DDP refuses string annotations (ours, lazy).
    @staticmethod
    def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]
        # averaged over the quorum in place, or left as is after an error
        state.allreduce(bucket.buffer()).wait()
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done


class _CommitOptimizer(OptimizerWrapper):
    """torchft's optimizer wrapper, except that `zero_grad` does not start a quorum: the loop starts
    one at the top of each step (`Replicas.begin_step`), where it also learns the step's rows. The
    loop's step zeroes the gradients after the update and again after an out-of-memory retry,
    neither of which is a new step.

    It takes the non-finite verdict as a `found_inf` flag (and GradScaler's `grad_scale`), as
    torch's fused kernels do, so that every step reaches `should_commit`, a skipped one too: the
    quorum's step count moves with the loop's."""

    # GradScaler and precision.step_unless hand over their flags, never skip step()
    _step_supports_amp_scaling = True
    dropped = 0  # steps the quorum did not commit (a peer failed inside them): each is redone
    committed = True  # the last step's verdict

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none)

    def step(self, closure: object = None) -> None:
        flags = {name: getattr(self, name) for name in ("found_inf", "grad_scale")
                 if hasattr(self, name)}
        self.committed = self.manager.should_commit()
        if not self.committed:
            self.dropped += 1
        # a fused kernel: decided on the device
        elif getattr(self.optim, "_step_supports_amp_scaling", False):
            for name, value in flags.items():
                setattr(self.optim, name, value)
            try:
                self.optim.step()
            finally:
                for name in flags:
                    delattr(self.optim, name)
        # one host read, as step_unless does for such an optimizer
        elif not bool(flags.get("found_inf", 0)):
            self.optim.step()


class _CommitSchedule:
    """The LR schedule, moved on only by a committed step: a dropped step is redone at the same
    LR."""

    def __init__(self, schedule: Any, optimizer: _CommitOptimizer) -> None:
        self.schedule, self.optimizer = schedule, optimizer

    def step(self) -> None:
        if self.optimizer.committed:
            self.schedule.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.schedule, name)


class Replicas:
    """This worker's replica: its torchft manager, the step's rows, and the run's end."""

    def __init__(self, manager: Manager, optimizer: _CommitOptimizer, workers: int, rows: StepRows,
                 progress: Progress) -> None:
        self.manager, self.optimizer, self.workers, self.rows = manager, optimizer, workers, rows
        self.progress = progress
        self.participants = 0  # of the current step's quorum
        # this replica's last report, handed to a peer with the state
        self.last_report: dict[str, Any] = {}
        # restarted after its peers finished: it took their final state and report
        self.took_final = False

    @property
    def committed(self) -> bool:
        return self.optimizer.committed

    def begin_step(self, timer: PhaseTimer, max_steps: int) -> list[Batch] | None:
        """Form this step's quorum (blocks until the live replicas agree on it, billed as sync; a
        restarted replica takes a live peer's state in it) and return this replica's micro-batches
        of the step, or None when the state it took is the run's end (nothing left to train)."""
        with timer.phase("sync"):
            self._quorum()
            # A fresh run's first quorum forms as soon as one replica asks. Alone, it would take the
            # whole first steps while the others start: so at step 0 it asks again until every
            # replica is in, for a while.
            self._until_all_in(START_WAIT_S, lambda: self.manager.current_step() == 0)
        step = self.manager.current_step()
        if step >= max_steps:
            self.took_final = True
            return None
        rank = self.manager.participating_rank()
        # a synchronous quorum heals before it returns: every member takes part
        assert rank is not None
        with timer.phase("data_wait"):
            return self.rows.share(step, rank, self.participants)

    def finish(self) -> None:
        """After the last step: wait (END_WAIT_S at most) until every replica is in one quorum at
        the end, so that a peer being replaced takes the final state from this one rather than
        training the run again alone."""
        if self.took_final:
            return
        self._quorum()
        self._until_all_in(END_WAIT_S)

    def step_done(self, result: Any, global_batch: int) -> bool:
        """Whether the quorum committed the step. A committed step trained the global batch (the
        step's `result` counts it: every replica's rows, not only this one's) and leaves the data
        position of the next step."""
        if self.committed:
            result.samples = global_batch
            position = self.rows.position(self.manager.current_step())
            self.progress.epoch, self.progress.rows_in_epoch = position
        return self.committed

    def report(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """A report with this replica's figures: the live replicas of the last step's quorum, the
        steps its quorum did not commit (each redone), and the run's workers (the loop's own world
        is this replica's process group of one). After taking finished peers' state, their last
        report is repeated (this replica trained no step)."""
        figures = {"replicas/live": self.participants,
                   "replicas/dropped_steps": self.optimizer.dropped, "world_size": self.workers}
        return metrics | (self.last_report if self.took_final else {}) | figures

    def count_sum(self, count: torch.Tensor) -> Any:
        """Start summing a step's target count over the quorum's replicas (the token normaliser): a
        torchft Work."""
        from torch.distributed import ReduceOp

        return self.manager.allreduce(count, reduce_op=ReduceOp.SUM)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    def _quorum(self) -> None:
        self.manager.start_quorum()
        self.participants = self.manager.num_participants()

    def _until_all_in(self, seconds: float, asking: Callable[[], bool] = lambda: True) -> None:
        """Ask for quorums again (for `seconds` at most, while `asking()`) until every replica is in
        one."""
        began = time.monotonic()
        while self.participants < self.workers and asking() and time.monotonic() - began < seconds:
            time.sleep(0.2)
            self._quorum()


class ReplicaReporter:
    """The loop's reporter, each report with the replica's figures (`Replicas.report`), the last one
    kept for a peer that takes this replica's state at the run's end."""

    def __init__(self, reporter: Any, replicas: Replicas) -> None:
        self.reporter, self.replicas = reporter, replicas

    def publish(self, metrics: dict[str, Any]) -> None:
        self.replicas.last_report = self.replicas.report(metrics)
        self.reporter.publish(self.replicas.last_report)

    def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        self.reporter.checkpoint(self.replicas.report(metrics), checkpoint_dir)

    def save_sharded(self, *args: Any) -> Any:
        raise AssertionError("failure.mode=replicas keeps whole models "
                             "(the config refuses train.parallel=fsdp)")


def join_replicas(parts: Parts, progress: Progress, rank: int, workers: int,
                  rows: StepRows) -> Replicas:
    """Wrap `parts` (built for a process group of one) for replica `rank` of `workers`: gradients
    averaged over the quorum, optimizer steps and LR moves committed by it, the token normaliser
    summed over it, and the state a restarted peer copies from this one. Call before the first step,
    after any checkpoint was restored into `parts` and `progress`."""
    inner, schedule = parts.optimizer, parts.scheduler
    model = unwrap(parts.model)
    holder: list[Replicas] = []

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": inner.state_dict(),
                "scheduler": schedule.state_dict(), "precision": parts.precision.state_dict(),
                "report": holder[0].last_report,
                "progress": {"step": progress.step, "samples_seen": progress.samples_seen}}

    def load_state_dict(state: dict[str, Any]) -> None:
        # Applied in the quorum that heals this replica, before its first forward: the peer's state
        # at its step.
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["scheduler"])
        parts.precision.load_state_dict(state["precision"])
        peer = state["progress"]
        progress.step, progress.samples_seen = peer["step"], peer["samples_seen"]
        holder[0].last_report = state["report"]

    pg = ProcessGroupGloo(timeout=TIMEOUT)
    # A synchronous quorum: a restarted replica takes its peer's state before its forward, so it
    # trains its share of that very step like any other (with torchft's asynchronous quorum it would
    # run the step on stale weights and its share would be zeroed: rows dropped).
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=state_dict, world_size=1, rank=0, replica_id=f"replica_{rank}",
                      timeout=TIMEOUT * 2, use_async_quorum=False,
                      checkpoint_transport=PGTransport(pg, timeout=TIMEOUT, device=parts.device))
    # A checkpoint's step count, so that a whole group resumed from one agrees on where it is.
    manager.load_state_dict({"step": progress.step, "batches_committed": 0})
    parts.model = _QuorumDDP(manager, parts.model)
    optimizer = _CommitOptimizer(manager, inner)
    parts.optimizer = optimizer  # type: ignore[assignment]
    parts.scheduler = _CommitSchedule(schedule, optimizer)  # type: ignore[assignment]
    holder.append(Replicas(manager, optimizer, workers, rows, progress))
    parts.state.replicas = holder[0]
    return holder[0]
