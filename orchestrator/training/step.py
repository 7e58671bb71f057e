"""One optimizer step, readable top to bottom: forward and backward of every micro-batch (gradient accumulation
with one all-reduce), the out-of-memory retry the ranks agree on, the non-finite check, and the first step of a
compiled model. It knows nothing of Ray; loop.py runs it."""

from __future__ import annotations

import math
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from orchestrator.errors import UserError
from orchestrator.tasks import step_loss_sum
from orchestrator.training import fsdp, ranks
from orchestrator.training.checkpoint import unwrap
from orchestrator.training.memory import is_oom, release_cached_memory
from orchestrator.training.parts import Parts
from orchestrator.training.sync import grad_bytes
from orchestrator.training.timing import PhaseTimer, count_flops
from pipelines.tensors import Batch, cat_rows, chunk, rows


class DeviceMemoryError(UserError):
    """Even the smallest micro-batch does not fit in device memory."""


def train_step(parts: Parts, micro_batches: list[Batch], timer: PhaseTimer | None = None) -> StepResult:
    """Forward/backward every micro-batch, then one optimizer step.

    After an out-of-memory error on any rank before DDP's gradient all-reduce, every rank redoes the step with
    each micro-batch cut in two (twice the accumulation): the same samples and the same normaliser, so the same
    update. Under FSDP (train.parallel=fsdp) an out-of-memory error is fatal: see `_unretriable`.
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
        # The step's first collective: a rank whose data came first waits here for the others (sync, not "other").
        with timer.phase("sync"):
            dist.all_reduce(targets)
        parts.comm_bytes += targets.element_size()
    scale = world / targets.clamp(min=1)
    while True:
        pieces = cut(parts, micro_batches)
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
        # Under FSDP each rank holds a shard of every gradient: the norm is reduced over the ranks' shards.
        grad_norm = (fsdp.clip_grad_norm(parts.model, max_norm) if fsdp.is_sharded(parts.model)
                     else torch.nn.utils.clip_grad_norm_(parts.model.parameters(), max_norm))
        if _non_finite_anywhere(step_loss, grad_norm, parts):
            # No update from this step; its samples are consumed and the LR schedule (indexed by samples) moves
            # on, as after a step the fp16 scaler skips.
            parts.optimizer.zero_grad(set_to_none=True)
            parts.precision.skip()
            with warnings.catch_warnings():  # torch warns when the schedule moves before any optimizer step
                warnings.simplefilter("ignore", UserWarning)
                parts.scheduler.step()
            return StepResult(step_loss, grad_norm.detach(), samples, local_targets, skipped=True)
        applied = parts.precision.step(parts.optimizer)
        parts.optimizer.zero_grad(set_to_none=True)
        parts.scheduler.step()
    return StepResult(step_loss, grad_norm.detach(), samples, local_targets, overflowed=not applied)


def cut(parts: Parts, micro_batches: list[Batch]) -> list[Batch]:
    """The pieces a step runs forward: the data's micro-batches joined `parts.join` at a time (the autopilot's larger
    micro-batch; the step's normaliser is the whole step's, so only the summation order changes), each cut in
    `parts.split` (a smaller one, or after an out-of-memory error)."""
    if parts.join > 1:
        micro_batches = [cat_rows(micro_batches[i:i + parts.join]) for i in range(0, len(micro_batches), parts.join)]
    return [piece for batch in micro_batches for piece in chunk(batch, parts.split)]


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
    # fp16: the GradScaler skipped the update (the unscaled gradient overflowed; its norm is inf/nan). The loss is
    # real, the norm is not a figure of the model.
    overflowed: bool = False


def _forward_backward(parts: Parts, pieces: list[Batch], scale: torch.Tensor,
                      timer: PhaseTimer) -> torch.Tensor | None:
    """Forward and backward of every piece, accumulating gradients; returns the summed loss, or None when some rank
    ran out of memory before DDP's gradient all-reduce (every rank then redoes the step with smaller pieces).
    DeviceMemoryError when pieces of one row still do not fit."""
    model = parts.model
    model.train()
    sharded = fsdp.is_sharded(model)
    # DDP all-reduces gradients in the backward of the last piece only: every piece but the last runs under
    # no_sync. Under local SGD no piece is all-reduced: ranks step alone and average parameters later. FSDP's
    # counterpart of no_sync (train.fsdp.defer_sync) is fsdp.gradient_sync.
    ddp = (hasattr(model, "no_sync") and parts.local_sgd is None) or sharded
    # With several ranks, an OOM retry is decided together before the synced piece: a rank redoing the step alone
    # would meet the others' gradient all-reduce with collectives of its own (gloo aborts, NCCL hangs).
    together = ddp and not sharded and ranks.world()[1] > 1 and len(pieces) > 1
    total = torch.zeros((), device=parts.device)
    seconds: list[float] = []
    forward_s = 0.0

    ran_out = False  # on this rank
    try:
        for batch in pieces[:-1] if ddp else pieces:
            forward_s = _piece(parts, batch, scale, False, sharded, total, seconds)
    except Exception as exc:
        if not is_oom(exc):
            raise
        if sharded:
            raise _unretriable(pieces) from exc
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
        try:
            forward_s = _piece(parts, pieces[-1], scale, True, sharded, total, seconds)
        except Exception as exc:
            if sharded and is_oom(exc):
                raise _unretriable(pieces) from exc
            raise
    _bill_compute_and_sync(timer, seconds, forward_s, ddp)
    return total


def _piece(parts: Parts, batch: Batch, scale: torch.Tensor, synced: bool, sharded: bool, total: torch.Tensor,
           seconds: list[float]) -> float:
    """Forward and backward of one piece (`synced`: the one whose backward reduces the gradients across ranks).
    Adds its loss into `total` (in place, on the device) and its seconds to `seconds`; returns its forward's
    seconds."""
    model = parts.model
    started = time.perf_counter()
    # The forward must be inside no_sync too, because DDP arms its reducer during forward.
    with fsdp.gradient_sync(model, synced, parts.defer_sync) if sharded else \
            nullcontext() if synced or not hasattr(model, "no_sync") else model.no_sync():
        with parts.precision.autocast():
            output = parts.call(model, batch)
        loss = step_loss_sum(parts.task, output, batch, parts.model_loss)
        forward_s = _elapsed(started, parts.device)
        parts.precision.backward(loss * scale)
    # FSDP without defer_sync reduce-scatters every piece's gradients (a world share of them, for all ranks).
    if (synced or (sharded and not parts.defer_sync)) and ranks.world()[1] > 1:
        parts.comm_bytes += grad_bytes(model)
    total += loss.detach()
    seconds.append(_elapsed(started, parts.device))
    return forward_s


def _bill_compute_and_sync(timer: PhaseTimer, seconds: list[float], forward_s: float, ddp: bool) -> None:
    """Split the pieces' seconds into compute and sync. The all-reduce overlaps the last backward; what it adds
    beyond compute is the exposed sync time."""
    if not (ddp and ranks.world()[1] > 1):
        sync_s = 0.0
    elif len(seconds) > 1:
        sync_s = max(0.0, seconds[-1] - sum(seconds[:-1]) / (len(seconds) - 1))
    else:  # no unsynced piece to compare with: backward costs about twice the forward's FLOPs
        sync_s = max(0.0, seconds[-1] - 3 * forward_s)
    timer.add("compute", sum(seconds) - sync_s)
    timer.add("sync", sync_s)


def _unretriable(pieces: list[Batch]) -> DeviceMemoryError:
    """Out of memory under FSDP. Every FSDP forward and backward holds all-gathers: the other ranks are already
    waiting in the next one, so this rank can neither retry alone nor tell them (they fail when this worker ends)."""
    return DeviceMemoryError(
        "out of memory under train.parallel=fsdp, where a step cannot be retried on one rank: lower "
        f"train.micro_batch_size (now {max(rows(b) for b in pieces)} rows per forward; the global batch stays, "
        "accumulation grows), set train.precision=bf16, or add workers")


def _elapsed(started: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def flops_per_sample(parts: Parts, batch: Batch) -> float:
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


def first_compiled_step(parts: Parts, batch: list[Batch]) -> tuple[StepResult, float]:
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
