"""The training loop, readable top to bottom: `run` (steps, eval, reports, checkpoints) around
step.py's `train_step`. It knows nothing of Ray: the caller passes batch sources and a `Reporter`,
so tests run it in-process."""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from orchestrator.config import Config
from orchestrator.errors import UserError
from orchestrator.training import autopilot, fsdp, ranks
from orchestrator.training.cadence import Cadence, Due, Notices
from orchestrator.training.checkpoint import Progress, checkpoint_state, save_state, unwrap
from orchestrator.training.evaluation import evaluate
from orchestrator.training.fsdp import is_sharded
from orchestrator.training.interval import Interval
from orchestrator.training.memory import cuda_memory_stats, device_facts
from orchestrator.training.parts import Parts, rank_bytes
from orchestrator.training.position import micro_batches
from orchestrator.training.step import StepResult, first_compiled_step, flops_per_sample, train_step
from orchestrator.training.sync import average_tensors
from orchestrator.training.system import node_stats
from orchestrator.training.timing import PhaseTimer, peak_flops
from pipelines.tensors import Batch, rows

# torchft is an optional extra (`replicas`): only failure.mode=replicas imports it
if TYPE_CHECKING:
    from orchestrator.training.replicas import Replicas


class Reporter(Protocol):
    """Where reports go. Both are called on every rank at the same steps."""

    def publish(self, metrics: dict[str, Any]) -> None:
        """Every report step: the interval's metrics to whoever watches the run, without waiting for
        anyone (no barrier: a report step must cost no more than the steps between two)."""

    def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        """Checkpoint steps only: register the checkpoint (a barrier); `checkpoint_dir` is set on
        rank 0 only. Under train.parallel=fsdp every rank passes what its `save_sharded` returned
        instead."""

    def save_sharded(self, parts: Parts, progress: Progress,
                     micro_batch_size: int | str | None) -> Any:
        """train.parallel=fsdp only, checkpoint steps, every rank: start writing this rank's shards
        into the next checkpoint directory (training/checkpoint.py `ShardedSaver`); returns what
        `checkpoint` then registers."""


class NonFiniteLossError(UserError):
    """The loss became NaN/inf; continuing would only write a broken model."""


@dataclass(frozen=True)
class Data:
    """Where the loop's rows come from: `train(epoch)`, that epoch's training micro-batches;
    `val()`, the validation batches (None: no evaluation); `resize(micro)`, the training data cut at
    another micro-batch from the next one on (RankBatches.resize; None where the data cannot be
    re-cut)."""

    train: Callable[[int], Iterable[Batch]]
    val: Callable[[], Iterable[Batch]] | None = None
    resize: Callable[[int], None] | None = None


@dataclass(frozen=True)
class _Run:
    """What one run's reports read besides their interval: the config, the built parts, the data,
    where reports go, where the run stands (`progress`, which the steps move on) and, under
    failure.mode=replicas, this worker's replica."""

    cfg: Config
    parts: Parts
    data: Data
    reporter: Reporter
    progress: Progress
    replicas: Replicas | None


def _check_finite_weights(parts: Parts, step: int) -> None:
    """A non-finite model is never checkpointed (it would poison every resume). Each rank checks
    what it holds (its shards under FSDP, where one rank's shard may overflow alone) and the verdict
    is agreed: a rank that stopped alone would leave the others waiting in the checkpoint's
    collectives."""
    held = [torch.isfinite(fsdp.local_tensor(p)).all() for p in unwrap(parts.model).parameters()]
    finite = bool(torch.stack(held).all()) if held else True  # one host sync, not one per parameter
    if ranks.any_rank(not finite, parts.device):
        raise NonFiniteLossError(f"the model weights are not finite at step {step}: not "
                                 "checkpointing them; lower optim.lr or set "
                                 "optim.max_grad_norm, and resume from the last checkpoint")


def run(
    cfg: Config,
    parts: Parts,
    data: Data,
    reporter: Reporter,
    progress: Progress | None = None,
    notices: Notices | None = None,
    facts: dict[str, Any] | None = None,
    replicas: Replicas | None = None,
) -> dict[str, Any]:
    """Train to `cfg.train.max_steps` on `data`, publishing metrics every `log_every` steps; returns
    the last metrics. `notices` (a drained node, the user's stop) make the next reports save; a stop
    ends the loop there. `facts` go out once, with the first report of this (re)start, together with
    when (`at/*`, epoch seconds) the loop started, had its first batch, ended its first step:
    start-up's breakdown. `replicas`: see training/replicas.py."""
    t = cfg.train
    # resolved before the loop
    assert t.max_steps is not None and isinstance(t.grad_accum_steps, int)
    progress = progress or Progress()
    this = _Run(cfg, parts, data, reporter, progress, replicas)
    stream = micro_batches(data.train, progress, parts.device)
    cadence = Cadence(cfg, data.val is not None, notices, parts.device, progress)
    metrics: dict[str, Any] = {}
    once = dict(facts or {}) | device_facts(parts.device) | {"at/loop": time.time()}
    flops: float | None = None  # counted on this process's first step
    pilot = _start_autopilot(cfg, parts, progress, once)
    if parts.local_sgd is not None and not parts.local_sgd.anchor:
        parts.local_sgd.start(unwrap(parts.model))
    # Waiting for the first batch is start-up (the pipeline's first read), not part of the first
    # interval.
    pieces = t.grad_accum_steps  # the data's micro-batches a step takes
    first = ([next(stream) for _ in range(pieces)]
             if progress.step < t.max_steps and replicas is None else None)
    once["at/first_batch"] = time.time()
    interval = Interval(PhaseTimer(parts.device))
    while progress.step < t.max_steps and not cadence.stopped:
        batch, first = _take(stream, pieces, first, interval.timer, replicas, t.max_steps), None
        # None: a restarted replica took its finished peers' state: only the last report is left
        if batch is not None:
            if flops is None:  # this process's first step, also after a resume
                flops, result, interval = _first_step(parts, batch, interval, once)
            elif pilot is not None:
                result, pilot, pieces = _search_step(pilot, parts, batch, interval.timer, once,
                                                     data.resize, pieces)
            else:
                result = train_step(parts, batch, interval.timer)
            if not _count_step(this, interval, result, batch):
                # the quorum dropped the step (a peer failed in it): the same step again, the same
                # rows
                continue
        due = cadence.at(progress.step)
        _sync_local_sgd(parts, progress.step, t.max_steps, interval.timer)
        if due is None:
            continue
        metrics, interval = _report(this, due, interval,
                                    once | cadence.figures() | {"flops_per_sample": flops})
        once = {}
    return metrics


def _count_step(this: _Run, interval: Interval, result: StepResult, batch: list[Batch]) -> bool:
    """Moves run `this` on by the step just taken: its progress and its interval's figures. False
    where the step's quorum dropped it (failure.mode=replicas: a peer failed in it); the step is
    then taken again."""
    progress, global_batch = this.progress, this.cfg.train.global_batch_size
    if this.replicas is not None and not this.replicas.step_done(result, global_batch):
        return False
    progress.step += 1
    progress.samples_seen += global_batch
    state = this.parts.state
    interval.add(result, micro=-(-rows(batch[0]) * state.join // state.split))
    return True


def _sync_local_sgd(parts: Parts, step: int, max_steps: int, timer: PhaseTimer) -> None:
    """Local SGD's averaging of the ranks' models: at the configured period (and the run's end,
    which leaves one model), never where a clock decides."""
    sgd = parts.local_sgd
    if sgd is not None and (sgd.due(step) or step == max_steps):
        with timer.phase("sync"):
            parts.state.comm_bytes += sgd.average(unwrap(parts.model))


def _group_peak(parts: Parts, configured_tflops: float | None,
                replicas: Replicas | None) -> float | None:
    """Peak FLOP/s of every device whose rows a report's samples count: the group's ranks, or under
    replicas the last quorum's live replicas (a replica's own group is of one, yet it counts the
    global batch all of them trained)."""
    peak = peak_flops(parts.device, configured_tflops, parts.precision.mode)
    return (peak * (replicas.participants if replicas is not None else ranks.world()[1]) if peak
            else None)


def _take(stream: Iterator[Batch], pieces: int, first: list[Batch] | None, timer: PhaseTimer,
          replicas: Replicas | None, max_steps: int) -> list[Batch] | None:
    """A step's `pieces` micro-batches: the first step's, fetched before the loop, else the next
    ones of the stream. Under failure.mode=replicas the step's quorum fixes the step's number and
    this replica's micro-batches of it (None: a restarted replica took its finished peers' state,
    and only their last report is left to make)."""
    if replicas is not None:
        return replicas.begin_step(timer, max_steps)
    batch = first or []
    if len(batch) < pieces:
        with timer.phase("data_wait"):
            batch += [next(stream) for _ in range(pieces - len(batch))]
    return batch


def _first_step(parts: Parts, batch: list[Batch], interval: Interval, once: dict[str, Any]
                ) -> tuple[float, StepResult, Interval]:
    """The first step of this process, also after a resume: its FLOPs per sample are counted, a
    compiled model compiles (timed apart), and this rank's parameter and optimizer bytes (with the
    parallel mode) are measured once the optimizer state exists. Adds its figures to `once`; returns
    the FLOPs, the step and the interval."""
    flops = flops_per_sample(parts, batch[0])
    if parts.eager_model is not None:  # a compiled model: this step compiles it
        result, once["compile_s"] = first_compiled_step(parts, batch)
        # compiling isn't training
        interval = Interval(PhaseTimer(parts.device), comm_start=parts.state.comm_bytes)
    else:
        result = train_step(parts, batch, interval.timer)
    once["at/first_step"] = time.time()  # where a restart's recovery ends (bench/chaos.py)
    once |= rank_bytes(parts)
    return flops, result, interval


def _start_autopilot(cfg: Config, parts: Parts, progress: Progress, once: dict[str, Any]
                     ) -> autopilot.Autopilot | None:
    """The autopilot's search: None when off, or when the choice is kept from the checkpoint or the
    search skipped (said in the first report, through `once`)."""
    if not cfg.autopilot.enabled:
        return None
    pilot, kept = autopilot.begin(cfg, parts, progress)
    if kept is not None:
        once["autopilot"] = kept
    return pilot


def _search_step(pilot: autopilot.Autopilot, parts: Parts, batch: list[Batch], timer: PhaseTimer,
                 once: dict[str, Any], resize: Callable[[int], None] | None, pieces: int
                 ) -> tuple[StepResult, autopilot.Autopilot | None, int]:
    """A real step of the run under the autopilot's candidate, and the data's micro-batches the next
    step takes. Once the search is done, its table goes with the next report (rank 0), the search is
    dropped, and `resize` cuts the data at the chosen micro-batch: the steps then take whole
    micro-batches rather than joining or cutting the configured ones."""
    result = pilot.step(parts, batch, timer)
    if not pilot.done:
        return result, pilot, pieces
    if pilot.report is not None:
        once["autopilot"] = pilot.report
    return result, None, pilot.recut(parts, resize) or pieces


def _too_many_non_finite(progress: Progress, limit: int) -> NonFiniteLossError:
    return NonFiniteLossError(
        f"{progress.nonfinite_skipped} steps had a non-finite loss or gradient "
        f"by step {progress.step}, more than train.max_nonfinite_steps={limit}: "
        "lower optim.lr, raise optim.warmup_steps, set optim.max_grad_norm, "
        "use train.precision=bf16/fp32, or check the data for NaN/inf values"
    )


@contextmanager
def _one_model(parts: Parts, step: int, last: bool, timer: PhaseTimer) -> Iterator[None]:
    """Within: the ranks' one model. Under local SGD between two syncs each rank holds its own
    replica: evaluation and a checkpoint see (and save) their average, and each rank gets its
    replica back afterwards, so the weights follow the configured sync period only, whatever steps
    checkpoint.every=auto's clock or a drain picks."""
    sgd = parts.local_sgd
    # just averaged, or nothing to average
    if sgd is None or sgd.due(step) or last or ranks.world()[1] == 1:
        yield
        return
    model = unwrap(parts.model)
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    own = [t.detach().clone() for t in tensors]
    with timer.phase("sync"):
        parts.state.comm_bytes += average_tensors(tensors)
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, mine in zip(tensors, own, strict=True):
                tensor.copy_(mine)


def _report(this: _Run, due: Due, interval: Interval,
            once: dict[str, Any]) -> tuple[dict[str, Any], Interval]:
    """A report step of run `this`: the interval's figures summed over ranks, evaluation and a
    checkpoint when due, then the report. Returns its metrics and the next interval, which starts
    before the report so that time blocked in registering the checkpoint is billed to it as
    "report". `once`: figures sent with this report only."""
    parts, progress, reporter, t = this.parts, this.progress, this.reporter, this.cfg.train
    world, peak = ranks.world()[1], _group_peak(parts, t.peak_tflops, this.replicas)
    max_nonfinite = t.max_nonfinite_steps
    # Raises on a non-finite loss before anything is evaluated or saved: a broken model is never
    # persisted.
    metrics, samples, targets = _interval_metrics(interval, progress, parts, world, max_nonfinite)
    if due.drain:
        metrics["drain_checkpoint"] = 1
    evaluated, checkpoint_dir = _evaluate_and_save(this, due, interval.timer)
    metrics |= evaluated
    metrics |= interval.timer.shares() | cuda_memory_stats(parts.device) | node_stats(world)
    metrics |= _worker_paces(interval, parts.device)
    # Throughput is the wall clock's: the interval from the end of the previous report to now, with
    # its data waits, evaluation, checkpoint and the time the previous report blocked (consecutive
    # intervals tile the run, and the driver's cost ledger splits each by the time/* shares).
    seconds = max(time.perf_counter() - interval.timer.started, 1e-9)
    metrics["interval_s"] = seconds
    metrics["samples_per_s"] = samples / seconds
    # Training's own pace (the headline's, the progress line's): evaluation, checkpoint and a
    # blocked report aside.
    aside = sum(interval.timer.seconds[phase] for phase in ("eval", "checkpoint", "report"))
    metrics["train_samples_per_s"] = samples / max(seconds - aside, 1e-9)
    metrics |= {"eval_s": interval.timer.seconds["eval"]} if due.eval else {}
    metrics["data_wait_frac"] = metrics["time/data_wait_frac"]
    if getattr(parts.task, "counts_tokens", False):  # a user's task need not subclass Task
        metrics["tokens_per_s"] = targets / seconds
    flops = once.get("flops_per_sample")
    # model FLOPs utilisation of the devices (`peak`: all of theirs) over the wall clock
    if peak and flops:
        metrics["mfu"] = flops * metrics["samples_per_s"] / peak
    metrics |= once
    following = Interval(PhaseTimer(parts.device), comm_start=parts.state.comm_bytes)
    with following.timer.phase("report"):
        try:
            if due.checkpoint:
                registered = time.perf_counter()
                reporter.checkpoint(metrics, checkpoint_dir)
                # What the checkpoint blocked training for (checkpoint.every=auto's cost): writing,
                # then registering.
                registering = time.perf_counter() - registered
                progress.checkpoint_cost_s = interval.timer.seconds["checkpoint"] + registering
        finally:
            if isinstance(checkpoint_dir, str):
                shutil.rmtree(checkpoint_dir, ignore_errors=True)
        reporter.publish(metrics)
    return metrics, following


def _evaluate_and_save(this: _Run, due: Due, timer: PhaseTimer) -> tuple[dict[str, Any], Any]:
    """A report step's evaluation and checkpoint, each when due, on the ranks' one model: the
    validation metrics, and what `Reporter.checkpoint` registers (a directory on rank 0, what
    `save_sharded` returned under train.parallel=fsdp; None without a checkpoint)."""
    parts, progress, micro_batch_size = this.parts, this.progress, this.cfg.train.micro_batch_size
    metrics: dict[str, Any] = {}
    checkpoint_dir: Any = None
    with (_one_model(parts, progress.step, due.last, timer) if due.eval or due.checkpoint
          else nullcontext()):
        if due.eval:
            with timer.phase("eval"):
                metrics |= evaluate(parts, this.data.val())  # type: ignore[misc]
        with timer.phase("checkpoint"):
            if due.checkpoint:
                _check_finite_weights(parts, progress.step)
                # no rank holds the whole model: each writes its shards into storage
                if is_sharded(parts.model):
                    checkpoint_dir = this.reporter.save_sharded(parts, progress, micro_batch_size)
                # a collective
                elif (state := checkpoint_state(parts, progress, micro_batch_size)) is not None:
                    checkpoint_dir = tempfile.mkdtemp(prefix="orchestrator-ckpt-")
                    save_state(checkpoint_dir, state)
    return metrics, checkpoint_dir


def _worker_paces(interval: Interval, device: torch.device) -> dict[str, float]:
    """Each rank's own pace: its samples over its compute and data-wait seconds (time spent waiting
    for the other ranks is sync). Under DDP every step waits for the slowest rank, so one slow node
    shows here (doctor)."""
    rank, world = ranks.world()
    if world == 1:
        return {}
    busy = interval.timer.seconds["compute"] + interval.timer.seconds["data_wait"]
    paces = [0.0] * world
    paces[rank] = interval.samples / max(busy, 1e-9)
    return {f"worker/{r}/samples_per_s": p
            for r, p in enumerate(ranks.all_reduce_sum(paces, device))}


def _interval_metrics(interval: Interval, progress: Progress, parts: Parts, world: int,
                      max_nonfinite: int) -> tuple[dict[str, Any], float, float]:
    """The interval's figures summed over ranks, with its sample and target counts (throughput comes
    later, once the interval's wall time is known): the interval's one read of the device. Its
    non-finite steps are counted here, so train.max_nonfinite_steps stops a run at the first report
    after the step that passed it."""
    shared, own = interval.sums(parts.device)
    if world > 1:
        dist.all_reduce(shared)
    figures = torch.cat([shared, own]).tolist()
    loss_sum_, targets, samples, loss_targets, norm_sum, norms, skipped = figures
    progress.nonfinite_skipped += int(skipped)
    if progress.nonfinite_skipped > max_nonfinite:
        raise _too_many_non_finite(progress, max_nonfinite)
    # nan: every step of the interval was skipped
    loss = loss_sum_ / loss_targets if loss_targets else math.nan
    if loss_targets and not math.isfinite(loss):
        raise NonFiniteLossError(
            f"training loss became {loss} by step {progress.step}: lower optim.lr, raise "
            "optim.warmup_steps, set optim.max_grad_norm, or use train.precision=bf16/fp32"
        )
    metrics = {
        "step": progress.step,
        "epoch": progress.epoch,
        "samples_seen": progress.samples_seen,
        "train_loss": loss,
        "lr": parts.optimizer.param_groups[0]["lr"],
        # The gradient norm is the mean over the steps that were applied; nan when none was (as
        # train_loss).
        "grad_norm": norm_sum / norms if norms else math.nan,
        "skipped_steps": parts.precision.skipped_steps,
        "nonfinite_skipped": progress.nonfinite_skipped,
        "oom_retries": parts.state.oom_retries,
        "micro_batch_size": interval.micro,
        "world_size": world,
        # What DDP vs local SGD costs the network: bytes one rank put into all-reduces since it
        # started, and in this interval per sample of the global batch (the eval/checkpoint average
        # of this report included).
        "comm_bytes": parts.state.comm_bytes,
        "comm_bytes_per_sample": (parts.state.comm_bytes - interval.comm_start) / max(samples, 1),
    }
    return metrics, samples, targets
