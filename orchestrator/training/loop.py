"""The training loop, readable top to bottom: `train_step` (one optimizer step) and `run` (steps, eval, reports,
checkpoints). It knows nothing of Ray: the caller passes batch sources and a `report` function, so tests run it
in-process."""

from __future__ import annotations

import math
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from orchestrator.config import Config
from orchestrator.errors import UserError
from orchestrator.training.checkpoint import Progress, capture_rng, restore_rng, save_state, unwrap
from orchestrator.training.memory import cuda_memory_stats, device_facts, is_oom, release_cached_memory
from orchestrator.training.precision import Precision
from orchestrator.training.sync import LocalSGD, grad_bytes
from orchestrator.training.system import node_stats
from orchestrator.training.timing import PhaseTimer, count_flops, peak_flops

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
    split: int = 1  # each micro-batch is cut in this many pieces (doubled after an out-of-memory error)
    oom_retries: int = 0
    eager_model: torch.nn.Module | None = None  # set when `model` is compiled: the fallback if compiling fails
    local_sgd: LocalSGD | None = None  # set for train.sync=local_sgd: no gradient all-reduce, periodic averaging
    comm_bytes: int = 0  # bytes this rank has put into all-reduces of gradients, parameters and normalisers


@dataclass
class Interval:
    """Sums since the last report; losses stay on the device so no step waits for a host sync."""

    timer: PhaseTimer
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    targets: torch.Tensor | int = 0  # samples, or tokens for a language model (on the device: no host sync)
    samples: int = 0
    steps: int = 0
    micro: int = 0  # micro-batch size actually run (smaller after an out-of-memory retry)
    grad_norm_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    loss_targets: torch.Tensor | int = 0  # targets of the applied steps (a skipped non-finite step shows no loss)
    skipped: int = 0
    comm_start: int = 0  # Parts.comm_bytes when the interval began


IGNORE_INDEX = -100  # targets with this value (padding) count neither in the loss nor in its normaliser


def loss_sum(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy; one form for classes (B, C) vs (B,) and next tokens (B, T, V) vs (B, T)."""
    return F.cross_entropy(logits.float().flatten(0, -2), y.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


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
    local_targets = sum((y != IGNORE_INDEX).sum() for _, y in micro_batches).to(torch.float32)
    targets = local_targets.clone()
    # Local SGD: each rank's step is its own (no gradient mean), so the normaliser is its own targets too.
    world = _world()[1] if parts.local_sgd is None else 1
    if world > 1:
        dist.all_reduce(targets)
        parts.comm_bytes += targets.element_size()
    scale = world / targets.clamp(min=1)
    while True:
        pieces = [piece for x, y in micro_batches
                  for piece in zip(x.chunk(parts.split), y.chunk(parts.split), strict=True)]
        step_loss = _forward_backward(parts, pieces, scale, timer)
        if step_loss is not None:
            break
        parts.optimizer.zero_grad(set_to_none=True)
        release_cached_memory(parts.device)
        parts.split *= 2
        parts.oom_retries += 1
    samples = int(sum(len(y) for _, y in micro_batches))
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


def _any_rank(flag: torch.Tensor) -> bool:
    """True on every rank if `flag` is true on any rank (a MAX all-reduce; the flag itself in one process)."""
    flag = flag.to(torch.float32).reshape(1)
    if _world()[1] > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _non_finite_anywhere(step_loss: torch.Tensor, grad_norm: torch.Tensor, parts: Parts) -> bool:
    """True on every rank if any rank's loss (or the gradient) is NaN/inf. Losses differ per rank, and skipping on
    one rank only would leave the ranks' weights apart and their collectives misaligned: so all-reduce a flag.
    With fp16 the GradScaler already skips overflowing gradients, so only the loss is judged."""
    bad = ~torch.isfinite(step_loss)
    if parts.precision.scaler is None:
        bad = bad | ~torch.isfinite(grad_norm)
    return _any_rank(bad)


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
    ran out of memory before DDP's gradient all-reduce (every rank then redoes the step with smaller pieces)."""
    model = parts.model
    model.train()
    # DDP all-reduces gradients in the backward of the last piece only: every piece but the last runs under
    # no_sync. Under local SGD no piece is all-reduced: ranks step alone and average parameters later.
    ddp = hasattr(model, "no_sync") and parts.local_sgd is None
    # With several ranks, an OOM retry is decided together before the synced piece: a rank redoing the step alone
    # would meet the others' gradient all-reduce with collectives of its own (gloo aborts, NCCL hangs).
    together = ddp and _world()[1] > 1 and len(pieces) > 1
    total = torch.zeros((), device=parts.device)
    seconds: list[float] = []
    forward_s = 0.0

    def piece(x: torch.Tensor, y: torch.Tensor, synced: bool) -> None:
        nonlocal total, forward_s
        started = time.perf_counter()
        # The forward must be inside no_sync too, because DDP arms its reducer during forward.
        with nullcontext() if synced or not hasattr(model, "no_sync") else model.no_sync():
            with parts.precision.autocast():
                logits = model(x)
            loss = loss_sum(logits, y)
            forward_s = _elapsed(started, parts.device)
            parts.precision.backward(loss * scale)
        if synced and _world()[1] > 1:
            parts.comm_bytes += grad_bytes(model)
        total += loss.detach()
        seconds.append(_elapsed(started, parts.device))

    out_of_memory = False
    try:
        for x, y in pieces[:-1] if ddp else pieces:
            piece(x, y, synced=False)
    except Exception as exc:
        if not is_oom(exc):
            raise
        out_of_memory = True
        warnings.warn(f"out of memory: retrying the step with micro-batches cut in {parts.split * 2} "
                      "(same global batch, more accumulation)", stacklevel=3)
    if together:
        out_of_memory = _any_rank(torch.tensor(out_of_memory))
    if out_of_memory:
        return None
    if ddp:  # an OOM in here is not retried: it may strike inside the all-reduce, which one rank cannot undo
        piece(*pieces[-1], synced=True)
    # The all-reduce overlaps the last backward; what it adds beyond compute is the exposed sync time.
    if not (ddp and _world()[1] > 1):
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
    """Loss and accuracy over this rank's validation shard, summed across ranks."""
    # The bare module: DDP's forward would broadcast buffers, a collective that ranks must not call unevenly.
    model = unwrap(parts.model)
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=parts.device)  # loss, correct, targets
    for x, y in batches:
        with parts.precision.autocast():
            logits = model(x.to(parts.device, non_blocking=True))
        y = y.to(parts.device, non_blocking=True)
        valid = y != IGNORE_INDEX
        sums += torch.stack([loss_sum(logits, y).double(), ((logits.argmax(dim=-1) == y) & valid).sum().double(),
                             valid.sum().double()])
    loss, correct, count = _all_reduce(sums.tolist(), parts.device)
    release_cached_memory(parts.device)
    if count == 0:
        raise UserError("the validation split gave no rows to any worker: add rows or set data.val to null")
    return {"val_loss": loss / count, "val_accuracy": correct / count}


def micro_batches(
    train_batches: Callable[[int], Iterable[Batch]], progress: Progress, device: torch.device
) -> Iterator[Batch]:
    """Endless stream over epochs that keeps `progress` at the data position, skipping on resume the rows already
    trained on (the epoch is re-read from its start). The position counts rows, not micro-batches: a resumed run
    may cut micro-batches of another size (auto, or a changed train.micro_batch_size) and still sees every row once."""
    while True:
        produced, skip = False, progress.rows_in_epoch
        for x, y in train_batches(progress.epoch):
            produced = True
            if skip >= len(y):
                skip -= len(y)
                continue
            x, y, skip = x[skip:], y[skip:], 0  # a micro-batch straddling the position: only its untrained rows
            progress.rows_in_epoch += len(y)
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if not produced:
            raise UserError("the training split is smaller than one micro-batch per worker: "
                            "add rows, or lower train.global_batch_size / scaling.num_workers")
        progress.epoch += 1
        progress.rows_in_epoch = 0


def checkpoint_state(parts: Parts, progress: Progress, ranks: list[dict[str, Any]], micro_batch_size: int
                     ) -> dict[str, Any]:
    """Everything for an exact resume. `ranks` holds what differs per rank (`rank_state`, gathered on rank 0);
    `micro_batch_size` lets an auto-sized run resume with the micro-batch it ran with (the same rounding)."""
    state = {
        "model": unwrap(parts.model).state_dict(),
        "scheduler": parts.scheduler.state_dict(),
        "progress": asdict(progress),
        "rng": [r["rng"] for r in ranks],  # one entry per rank
        "micro_batch_size": micro_batch_size,
    }
    if parts.local_sgd is None:  # DDP: one optimizer state, the same on every rank
        return state | {"optimizer": parts.optimizer.state_dict(), "precision": parts.precision.state_dict()}
    # Local SGD: each rank's optimizer moments (and fp16 loss scale) follow its own data; keep them all.
    return state | {"optimizer": [r["optimizer"] for r in ranks], "precision": [r["precision"] for r in ranks],
                    "local_sgd": parts.local_sgd.state_dict()}


def rank_state(parts: Parts) -> dict[str, Any]:
    """What this rank contributes to a checkpoint beyond the shared model: its RNG streams, and under local SGD its
    own optimizer and precision state (on the CPU, so any rank can load it)."""
    state: dict[str, Any] = {"rng": capture_rng()}
    if parts.local_sgd is not None:
        state |= {"optimizer": _to_cpu(parts.optimizer.state_dict()), "precision": parts.precision.state_dict()}
    return state


def _to_cpu(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_to_cpu(v) for v in tree)
    return tree


def restore(parts: Parts, state: dict[str, Any]) -> Progress:
    """Load a checkpoint written by `checkpoint_state`. At the same world size every rank gets its RNG streams,
    optimizer state (its own under local SGD) and data position back (an exact resume); after a resize the run
    continues at the next epoch boundary."""
    rank, world = _world()
    same_world = len(state["rng"]) == world
    unwrap(parts.model).load_state_dict(state["model"])
    optimizer, precision = state["optimizer"], state["precision"]
    if parts.local_sgd is not None:
        # After a resize there is no state of "this rank": every rank starts from rank 0's.
        optimizer, precision = optimizer[rank if same_world else 0], precision[rank if same_world else 0]
    parts.optimizer.load_state_dict(optimizer)
    parts.scheduler.load_state_dict(state["scheduler"])
    parts.precision.load_state_dict(precision)
    if parts.local_sgd is not None:
        parts.local_sgd.load_state_dict(state.get("local_sgd", {}), unwrap(parts.model))
    progress = Progress(**state["progress"])
    if same_world:
        restore_rng(state["rng"][rank])
        return progress
    # Resized: Ray Data splits an epoch's rows into one stream per rank, so the old ranks' positions describe a
    # different split and skipping them here would miss some rows and repeat others. Finish the interrupted epoch
    # early instead (none of its rows is seen twice) and start the next one. New RNG streams, drawn per (step, rank).
    torch.manual_seed(int(np.random.default_rng([progress.step, rank]).integers(2**62)))
    if progress.rows_in_epoch:
        progress.epoch, progress.rows_in_epoch = progress.epoch + 1, 0
    return progress


def _check_finite_weights(parts: Parts, step: int) -> None:
    """A non-finite model is never checkpointed (it would poison every resume). Parameters are identical on all
    ranks at a checkpoint, so every rank reaches the same verdict."""
    if not all(bool(torch.isfinite(p).all()) for p in unwrap(parts.model).parameters()):
        raise NonFiniteLossError(f"the model weights are not finite at step {step}: not checkpointing them; lower "
                                 "optim.lr or set optim.max_grad_norm, and resume from the last checkpoint")


def _rank0_says(flag: bool, device: torch.device) -> bool:
    """Rank 0's value on every rank: a decision from a local clock must be the same everywhere, or the ranks'
    collective calls (checkpoint RNG gather, report) would no longer line up."""
    if _world()[1] == 1:
        return flag
    tensor = torch.tensor([float(flag)], device=device)
    dist.broadcast(tensor, src=0)
    return bool(tensor.item())


def _gather_rank_states(parts: Parts) -> list[dict[str, Any]]:
    """Every rank's `rank_state`, in rank order, on rank 0 (the checkpoint writer); an empty list elsewhere."""
    rank, world = _world()
    if world == 1:
        return [rank_state(parts)]
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(rank_state(parts), gathered, dst=0)
    return gathered or []


def run(
    cfg: Config,
    parts: Parts,
    train_batches: Callable[[int], Iterable[Batch]],
    val_batches: Callable[[], Iterable[Batch]] | None,
    report: ReportFn,
    progress: Progress | None = None,
    preempted: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Train to `cfg.train.max_steps`, reporting every `log_every` steps; returns the last reported metrics.
    `preempted` (a barrier, called at report steps) tells whether a node of the run is being drained: the next
    report then carries a checkpoint."""
    t = cfg.train
    assert t.max_steps is not None and isinstance(t.grad_accum_steps, int)  # resolved before the loop
    progress = progress or Progress()
    rank, world = _world()
    stream = micro_batches(train_batches, progress, parts.device)
    peak = peak_flops(parts.device, t.peak_tflops)
    interval = Interval(PhaseTimer(parts.device))
    metrics: dict[str, Any] = {}
    first: dict[str, Any] = {}  # one-off facts sent with the first report
    drain_saved = False
    last_saved = time.monotonic()  # for checkpoint.every_minutes
    if parts.local_sgd is not None and not parts.local_sgd.anchor:
        parts.local_sgd.start(unwrap(parts.model))
    while progress.step < t.max_steps:
        with interval.timer.phase("data_wait"):
            batch = [next(stream) for _ in range(t.grad_accum_steps)]
        if "flops_per_sample" not in first:
            first["flops_per_sample"] = _flops_per_sample(parts, *batch[0])
            first |= device_facts(parts.device)  # what `orchestrator doctor` judges precision and memory against
        if parts.eager_model is not None:  # the first step of this process, also after a resume: it compiles
            result, first["compile_s"] = _first_compiled_step(parts, batch)
            interval = Interval(PhaseTimer(parts.device), comm_start=parts.comm_bytes)  # compiling isn't training
        else:
            result = train_step(parts, batch, interval.timer)
        progress.step += 1
        progress.samples_seen += t.global_batch_size
        if result.skipped:
            progress.nonfinite_skipped += 1
            interval.skipped += 1
            if progress.nonfinite_skipped > t.max_nonfinite_steps:
                raise NonFiniteLossError(
                    f"{progress.nonfinite_skipped} steps had a non-finite loss or gradient (the last at step "
                    f"{progress.step}), more than train.max_nonfinite_steps={t.max_nonfinite_steps}: lower optim.lr, "
                    "raise optim.warmup_steps, set optim.max_grad_norm, use train.precision=bf16/fp32, or check "
                    "the data for NaN/inf values"
                )
        else:
            interval.loss_sum = interval.loss_sum.to(result.loss_sum.device) + result.loss_sum
            interval.grad_norm_sum = interval.grad_norm_sum.to(result.grad_norm.device) + result.grad_norm
            interval.loss_targets = interval.loss_targets + result.targets.double()
        interval.targets = interval.targets + result.targets.double()  # float64: token counts pass 2**24
        interval.samples += result.samples
        interval.steps += 1
        interval.micro = -(-len(batch[0][1]) // parts.split)

        # Every decision below depends on the step number only, so all ranks make the same collective calls.
        step, last = progress.step, progress.step == t.max_steps
        do_eval = val_batches is not None and (last or (t.eval_every is not None and step % t.eval_every == 0))
        do_ckpt = last or step % cfg.checkpoint.every == 0
        at_report = do_eval or do_ckpt or step % t.log_every == 0
        saving_for_drain = False
        if at_report and preempted is not None and not drain_saved and preempted():
            # Once per drain notice: the node is going away, so save the progress since the last checkpoint now.
            do_ckpt = saving_for_drain = drain_saved = True
        if at_report and not do_ckpt and cfg.checkpoint.every_minutes is not None:
            do_ckpt = _rank0_says(time.monotonic() - last_saved >= cfg.checkpoint.every_minutes * 60, parts.device)
        if parts.local_sgd is not None and (parts.local_sgd.due(step) or do_eval or do_ckpt):
            # Also before eval and checkpoints, so both see (and save) the one averaged model.
            with interval.timer.phase("sync"):
                parts.comm_bytes += parts.local_sgd.average(unwrap(parts.model))
        if not at_report:
            continue
        # Raises on a non-finite loss before anything is evaluated or saved: a broken model is never persisted.
        metrics = _interval_metrics(interval, progress, parts, world, peak)
        if saving_for_drain:
            metrics["drain_checkpoint"] = 1
        if do_eval:
            with interval.timer.phase("eval"):
                metrics |= evaluate(parts, val_batches())  # type: ignore[misc]
        checkpoint_dir = None
        with interval.timer.phase("checkpoint"):
            if do_ckpt:
                _check_finite_weights(parts, step)
                ranks = _gather_rank_states(parts)
                if rank == 0:
                    checkpoint_dir = tempfile.mkdtemp(prefix="orchestrator-ckpt-")
                    save_state(checkpoint_dir, checkpoint_state(parts, progress, ranks, t.micro_batch_size))
                last_saved = time.monotonic()
        metrics |= interval.timer.shares() | cuda_memory_stats(parts.device) | node_stats(world)
        # Wall seconds of this interval (the driver's cost ledger splits them by the time/* shares).
        metrics["interval_s"] = time.perf_counter() - interval.timer.started
        metrics |= first
        if peak and first["flops_per_sample"]:  # model FLOPs utilisation of the devices, during training steps
            metrics["mfu"] = first["flops_per_sample"] * metrics["samples_per_s"] / (peak * world)
        first = {"flops_per_sample": first["flops_per_sample"]}
        # The next interval starts now: time blocked in the report (a barrier; Ray also waits for its controller)
        # is billed to it as "report", so consecutive intervals tile the wall clock.
        interval = Interval(PhaseTimer(parts.device), comm_start=parts.comm_bytes)
        with interval.timer.phase("report"):
            try:
                report(metrics, checkpoint_dir)
            finally:
                if checkpoint_dir:
                    shutil.rmtree(checkpoint_dir, ignore_errors=True)
    return metrics


def _flops_per_sample(parts: Parts, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward + backward FLOPs per sample, counted once on the bare module (no DDP hooks, no compilation)."""
    model = unwrap(parts.model)

    def step() -> None:
        with parts.precision.autocast():
            logits = model(x)
        loss_sum(logits, y).backward()

    # Dropout draws random numbers: fork the RNG so counting leaves the training stream (and exact resume) intact.
    with torch.random.fork_rng(devices=[parts.device] if parts.device.type == "cuda" else []):
        flops = count_flops(step)
    model.zero_grad(set_to_none=True)
    return flops / max(len(y), 1)


def _first_compiled_step(parts: Parts, batch: list[Batch]) -> tuple[StepResult, float]:
    """The first step of a compiled model compiles it: timed apart, and on failure the model runs eagerly."""
    started = time.perf_counter()
    try:
        result = train_step(parts, batch)
    except Exception as exc:
        if is_oom(exc):
            raise
        warnings.warn(f"torch.compile failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                      "continuing in eager mode", stacklevel=2)
        parts.optimizer.zero_grad(set_to_none=True)
        parts.model, parts.eager_model = parts.eager_model, None  # type: ignore[assignment]
        result = train_step(parts, batch)
    parts.eager_model = None
    return result, _elapsed(started, parts.device)


def _interval_metrics(interval: Interval, progress: Progress, parts: Parts, world: int,
                      peak: float | None) -> dict[str, Any]:
    loss_sum_, targets, samples, loss_targets = _all_reduce(
        [float(interval.loss_sum), float(interval.targets), float(interval.samples), float(interval.loss_targets)],
        parts.device)
    loss = loss_sum_ / loss_targets if loss_targets else math.nan  # nan: every step of the interval was skipped
    if loss_targets and not math.isfinite(loss):
        raise NonFiniteLossError(
            f"training loss became {loss} by step {progress.step}: lower optim.lr, raise optim.warmup_steps, "
            "set optim.max_grad_norm, or use train.precision=bf16/fp32"
        )
    timer = interval.timer
    seconds = max(timer.training_seconds, 1e-9)
    metrics = {
        "step": progress.step,
        "epoch": progress.epoch,
        "samples_seen": progress.samples_seen,
        "train_loss": loss,
        "lr": parts.optimizer.param_groups[0]["lr"],
        "grad_norm": float(interval.grad_norm_sum) / max(interval.steps - interval.skipped, 1),
        "samples_per_s": samples / seconds,
        "data_wait_frac": timer.seconds["data_wait"] / seconds,
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
    if targets != samples:  # a language model: targets are tokens
        metrics["tokens_per_s"] = targets / seconds
    return metrics

