"""failure.mode=replicas on the worker side: the torchft wiring that lets one worker fail while the others keep
stepping. Each Ray Train worker is one replica group (Ray's `TorchftConfig` gives each its own process group of one
and starts torchft's lighthouse). A torchft `Manager` forms a quorum of the live replicas at the start of every step;
the model's gradients are averaged over that quorum (torchft's DDP comm hook) and the optimizer steps only when the
quorum agrees the step committed. A restarted worker copies model, optimizer, schedule and step count from a live peer
at its first step instead of reading the checkpoint. The live replicas split the whole global batch between them, so
a step's samples (and the LR schedule indexed by them) do not change when a replica is missing."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport
from torchft.optim import OptimizerWrapper

from orchestrator.config.batching import replica_micro_batches
from orchestrator.training.checkpoint import Progress, unwrap
from orchestrator.training.parts import Parts
from orchestrator.training.timing import PhaseTimer

# How long a live replica waits in a collective for a peer that died before the quorum drops it; the restarted
# replica's first quorum and state transfer must fit in it too (torchft's example uses the same on loaded machines).
TIMEOUT = timedelta(seconds=30)
# How long a fresh run's first step waits for every replica to join its quorum (they start together, give or take
# their data pipelines' start).
START_WAIT_S = 60.0


class StridedShard:
    """A replica's part of a Ray dataset that it iterates whole: every `workers`-th micro-batch (fetched `micro` rows
    at a time: a fetch of many micro-batches could leave a small dataset with none for some rank), from the
    `rank`-th. Ray Train's own sharded iterators do not survive a replica group's replacement in Ray 2.60, and a
    split's epochs start together on every rank, where a restarted replica could only join at an epoch's start;
    these need no other rank. The cost: every replica reads (and decodes) every row."""

    def __init__(self, dataset: Any, rank: int, workers: int, micro: int) -> None:
        self.iterator, self.rank, self.workers, self.micro = dataset.iterator(), rank, workers, micro

    def iter_torch_batches(self, **kwargs: Any) -> Iterator[Any]:
        batches = self.iterator.iter_torch_batches(**(kwargs | {"batch_size": self.micro}))
        return itertools.islice(batches, self.rank, None, self.workers)


class _QuorumDDP(DistributedDataParallel):
    """torchft's DDP with a comm hook that survives the failure it is there for: torchft 0.2.0's own hook asserts
    (`assert fut._fut`) when a peer dies inside the all-reduce (gloo: "Connection reset by peer"), killing the
    survivor too. Here the error stays with the manager, whose `should_commit` then drops the step."""

    @staticmethod
    def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses string annotations (ours, lazy)
        state.allreduce(bucket.buffer()).wait()  # averaged over the quorum in place, or left as is after an error
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done


class _CommitOptimizer(OptimizerWrapper):
    """torchft's optimizer wrapper, except that `zero_grad` does not start a quorum: the loop starts one at the top
    of each step (`Replicas.begin_step`), where it also learns the share of the batch. The loop's step zeroes the
    gradients after the update and again after an out-of-memory retry, neither of which is a new step."""

    dropped = 0  # steps whose update the quorum did not commit (a peer failed inside them)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none)

    def step(self, closure: object = None) -> None:
        if self.manager.should_commit():
            self.optim.step()
        else:
            self.dropped += 1


class Replicas:
    """This worker's replica: its torchft manager and the batch arithmetic of a step."""

    def __init__(self, manager: Manager, optimizer: _CommitOptimizer, workers: int, global_batch: int,
                 micro_batch: int) -> None:
        self.manager, self.optimizer, self.workers = manager, optimizer, workers
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.participants = 0  # of the current step's quorum

    def begin_step(self, timer: PhaseTimer) -> int:
        """Form this step's quorum (blocks until the live replicas agree on it, billed as sync; a restarted replica
        starts fetching a live peer's state here) and return the micro-batches this replica runs: its share of the
        global batch."""
        with timer.phase("sync"):
            self.manager.start_quorum()
            self.participants = self.manager.num_participants()
            # A fresh run's first quorum forms as soon as one replica asks. Alone, it would run ahead in its data
            # shard, then wait at Ray Data's epoch barrier while the others wait for it in their quorum (a stall of
            # torchft's 60 s join timeout): so at step 0 it asks again until every replica is in, for a while.
            began = time.monotonic()
            while (self.manager.current_step() == 0 and self.participants < self.workers
                   and time.monotonic() - began < START_WAIT_S):
                time.sleep(0.2)
                self.manager.start_quorum()
                self.participants = self.manager.num_participants()
        return replica_micro_batches(self.global_batch, self.micro_batch, self.participants)

    def figures(self) -> dict[str, int]:
        """For the report: the live replicas of the last step's quorum, the steps this process's quorum did not
        commit (their update dropped, as for a non-finite step; the step still counts, the LR moves on), and the
        run's workers (the loop's own world is this replica's process group of one)."""
        return {"replicas/live": self.participants, "replicas/dropped_steps": self.optimizer.dropped,
                "world_size": self.workers}

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def join_replicas(parts: Parts, progress: Progress, rank: int, workers: int, global_batch: int,
                  micro_batch: int) -> Replicas:
    """Wrap `parts` (built for a process group of one) for replica `rank` of `workers`: gradients averaged over the
    quorum, optimizer steps committed by it, and the state a restarted peer copies from this one. Call before the
    first step, after any checkpoint was restored into `parts` and `progress`."""
    inner = parts.optimizer
    model = unwrap(parts.model)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": inner.state_dict(), "scheduler": parts.scheduler.state_dict(),
                "precision": parts.precision.state_dict(),
                "progress": {"step": progress.step, "samples_seen": progress.samples_seen}}

    def load_state_dict(state: dict[str, Any]) -> None:
        # Applied inside the first step's commit, before its optimizer update: the peer's state at the same step.
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optimizer"])
        parts.scheduler.load_state_dict(state["scheduler"])
        parts.precision.load_state_dict(state["precision"])
        progress.step, progress.samples_seen = state["progress"]["step"], state["progress"]["samples_seen"]

    pg = ProcessGroupGloo(timeout=TIMEOUT)
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
                      world_size=1, rank=0, replica_id=f"replica_{rank}", timeout=TIMEOUT * 2,
                      checkpoint_transport=PGTransport(pg, timeout=TIMEOUT, device=parts.device))
    # A checkpoint's step count, so that a whole group resumed from one agrees on where it is.
    manager.load_state_dict({"step": progress.step, "batches_committed": 0})
    parts.model = _QuorumDDP(manager, parts.model)
    optimizer = _CommitOptimizer(manager, inner)
    parts.optimizer = optimizer  # type: ignore[assignment]
    return Replicas(manager, optimizer, workers, global_batch, micro_batch)

