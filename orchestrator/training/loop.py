"""The training loop, readable top to bottom: `train_step` (one optimizer step) and `run` (steps, eval, reports,
checkpoints). It knows nothing of Ray: the caller passes batch sources and a `Reporter`, so tests run it
in-process."""

from __future__ import annotations

import math
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from orchestrator.config import Config
from orchestrator.errors import UserError
from orchestrator.tasks import step_loss_sum
from orchestrator.training import ranks
from orchestrator.training.checkpoint import Progress, checkpoint_state, save_state, unwrap
from orchestrator.training.memory import cuda_memory_stats, device_facts, is_oom, release_cached_memory
from orchestrator.training.parts import Parts
from orchestrator.training.sync import grad_bytes
from orchestrator.training.system import node_stats
from orchestrator.training.timing import PhaseTimer, count_flops, peak_flops
from pipelines.tensors import Batch, chunk, rows, take, to_device


class Reporter(Protocol):
    """Where reports go. Both are called on every rank at the same steps."""

    def publish(self, metrics: dict[str, Any]) -> None:
        """Every report step: the interval's metrics to whoever watches the run, without waiting for anyone (no
        barrier: a report step must cost no more than the steps between two)."""

    def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        """Checkpoint steps only: register the checkpoint (a barrier); `checkpoint_dir` is set on rank 0 only."""


class NonFiniteLossError(UserError):
    """The loss became NaN/inf; continuing would only write a broken model."""


class DeviceMemoryError(UserError):
    """Even the smallest micro-batch does not fit in device memory."""


@dataclass
class Interval:
    """Sums since the last report; losses stay on the device so no step waits for a host sync."""

    timer: PhaseTimer
    loss_sum: torch.Tensor | float = 0.0  # a tensor on the device from the first applied step
    targets: torch.Tensor | int = 0  # samples, or tokens for a language model (on the device: no host sync)
    samples: int = 0
    steps: int = 0
    micro: int = 0  # micro-batch size actually run (smaller after an out-of-memory retry)
    grad_norm_sum: torch.Tensor | float = 0.0
    loss_targets: torch.Tensor | int = 0  # targets of the applied steps (a skipped non-finite step shows no loss)
    skipped: int = 0
    comm_start: int = 0  # Parts.comm_bytes when the interval began

    def add(self, result: StepResult, micro: int) -> None:
        """Count one step; a skipped (non-finite) step adds its targets but no loss or gradient norm."""
        if not result.skipped:
            self.loss_sum = result.loss_sum + self.loss_sum
            self.grad_norm_sum = result.grad_norm + self.grad_norm_sum
            self.loss_targets = self.loss_targets + result.targets.double()
        self.targets = self.targets + result.targets.double()  # float64: token counts pass 2**24
        self.samples += result.samples
        self.steps += 1
        self.skipped += result.skipped
        self.micro = micro


def train_step(parts: Parts, micro_batches: list[Batch], timer: PhaseTimer | None = None) -> StepResult:
    """Forward/backward every micro-batch, then one optimizer step.

    After an out-of-memory error on any rank before DDP's gradient all-reduce, every rank redoes the step with
    each micro-batch cut in two (twice the accumulation): the same samples and the same normaliser, so the same
    update.
    """
    timer = timer or PhaseTimer(parts.device)
    # Normalise by the targets (samples, or tokens) of the whole step on all ranks, not per micro-batch: then
    # k micro-batches of size b give the gradient of one batch of k*b, and DDP's mean over ranks (hence the
    # world factor) gives the mean over the global batch even when ranks hold different token counts.
    local_targets = sum(parts.task.count(batch) for batch in micro_batches).to(torch.float32)
    targets = local_targets.clone()
    # Local SGD: each rank's step is its own (no gradient mean), so the normaliser is its own targets too.
    world = ranks.world()[1] if parts.local_sgd is None else 1
    if world > 1:
        dist.all_reduce(targets)
        parts.comm_bytes += targets.element_size()
    scale = world / targets.clamp(min=1)
    while True:
        pieces = [piece for batch in micro_batches for piece in chunk(batch, parts.split)]
        step_loss = _forward_backward(parts, pieces, scale, timer)
        if step_loss is not None:
            break
        parts.optimizer.zero_grad(set_to_none=True)
        release_cached_memory(parts.device)
        parts.split *= 2
        parts.oom_retries += 1
    samples = sum(rows(batch) for batch in micro_batches)
    with timer.phase("compute"):
        parts.precision.unscale_(parts.optimizer)
        max_norm = parts.max_grad_norm if parts.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(parts.model.parameters(), max_norm)
        if _non_finite_anywhere(step_loss, grad_norm, parts):
            # No update from this step; its samples are consumed and the LR schedule (indexed by samples) moves
            # on, as after a step the fp16 scaler skips.
            parts.optimizer.zero_grad(set_to_none=True)
            parts.precision.skip()
            with warnings.catch_warnings():  # torch warns when the schedule moves before any optimizer step
                warnings.simplefilter("ignore", UserWarning)
                parts.scheduler.step()
            return StepResult(step_loss, grad_norm.detach(), samples, local_targets, skipped=True)
        parts.precision.step(parts.optimizer)
        parts.optimizer.zero_grad(set_to_none=True)
        parts.scheduler.step()
    return StepResult(step_loss, grad_norm.detach(), samples, local_targets)


def _non_finite_anywhere(step_loss: torch.Tensor, grad_norm: torch.Tensor, parts: Parts) -> bool:
    """True on every rank if any rank's loss (or the gradient) is NaN/inf. Losses differ per rank, and skipping on
    one rank only would leave the ranks' weights apart and their collectives misaligned: so all-reduce a flag.
    With fp16 the GradScaler already skips overflowing gradients, so only the loss is judged."""
    bad = ~torch.isfinite(step_loss)
    if parts.precision.scaler is None:
        bad = bad | ~torch.isfinite(grad_norm)
    return ranks.any_rank(bad, parts.device)


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # summed over this rank's targets
    grad_norm: torch.Tensor
    samples: int
    targets: torch.Tensor  # this rank's targets (samples, or tokens) in the step, on the device
    skipped: bool = False  # non-finite loss or gradient on some rank: no update was applied


def _forward_backward(parts: Parts, pieces: list[Batch], scale: torch.Tensor,
                      timer: PhaseTimer) -> torch.Tensor | None:
    """Forward and backward of every piece, accumulating gradients; returns the summed loss, or None when some rank
    ran out of memory before DDP's gradient all-reduce (every rank then redoes the step with smaller pieces).
    DeviceMemoryError when pieces of one row still do not fit."""
    model = parts.model
    model.train()
    # DDP all-reduces gradients in the backward of the last piece only: every piece but the last runs under
    # no_sync. Under local SGD no piece is all-reduced: ranks step alone and average parameters later.
    ddp = hasattr(model, "no_sync") and parts.local_sgd is None
    # With several ranks, an OOM retry is decided together before the synced piece: a rank redoing the step alone
    # would meet the others' gradient all-reduce with collectives of its own (gloo aborts, NCCL hangs).
    together = ddp and ranks.world()[1] > 1 and len(pieces) > 1
    total = torch.zeros((), device=parts.device)
    seconds: list[float] = []
    forward_s = 0.0

    def piece(batch: Batch, synced: bool) -> None:
        nonlocal total, forward_s
        started = time.perf_counter()
        # The forward must be inside no_sync too, because DDP arms its reducer during forward.
        with nullcontext() if synced or not hasattr(model, "no_sync") else model.no_sync():
            with parts.precision.autocast():
                output = parts.call(model, batch)
            loss = step_loss_sum(parts.task, output, batch, parts.model_loss)
            forward_s = _elapsed(started, parts.device)
            parts.precision.backward(loss * scale)
        if synced and ranks.world()[1] > 1:
            parts.comm_bytes += grad_bytes(model)
        total += loss.detach()
        seconds.append(_elapsed(started, parts.device))

    ran_out = False  # on this rank
    try:
        for batch in pieces[:-1] if ddp else pieces:
            piece(batch, synced=False)
    except Exception as exc:
        if not is_oom(exc):
            raise
        ran_out = True
    if ranks.any_rank(ran_out, parts.device) if together else ran_out:
        # Once no rank's pieces can be cut further, a retry would redo the identical step forever.
        splittable = max(rows(batch) for batch in pieces) > 1
        if not (ranks.any_rank(splittable, parts.device) if together else splittable):
            raise DeviceMemoryError(
                "out of memory even with a micro-batch of 1 row: use a smaller model or shorter sequences, "
                "train.precision=bf16, or a device with more memory")
        if ran_out:  # the rank that ran out says so; the others retry quietly, as agreed
            warnings.warn(f"out of memory: retrying the step with micro-batches cut in {parts.split * 2} "
                          "(same global batch, more accumulation)", stacklevel=3)
        return None
    if ddp:  # an OOM in here is not retried: it may strike inside the all-reduce, which one rank cannot undo
        piece(pieces[-1], synced=True)
    # The all-reduce overlaps the last backward; what it adds beyond compute is the exposed sync time.
    if not (ddp and ranks.world()[1] > 1):
        sync_s = 0.0
    elif len(seconds) > 1:
        sync_s = max(0.0, seconds[-1] - sum(seconds[:-1]) / (len(seconds) - 1))
    else:  # no unsynced piece to compare with: backward costs about twice the forward's FLOPs
        sync_s = max(0.0, seconds[-1] - 3 * forward_s)
    timer.add("compute", sum(seconds) - sync_s)
    timer.add("sync", sync_s)
    return total


def _elapsed(started: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


@torch.no_grad()
def evaluate(parts: Parts, batches: Iterable[Batch]) -> dict[str, float]:
    """The task's validation metrics over this rank's validation shard, their sums added across ranks."""
    # The bare module: DDP's forward would broadcast buffers, a collective that ranks must not call unevenly.
    model = unwrap(parts.model)
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    for batch in batches:
        batch = to_device(batch, parts.device)
        with parts.precision.autocast():
            output = parts.call(model, batch)
        for key, value in parts.task.metric_sums(output, batch).items():
            totals[key] = totals.get(key, 0) + value.double()
    # Every rank reduces the same keys in the same order; a rank without rows learns them from the others.
    keys = sorted(ranks.gather_keys(list(totals)))
    sums = dict(zip(keys, ranks.all_reduce_sum([float(totals.get(k, 0.0)) for k in keys], parts.device),
                    strict=True))
    release_cached_memory(parts.device)
    if not sums.get("count"):
        raise UserError("the validation split gave no rows to any worker: add rows or set data.val to null")
    return parts.task.metrics(sums)


def micro_batches(
    train_batches: Callable[[int], Iterable[Batch]], progress: Progress, device: torch.device
) -> Iterator[Batch]:
    """Endless stream over epochs that keeps `progress` at the data position, skipping on resume the rows already
    trained on (the epoch is re-read from its start). The position counts rows, not micro-batches: a resumed run
    may cut micro-batches of another size (auto, or a changed train.micro_batch_size) and still sees every row once."""
    while True:
        produced, skip = False, progress.rows_in_epoch
        for batch in train_batches(progress.epoch):
            produced = True
            if skip >= rows(batch):
                skip -= rows(batch)
                continue
            batch, skip = take(batch, slice(skip, None)), 0  # straddling the position: only its untrained rows
            progress.rows_in_epoch += rows(batch)
            yield to_device(batch, device)
        if not produced:
            raise UserError("the training split is smaller than one micro-batch per worker: "
                            "add rows, or lower train.global_batch_size / scaling.num_workers")
        progress.epoch += 1
        progress.rows_in_epoch = 0


def _check_finite_weights(parts: Parts, step: int) -> None:
    """A non-finite model is never checkpointed (it would poison every resume). Parameters are identical on all
    ranks at a checkpoint, so every rank reaches the same verdict."""
    if not all(bool(torch.isfinite(p).all()) for p in unwrap(parts.model).parameters()):
        raise NonFiniteLossError(f"the model weights are not finite at step {step}: not checkpointing them; lower "
                                 "optim.lr or set optim.max_grad_norm, and resume from the last checkpoint")


@dataclass
class Due:
    """What follows a report step: evaluation, and a checkpoint (`drain`: an extra one for a node going away)."""

    eval: bool
    checkpoint: bool
    drain: bool = False


class Cadence:
    """When to evaluate, checkpoint and report. Decided by the step number, rank 0's clock and the drain notice
    (both broadcast), so every rank makes the same collective calls at the same steps."""

    def __init__(self, cfg: Config, has_val: bool, preempted: Callable[[], bool] | None, device: torch.device
                 ) -> None:
        self.t, self.ckpt = cfg.train, cfg.checkpoint
        self.has_val, self.preempted, self.device = has_val, preempted, device
        self.drain_saved = False
        self.last_saved = time.monotonic()  # for checkpoint.every_minutes

    def at(self, step: int) -> Due | None:
        """What is due after `step`; None when it is not a report step."""
        last = step == self.t.max_steps
        due = Due(eval=self.has_val and (last or (self.t.eval_every is not None and step % self.t.eval_every == 0)),
                  checkpoint=last or step % self.ckpt.every == 0)
        if not (due.eval or due.checkpoint or step % self.t.log_every == 0):
            return None
        if self.preempted is not None and not self.drain_saved and self.preempted():
            # Once per drain notice: the node is going away, so save the progress since the last checkpoint now.
            due.checkpoint = due.drain = self.drain_saved = True
        if not due.checkpoint and self.ckpt.every_minutes is not None:
            due.checkpoint = ranks.rank0_says(time.monotonic() - self.last_saved >= self.ckpt.every_minutes * 60,
                                              self.device)
        if due.checkpoint:
            self.last_saved = time.monotonic()
        return due


def run(
    cfg: Config,
    parts: Parts,
    train_batches: Callable[[int], Iterable[Batch]],
    val_batches: Callable[[], Iterable[Batch]] | None,
    reporter: Reporter,
    progress: Progress | None = None,
    preempted: Callable[[], bool] | None = None,
    facts: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train to `cfg.train.max_steps`, publishing metrics every `log_every` steps; returns the last metrics.
    `preempted` (a barrier, called at report steps) tells whether a node of the run is being drained: the next
    report then carries a checkpoint. `facts` go out once, with the first report of this (re)start, together with
    when (`at/*`, epoch seconds) the loop started and had its first batch: the driver's start-up breakdown."""
    t = cfg.train
    assert t.max_steps is not None and isinstance(t.grad_accum_steps, int)  # resolved before the loop
    progress = progress or Progress()
    rank, world = ranks.world()
    stream = micro_batches(train_batches, progress, parts.device)
    cadence = Cadence(cfg, val_batches is not None, preempted, parts.device)
    peak = peak_flops(parts.device, t.peak_tflops)
    metrics: dict[str, Any] = {}
    once = dict(facts or {}) | device_facts(parts.device) | {"at/loop": time.time()}
    flops_per_sample: float | None = None
    if parts.local_sgd is not None and not parts.local_sgd.anchor:
        parts.local_sgd.start(unwrap(parts.model))
    # Waiting for the first batch is start-up (the pipeline's first read), not part of the first interval.
    first = [next(stream) for _ in range(t.grad_accum_steps)] if progress.step < t.max_steps else None
    once["at/first_batch"] = time.time()
    interval = Interval(PhaseTimer(parts.device))
    while progress.step < t.max_steps:
        if first is not None:
            batch, first = first, None
        else:
            with interval.timer.phase("data_wait"):
                batch = [next(stream) for _ in range(t.grad_accum_steps)]
        if flops_per_sample is None:
            flops_per_sample = _flops_per_sample(parts, batch[0])
        if parts.eager_model is not None:  # the first step of this process, also after a resume: it compiles
            result, once["compile_s"] = _first_compiled_step(parts, batch)
            interval = Interval(PhaseTimer(parts.device), comm_start=parts.comm_bytes)  # compiling isn't training
        else:
            result = train_step(parts, batch, interval.timer)
        progress.step += 1
        progress.samples_seen += t.global_batch_size
        progress.nonfinite_skipped += result.skipped
        if progress.nonfinite_skipped > t.max_nonfinite_steps:
            raise NonFiniteLossError(
                f"{progress.nonfinite_skipped} steps had a non-finite loss or gradient (the last at step "
                f"{progress.step}), more than train.max_nonfinite_steps={t.max_nonfinite_steps}: lower optim.lr, "
                "raise optim.warmup_steps, set optim.max_grad_norm, use train.precision=bf16/fp32, or check "
                "the data for NaN/inf values"
            )
        interval.add(result, micro=-(-rows(batch[0]) // parts.split))

        due = cadence.at(progress.step)
        if parts.local_sgd is not None and (parts.local_sgd.due(progress.step) or (due and (due.eval or
                                                                                          due.checkpoint))):
            # Also before eval and checkpoints, so both see (and save) the one averaged model.
            with interval.timer.phase("sync"):
                parts.comm_bytes += parts.local_sgd.average(unwrap(parts.model))
        if due is None:
            continue
        # Raises on a non-finite loss before anything is evaluated or saved: a broken model is never persisted.
        metrics, samples, targets = _interval_metrics(interval, progress, parts, world)
        if due.drain:
            metrics["drain_checkpoint"] = 1
        if due.eval:
            with interval.timer.phase("eval"):
                metrics |= evaluate(parts, val_batches())  # type: ignore[misc]
        checkpoint_dir = None
        with interval.timer.phase("checkpoint"):
            if due.checkpoint:
                _check_finite_weights(parts, progress.step)
                state = checkpoint_state(parts, progress, t.micro_batch_size)  # a collective: every rank
                if state is not None:
                    checkpoint_dir = tempfile.mkdtemp(prefix="orchestrator-ckpt-")
                    save_state(checkpoint_dir, state)
        metrics |= interval.timer.shares() | cuda_memory_stats(parts.device) | node_stats(world)
        metrics |= _worker_paces(interval, parts.device)
        # Throughput is the wall clock's: the interval from the end of the previous report to now, with its data
        # waits, evaluation, checkpoint and the time the previous report blocked (consecutive intervals tile the
        # run, and the driver's cost ledger splits each by the time/* shares).
        seconds = max(time.perf_counter() - interval.timer.started, 1e-9)
        metrics["interval_s"] = seconds
        metrics["samples_per_s"] = samples / seconds
        metrics["data_wait_frac"] = metrics["time/data_wait_frac"]
        if getattr(parts.task, "counts_tokens", False):  # a user's task need not subclass Task
            metrics["tokens_per_s"] = targets / seconds
        metrics["flops_per_sample"] = flops_per_sample
        if peak and flops_per_sample:  # model FLOPs utilisation of the devices over the wall clock
            metrics["mfu"] = flops_per_sample * metrics["samples_per_s"] / (peak * world)
        metrics |= once
        once = {}
        # The next interval starts now: time blocked in registering the checkpoint is billed to it as "report".
        interval = Interval(PhaseTimer(parts.device), comm_start=parts.comm_bytes)
        with interval.timer.phase("report"):
            try:
                if due.checkpoint:
                    reporter.checkpoint(metrics, checkpoint_dir)
            finally:
                if checkpoint_dir:
                    shutil.rmtree(checkpoint_dir, ignore_errors=True)
            reporter.publish(metrics)
    return metrics


def _worker_paces(interval: Interval, device: torch.device) -> dict[str, float]:
    """Each rank's own pace: its samples over its compute and data-wait seconds (time spent waiting for the other
    ranks is sync). Under DDP every step waits for the slowest rank, so one slow node shows here (doctor)."""
    rank, world = ranks.world()
    if world == 1:
        return {}
    busy = interval.timer.seconds["compute"] + interval.timer.seconds["data_wait"]
    paces = [0.0] * world
    paces[rank] = interval.samples / max(busy, 1e-9)
    return {f"worker/{r}/samples_per_s": p for r, p in enumerate(ranks.all_reduce_sum(paces, device))}


def _flops_per_sample(parts: Parts, batch: Batch) -> float:
    """Forward + backward FLOPs per sample, counted once on the bare module (no DDP hooks, no compilation)."""
    model = unwrap(parts.model)

    def step() -> None:
        with parts.precision.autocast():
            output = parts.call(model, batch)
        step_loss_sum(parts.task, output, batch, parts.model_loss).backward()

    # Dropout draws random numbers: fork the RNG so counting leaves the training stream (and exact resume) intact.
    with torch.random.fork_rng(devices=[parts.device] if parts.device.type == "cuda" else []):
        flops = count_flops(step)
    model.zero_grad(set_to_none=True)
    return flops / max(rows(batch), 1)


def _first_compiled_step(parts: Parts, batch: list[Batch]) -> tuple[StepResult, float]:
    """The first step of a compiled model compiles it: timed apart. Compiling can fail on some ranks only (a
    backend missing on one node): every rank first compiles on one piece without a collective, then all agree, and
    all run eagerly if any failed. A rank that redid the step alone would meet the others' collectives with its own."""
    started = time.perf_counter()
    failure = _compile_failure(parts, batch[0])
    if ranks.any_rank(failure is not None, parts.device):
        why = failure or "on another rank"
        warnings.warn(f"torch.compile failed ({why}); continuing in eager mode", stacklevel=2)
        parts.model = parts.eager_model  # type: ignore[assignment]
    parts.eager_model = None
    result = train_step(parts, batch)
    return result, _elapsed(started, parts.device)


def _compile_failure(parts: Parts, batch: Batch) -> str | None:
    """Forward and backward of the compiled model on the first piece, which compiles both: the error's first line if
    that fails, else None. Runs under DDP's no_sync (no gradient all-reduce; a buffer broadcast in forward is called
    by every rank alike) with the RNG forked; the gradients are dropped and the buffers (BatchNorm's running
    statistics) put back, so the step itself runs as without the probe. Out of memory: the probe is retried on
    smaller pieces, down to one row (the step's own agreed retry then handles memory)."""
    model = parts.model
    buffers = {name: value.clone() for name, value in unwrap(model).named_buffers()}
    model.train()
    pieces = chunk(batch, parts.split)
    try:
        while True:
            try:
                with torch.random.fork_rng(devices=[parts.device] if parts.device.type == "cuda" else []), \
                        model.no_sync() if hasattr(model, "no_sync") else nullcontext():
                    with parts.precision.autocast():
                        output = parts.call(model, pieces[0])
                    step_loss_sum(parts.task, output, pieces[0], parts.model_loss).backward()
                return None
            except Exception as exc:
                if is_oom(exc) and rows(pieces[0]) > 1:
                    parts.optimizer.zero_grad(set_to_none=True)
                    release_cached_memory(parts.device)
                    pieces = chunk(pieces[0], 2)
                    continue
                if is_oom(exc):
                    return None
                # Two lines: dynamo's first ("backend='inductor' raised:") and the backend's own error after it.
                lines = [line for line in str(exc).splitlines() if line.strip()]
                return f"{type(exc).__name__}: {' '.join(lines[:2])[:240]}"
    finally:
        parts.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, value in unwrap(model).named_buffers():
                value.copy_(buffers[name])


def _interval_metrics(interval: Interval, progress: Progress, parts: Parts, world: int
                      ) -> tuple[dict[str, Any], float, float]:
    """The interval's figures summed over ranks, with its sample and target counts (throughput comes later, once
    the interval's wall time is known)."""
    loss_sum_, targets, samples, loss_targets = ranks.all_reduce_sum(
        [float(interval.loss_sum), float(interval.targets), float(interval.samples), float(interval.loss_targets)],
        parts.device)
    loss = loss_sum_ / loss_targets if loss_targets else math.nan  # nan: every step of the interval was skipped
    if loss_targets and not math.isfinite(loss):
        raise NonFiniteLossError(
            f"training loss became {loss} by step {progress.step}: lower optim.lr, raise optim.warmup_steps, "
            "set optim.max_grad_norm, or use train.precision=bf16/fp32"
        )
    metrics = {
        "step": progress.step,
        "epoch": progress.epoch,
        "samples_seen": progress.samples_seen,
        "train_loss": loss,
        "lr": parts.optimizer.param_groups[0]["lr"],
        "grad_norm": float(interval.grad_norm_sum) / max(interval.steps - interval.skipped, 1),
        "skipped_steps": parts.precision.skipped_steps,
        "nonfinite_skipped": progress.nonfinite_skipped,
        "oom_retries": parts.oom_retries,
        "micro_batch_size": interval.micro,
        "world_size": world,
        # What DDP vs local SGD costs the network: bytes one rank put into all-reduces since it started, and in
        # this interval per sample of the global batch (the eval/checkpoint average of this report included).
        "comm_bytes": parts.comm_bytes,
        "comm_bytes_per_sample": (parts.comm_bytes - interval.comm_start) / max(samples, 1),
    }
    return metrics, samples, targets
