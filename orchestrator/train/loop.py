"""The training loop, readable top to bottom: `train_step` (one optimizer step) and `run` (steps, eval, reports,
checkpoints). It knows nothing of Ray: the caller passes batch sources and a `report` function, so tests run it
in-process."""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from orchestrator.config import Config
from orchestrator.errors import UserError
from orchestrator.train.checkpoint import Progress, capture_rng, restore_rng, save_state, unwrap
from orchestrator.train.precision import Precision

Batch = tuple[torch.Tensor, torch.Tensor]


class ReportFn(Protocol):
    """Called on every rank at the same steps (it is a barrier). `checkpoint_dir` is set on rank 0 only."""

    def __call__(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None: ...


class NonFiniteLossError(UserError):
    """The loss became NaN/inf; continuing would only write a broken model."""


@dataclass
class Parts:
    """What a step needs. `model` may be DDP-wrapped; `unwrap(model)` is the bare module."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    device: torch.device
    max_grad_norm: float | None = None


@dataclass
class Interval:
    """Sums since the last report; losses stay on the device so no step waits for a host sync."""

    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    samples: int = 0
    steps: int = 0
    grad_norm_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    data_wait_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce(values: list[float], device: torch.device) -> list[float]:
    """Sum across ranks (identity in a single process)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if _world()[1] > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


def train_step(parts: Parts, micro_batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward every micro-batch, then one optimizer step. Returns (summed loss, grad norm)."""
    model, precision = parts.model, parts.precision
    model.train()
    # Normalise by the samples of the whole step (not per micro-batch), so k micro-batches of size b give the
    # same gradient as one batch of k*b. DDP then averages over ranks, which all hold equal step sizes.
    step_samples = sum(len(y) for _, y in micro_batches)
    loss_sum = torch.zeros((), device=parts.device)
    for i, (x, y) in enumerate(micro_batches):
        is_last = i == len(micro_batches) - 1
        # Skip DDP's gradient all-reduce for every micro-batch but the last: the forward must be inside
        # no_sync too, because DDP arms its reducer during forward.
        sync = nullcontext() if is_last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with precision.autocast():
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y, reduction="sum")
            precision.backward(loss / step_samples)
        loss_sum += loss.detach()
    precision.unscale_(parts.optimizer)
    max_norm = parts.max_grad_norm if parts.max_grad_norm is not None else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    precision.step(parts.optimizer)
    parts.optimizer.zero_grad(set_to_none=True)
    parts.scheduler.step()
    return loss_sum, grad_norm.detach()


@torch.no_grad()
def evaluate(parts: Parts, batches: Iterable[Batch]) -> dict[str, float]:
    """Loss and accuracy over this rank's validation shard, summed across ranks."""
    # The bare module: DDP's forward would broadcast buffers, a collective that ranks must not call unevenly.
    model = unwrap(parts.model)
    model.eval()
    loss = correct = count = 0.0
    for x, y in batches:
        with parts.precision.autocast():
            logits = model(x.to(parts.device, non_blocking=True))
        y = y.to(parts.device, non_blocking=True)
        loss += float(F.cross_entropy(logits.float(), y, reduction="sum"))
        correct += float((logits.argmax(dim=1) == y).sum())
        count += len(y)
    loss, correct, count = _all_reduce([loss, correct, count], parts.device)
    if count == 0:
        raise UserError("the validation split gave no rows to any worker: add rows or set data.val to null")
    return {"val_loss": loss / count, "val_accuracy": correct / count}


def micro_batches(
    train_batches: Callable[[int], Iterable[Batch]], progress: Progress, device: torch.device
) -> Iterator[Batch]:
    """Endless stream over epochs that keeps `progress` at the data position, skipping on resume what was
    already trained on (the epoch is re-read from its start: resume granularity is one micro-batch)."""
    while True:
        produced = False
        for index, (x, y) in enumerate(train_batches(progress.epoch)):
            produced = True
            if index < progress.batch_in_epoch:
                continue
            progress.batch_in_epoch = index + 1
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if not produced:
            raise UserError("the training split is smaller than one micro-batch per worker: "
                            "add rows, or lower train.global_batch_size / scaling.num_workers")
        progress.epoch += 1
        progress.batch_in_epoch = 0


def checkpoint_state(parts: Parts, progress: Progress, rng_states: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": unwrap(parts.model).state_dict(),
        "optimizer": parts.optimizer.state_dict(),
        "scheduler": parts.scheduler.state_dict(),
        "precision": parts.precision.state_dict(),
        "progress": asdict(progress),
        "rng": rng_states,  # one entry per rank
    }


def restore(parts: Parts, state: dict[str, Any]) -> Progress:
    """Load a checkpoint written by `checkpoint_state`; RNG streams are restored when the world size matches."""
    unwrap(parts.model).load_state_dict(state["model"])
    parts.optimizer.load_state_dict(state["optimizer"])
    parts.scheduler.load_state_dict(state["scheduler"])
    parts.precision.load_state_dict(state["precision"])
    rank, world = _world()
    if len(state["rng"]) == world:
        restore_rng(state["rng"][rank])
    return Progress(**state["progress"])


def _gather_rng() -> list[dict[str, Any]]:
    rank, world = _world()
    if world == 1:
        return [capture_rng()]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, capture_rng())
    return gathered


def run(
    cfg: Config,
    parts: Parts,
    train_batches: Callable[[int], Iterable[Batch]],
    val_batches: Callable[[], Iterable[Batch]] | None,
    report: ReportFn,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Train to `cfg.train.max_steps`, reporting every `log_every` steps; returns the last reported metrics."""
    t = cfg.train
    assert t.max_steps is not None and t.grad_accum_steps is not None  # resolved by the driver
    progress = progress or Progress()
    rank, world = _world()
    stream = micro_batches(train_batches, progress, parts.device)
    interval = Interval()
    metrics: dict[str, Any] = {}
    while progress.step < t.max_steps:
        waited = time.perf_counter()
        batch = [next(stream) for _ in range(t.grad_accum_steps)]
        interval.data_wait_s += time.perf_counter() - waited
        loss_sum, grad_norm = train_step(parts, batch)
        progress.step += 1
        progress.samples_seen += t.global_batch_size
        interval.loss_sum = interval.loss_sum.to(loss_sum.device) + loss_sum
        interval.grad_norm_sum = interval.grad_norm_sum.to(grad_norm.device) + grad_norm
        interval.samples += sum(len(y) for _, y in batch)
        interval.steps += 1

        # Every decision below depends on the step number only, so all ranks make the same collective calls.
        step, last = progress.step, progress.step == t.max_steps
        do_eval = val_batches is not None and (last or (t.eval_every is not None and step % t.eval_every == 0))
        do_ckpt = last or step % cfg.checkpoint.every == 0
        if not (do_eval or do_ckpt or step % t.log_every == 0):
            continue
        metrics = _interval_metrics(interval, progress, parts, world)
        if do_eval:
            metrics |= evaluate(parts, val_batches())  # type: ignore[misc]
        checkpoint_dir = None
        if do_ckpt:
            # Never persist a broken model: _interval_metrics has already raised on a non-finite loss.
            rng_states = _gather_rng()
            if rank == 0:
                checkpoint_dir = tempfile.mkdtemp(prefix="orchestrator-ckpt-")
                save_state(checkpoint_dir, checkpoint_state(parts, progress, rng_states))
        try:
            report(metrics, checkpoint_dir)
        finally:
            if checkpoint_dir:
                shutil.rmtree(checkpoint_dir, ignore_errors=True)
        interval = Interval()
    return metrics


def _interval_metrics(interval: Interval, progress: Progress, parts: Parts, world: int) -> dict[str, Any]:
    loss_sum, samples = _all_reduce([float(interval.loss_sum), float(interval.samples)], parts.device)
    loss = loss_sum / max(samples, 1)
    if not math.isfinite(loss):
        raise NonFiniteLossError(
            f"training loss became {loss} by step {progress.step}: lower optim.lr, raise optim.warmup_steps, "
            "set optim.max_grad_norm, or use train.precision=bf16/fp32"
        )
    # The interval starts after the previous report, so eval, checkpoint and report time are not in it.
    elapsed = time.perf_counter() - interval.started
    return {
        "step": progress.step,
        "epoch": progress.epoch,
        "samples_seen": progress.samples_seen,
        "train_loss": loss,
        "lr": parts.optimizer.param_groups[0]["lr"],
        "grad_norm": float(interval.grad_norm_sum) / max(interval.steps, 1),
        "samples_per_s": samples / max(elapsed, 1e-9),
        "data_wait_frac": interval.data_wait_s / max(elapsed, 1e-9),
        "skipped_steps": parts.precision.skipped_steps,
        "world_size": world,
    }
