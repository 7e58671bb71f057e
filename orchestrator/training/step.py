"""One optimizer step, readable top to bottom: forward and backward of every micro-batch (gradient
accumulation with one all-reduce), a rank's out-of-memory retry, the non-finite skip decided on the
device, and the first step of a compiled model. It queues work and never waits for the device. It
knows nothing of Ray; loop.py runs it."""

from __future__ import annotations

import math
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from orchestrator.errors import UserError
from orchestrator.models.tasks import step_loss_sum
from orchestrator.training import fsdp, ranks
from orchestrator.training.checkpoint import unwrap
from orchestrator.training.memory import is_oom, release_cached_memory
from orchestrator.training.parts import Parts
from orchestrator.training.sync import grad_bytes
from orchestrator.training.timing import PhaseTimer, count_flops
from pipelines.tensors import Batch, cat_rows, chunk, rows


class DeviceMemoryError(UserError):
    """Even the smallest micro-batch does not fit in device memory."""


def train_step(parts: Parts, micro_batches: list[Batch],
               timer: PhaseTimer | None = None) -> StepResult:
    """Forward/backward every micro-batch, then one optimizer step, all queued without waiting for
    the device: no value is read back and nothing synchronises it (what a report needs stays on the
    device, see StepResult).

    After an out-of-memory error before DDP's gradient all-reduce, the rank redoes its part of the
    step with each micro-batch cut in two (twice the accumulation): the same samples and the same
    normaliser, so the same update. Under FSDP (train.parallel=fsdp) an out-of-memory error is
    fatal: see `_unretriable`.
    """
    timer = timer or PhaseTimer(parts.device)
    norm = Normaliser(parts, micro_batches, timer)
    while True:
        pieces = cut(parts, micro_batches)
        step_loss = _forward_backward(parts, pieces, norm, timer)
        if step_loss is not None:
            break
        parts.optimizer.zero_grad(set_to_none=True)
        release_cached_memory(parts.device)
        parts.state.split *= 2
        parts.state.oom_retries += 1
    samples = sum(rows(batch) for batch in micro_batches)
    with timer.phase("compute"):
        parts.precision.unscale_(parts.optimizer)
        max_norm = parts.max_grad_norm if parts.max_grad_norm is not None else math.inf
        # Under FSDP each rank holds a shard of every gradient: the norm is reduced over the ranks'
        # shards.
        grad_norm = (fsdp.clip_grad_norm(parts.model, max_norm) if fsdp.is_sharded(parts.model)
                     else torch.nn.utils.clip_grad_norm_(parts.model.parameters(), max_norm))
        # A non-finite step makes no update (decided on the device); its samples are consumed and
        # the LR schedule (indexed by samples) moves on, as after a step the fp16 scaler skips.
        skipped = _non_finite_anywhere(step_loss, grad_norm, parts)
        overflowed = parts.precision.step(parts.optimizer, skipped)
        parts.optimizer.zero_grad(set_to_none=True)
        if getattr(parts.optimizer, "defaults", {}).get("fused"):
            parts.scheduler.step()
        else:
            # torch warns when the schedule moves before any optimizer step
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                parts.scheduler.step()
    return StepResult(step_loss, grad_norm.detach(), samples, norm.local, skipped, overflowed)


class Normaliser:
    """The step's loss normaliser: its targets (samples, or tokens) on all ranks, not per
    micro-batch. Then k micro-batches of size b give the gradient of one batch of k*b, and DDP's
    mean over ranks (hence the world factor) gives the mean over the global batch even when ranks
    hold different token counts.

    Rows are the same on every rank (equal shards), so a task whose count follows from the rows
    (classification, regression: `counts_tokens` false) needs no collective: the global count is the
    local one times the world. Token counts differ per rank: their all-reduce is started here and
    waited for only at the first backward, so it overlaps the first forward. A user's task that does
    not subclass Task is treated as varying."""

    def __init__(self, parts: Parts, micro_batches: list[Batch], timer: PhaseTimer) -> None:
        self.timer = timer
        # the timer's marks around the wait for the all-reduce
        self.waited: tuple[Any, Any] | None = None
        self.local = sum(parts.task.count(batch) for batch in micro_batches).to(torch.float32)
        # Local SGD: each rank's step is its own (no gradient mean), so the normaliser is its own
        # targets too. failure.mode=replicas: the gradient mean is over the step's quorum of
        # replicas (each a group of one).
        quorum = parts.state.replicas
        self.world = (quorum.participants if quorum is not None
                      else ranks.world()[1] if parts.local_sgd is None else 1)
        self.work: Any = None
        self._scale: torch.Tensor | None = None
        if self.world > 1 and getattr(parts.task, "counts_tokens", True):
            self.total = self.local.clone()
            self.work = (quorum.count_sum(self.total) if quorum is not None
                         else dist.all_reduce(self.total, async_op=True))
            parts.state.comm_bytes += self.total.element_size()
        else:
            self.total = self.local * self.world

    @property
    def scale(self) -> torch.Tensor:
        """world / global targets: multiplies each piece's loss sum before its backward."""
        if self._scale is None:
            # waits on the host under gloo; under NCCL only the device's stream waits
            if self.work is not None:
                started = self.timer.mark()
                self.work.wait()
                self.waited = (started, self.timer.mark())
            self._scale = self.world / self.total.clamp(min=1)
        return self._scale


def cut(parts: Parts, micro_batches: list[Batch]) -> list[Batch]:
    """The pieces a step runs forward: the data's micro-batches joined `state.join` at a time (the
    autopilot's larger micro-batch; the step's normaliser is the whole step's, so only the summation
    order changes), each cut in `state.split` (a smaller one, or after an out-of-memory error), and
    in as many more as it is wider than the batch train.micro_batch_size=auto measured (`wider`)."""
    state = parts.state
    if state.join > 1:
        micro_batches = [cat_rows(micro_batches[i:i + state.join])
                         for i in range(0, len(micro_batches), state.join)]
    if state.split == 1 and state.probed is None:
        return micro_batches
    return [piece for batch in micro_batches
            for piece in chunk(batch, state.split * wider(state.probed, batch))]


def wider(probed: dict[str, int] | None, batch: Batch) -> int:
    """How many times more values a row of `batch` holds than a row of the batch the auto
    micro-batch was measured on (`probed`: values per row, by key), rounded up; 1 without a probe.
    Padded token columns are as wide as the micro-batch's longest row, and the probe ran the
    driver's sample rows: a batch padded longer would run out of memory where the probe's fitted,
    and under DDP an out-of-memory error in the step's synced piece (a one-piece run's only one)
    cannot be retried. Cut in this many, each piece holds no more values than the probe ran
    (activations grow linearly with the length under fused attention). From the shapes: nothing
    waits for the device."""
    if probed is None:
        return 1
    ratios = [-(-(value.numel() // len(value)) // probed[key]) for key, value in batch.items()
              if probed.get(key) and len(value)]
    return max([1, *ratios])


def _non_finite_anywhere(step_loss: torch.Tensor, grad_norm: torch.Tensor,
                         parts: Parts) -> torch.Tensor:
    """1.0 on every rank if any rank's loss (or the gradient) is NaN/inf, else 0.0, on the device
    (never read here). Losses differ per rank, and skipping on one rank only would leave the ranks'
    weights apart: so the flag is all-reduced. With fp16 the GradScaler already skips overflowing
    gradients, so only the loss is judged."""
    bad = ~torch.isfinite(step_loss)
    if parts.precision.scaler is None:
        bad = bad | ~torch.isfinite(grad_norm)
    return ranks.on_any_rank(bad)


@dataclass
class StepResult:
    """What a step leaves for the report, on the device (read once per report, never per step)."""

    loss_sum: torch.Tensor  # summed over this rank's targets
    grad_norm: torch.Tensor
    samples: int
    targets: torch.Tensor  # this rank's targets (samples, or tokens) in the step, on the device
    # 1.0: a non-finite loss or gradient on some rank, no update was applied (the same on every
    # rank)
    skipped: torch.Tensor
    # 1.0: fp16's GradScaler skipped the update (the unscaled gradient overflowed; its norm is
    # inf/nan). The loss is real, the norm is not a figure of the model.
    overflowed: torch.Tensor


def _forward_backward(parts: Parts, pieces: list[Batch], norm: Normaliser,
                      timer: PhaseTimer) -> torch.Tensor | None:
    """Forward and backward of every piece, accumulating gradients; returns the summed loss, or None
    when this rank ran out of memory before DDP's gradient all-reduce (it then redoes its step with
    smaller pieces). DeviceMemoryError when pieces of one row still do not fit.

    The retry is this rank's alone: the pieces before the synced one run under no_sync, which holds
    no collective, so the other ranks need not know (and a verdict agreed every step would read a
    flag back every step). They simply wait for this rank in the synced piece's all-reduce."""
    model = parts.model
    model.train()
    sharded = fsdp.is_sharded(model)
    # DDP all-reduces gradients in the backward of the last piece only: every piece but the last
    # runs under no_sync. Under local SGD no piece is all-reduced: ranks step alone and average
    # parameters later. FSDP's counterpart of no_sync (train.fsdp.defer_sync) is fsdp.gradient_sync.
    ddp = (hasattr(model, "no_sync") and parts.local_sgd is None) or sharded
    total = torch.zeros((), device=parts.device)
    marks: list[tuple[Any, Any, Any]] = []  # each piece's start, end of forward, end of backward
    try:
        for batch in pieces[:-1] if ddp else pieces:
            _piece(parts, batch, norm, False, sharded, total, marks, timer)
    except Exception as exc:
        if not is_oom(exc):
            raise
        if sharded:
            raise _unretriable(pieces) from exc
        # a retry would redo the identical step forever
        if max(rows(batch) for batch in pieces) <= 1:
            raise DeviceMemoryError(
                "out of memory even with a micro-batch of 1 row: use a smaller model or shorter "
                "sequences, train.precision=bf16, or a device with more memory") from exc
        # DDP broadcast its buffers in this step's first forward, and a forward that raised never
        # told it so: the redone forward must not broadcast again, which the other ranks would not
        # match.
        if hasattr(model, "require_forward_param_sync"):
            model.require_forward_param_sync = False
        warnings.warn("out of memory: retrying the step with "
                      f"micro-batches cut in {parts.state.split * 2} (same "
                      "global batch, more accumulation)", stacklevel=3)
        return None
    # an OOM in here is not retried: it may strike inside the all-reduce, which one rank cannot undo
    if ddp:
        try:
            _piece(parts, pieces[-1], norm, True, sharded, total, marks, timer)
        except Exception as exc:
            if sharded and is_oom(exc):
                raise _unretriable(pieces) from exc
            raise
    synced, waited = ddp and ranks.world()[1] > 1, norm.waited
    timer.later(lambda between: _bill_compute_and_sync(timer, [between(s, e) for s, _, e in marks],
                                                       between(*marks[-1][:2]), synced,
                                                       between(*waited) if waited else 0.0))
    return total


def _piece(parts: Parts, batch: Batch, norm: Normaliser, synced: bool, sharded: bool,
           total: torch.Tensor, marks: list[tuple[Any, Any, Any]], timer: PhaseTimer) -> None:
    """Forward and backward of one piece (`synced`: the one whose backward reduces the gradients
    across ranks). Adds its loss into `total` (in place, on the device) and its start, end of
    forward and end of backward (the timer's marks, never waited for) to `marks`."""
    model = parts.model
    started = timer.mark()
    # The forward must be inside no_sync too, because DDP arms its reducer during forward.
    with fsdp.gradient_sync(model, synced, parts.defer_sync) if sharded else \
            nullcontext() if synced or not hasattr(model, "no_sync") else model.no_sync():
        with parts.precision.autocast():
            output = parts.call(model, batch)
        loss = step_loss_sum(parts.task, output, batch, parts.model_loss)
        forwarded = timer.mark()
        parts.precision.backward(loss * norm.scale)
    # FSDP without defer_sync reduce-scatters every piece's gradients (a world share of them, for
    # all ranks).
    if (synced or (sharded and not parts.defer_sync)) and ranks.world()[1] > 1:
        parts.state.comm_bytes += grad_bytes(model)
    total += loss.detach()
    marks.append((started, forwarded, timer.mark()))


def _bill_compute_and_sync(timer: PhaseTimer, seconds: list[float], forward_s: float, synced: bool,
                           waited_s: float) -> None:
    """Split the pieces' seconds into compute and sync. The all-reduce overlaps the last backward;
    what it adds beyond compute is the exposed sync time. `waited_s`: the wait for the token count's
    all-reduce inside the first piece (a rank whose data came first waits there for the others):
    sync."""
    seconds = [seconds[0] - waited_s, *seconds[1:]]
    if not synced:
        sync_s = 0.0
    elif len(seconds) > 1:
        sync_s = max(0.0, seconds[-1] - sum(seconds[:-1]) / (len(seconds) - 1))
    else:  # no unsynced piece to compare with: backward costs about twice the forward's FLOPs
        sync_s = max(0.0, seconds[-1] - 3 * forward_s)
    timer.add("compute", sum(seconds) - sync_s)
    timer.add("sync", sync_s + waited_s)


def _unretriable(pieces: list[Batch]) -> DeviceMemoryError:
    """Out of memory under FSDP. Every FSDP forward and backward holds all-gathers: the other ranks
    are already waiting in the next one, so this rank can neither retry alone nor tell them (they
    fail when this worker ends)."""
    return DeviceMemoryError(
        "out of memory under train.parallel=fsdp, where a step cannot be retried on one rank: "
        f"lower train.micro_batch_size (now {max(rows(b) for b in pieces)} rows per forward; "
        "the global batch stays, accumulation grows), set train.precision=bf16, or add workers")


def _elapsed(started: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def flops_per_sample(parts: Parts, batch: Batch) -> float:
    """Forward + backward FLOPs per sample, counted once on the bare module (no DDP hooks, no
    compilation)."""
    model = unwrap(parts.model)

    def step() -> None:
        with parts.precision.autocast():
            output = parts.call(model, batch)
        step_loss_sum(parts.task, output, batch, parts.model_loss).backward()

    # Dropout draws random numbers: fork the RNG so counting leaves the training stream (and exact
    # resume) intact.
    with torch.random.fork_rng(devices=[parts.device] if parts.device.type == "cuda" else []):
        flops = count_flops(step)
    model.zero_grad(set_to_none=True)
    return flops / max(rows(batch), 1)


def first_compiled_step(parts: Parts, batch: list[Batch]) -> tuple[StepResult, float]:
    """The first step of a compiled model compiles it: timed apart. Compiling can fail on some ranks
    only (a backend missing on one node): every rank first compiles on one piece without a
    collective, then all agree, and all run eagerly if any failed. A rank that redid the step alone
    would meet the others' collectives with its own."""
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
    """Forward and backward of the compiled model on the first piece, which compiles both: the
    error's first line if that fails, else None. Runs under DDP's no_sync (no gradient all-reduce; a
    buffer broadcast in forward is called by every rank alike) with the RNG forked; the gradients
    are dropped and the buffers (BatchNorm's running statistics) put back, so the step itself runs
    as without the probe. Out of memory: the probe is retried on smaller pieces, down to one row
    (the step's own retry then handles memory)."""
    model = parts.model
    buffers = {name: value.clone() for name, value in unwrap(model).named_buffers()}
    model.train()
    pieces = chunk(batch, parts.state.split)
    rng_devices = [parts.device] if parts.device.type == "cuda" else []
    try:
        while True:
            try:
                with torch.random.fork_rng(devices=rng_devices), \
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
                # Two lines: dynamo's first ("backend='inductor' raised:") and the backend's own
                # error after it.
                lines = [line for line in str(exc).splitlines() if line.strip()]
                return f"{type(exc).__name__}: {' '.join(lines[:2])[:240]}"
    finally:
        parts.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, value in unwrap(model).named_buffers():
                value.copy_(buffers[name])
