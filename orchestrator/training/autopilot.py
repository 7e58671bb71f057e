"""The autopilot (`autopilot.enabled`): the run's first steps measure the settings that leave the
math of training unchanged, one dimension at a time (the micro-batch at the fixed global batch, bf16
vs fp32 when train.precision is auto, torch.compile, torch threads and flush_denormal on CPU ranks;
train.sync and train.tf32, which change it, only when autopilot.allow lists them), and the rest of
the run trains with the fastest. Every measured step is a real step of the run. A step's time is the
slowest rank's (an all-reduce max), rank 0 decides and broadcasts, a candidate that fails on any
rank (out of memory, compile error) is dropped on all, and the choice is kept in Progress: a
checkpoint carries it and a resume applies it without searching."""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from orchestrator.config import Config
from orchestrator.models.tasks import step_loss_sum
from orchestrator.training import ranks
from orchestrator.training.candidates import micro_options, other_options
from orchestrator.training.checkpoint import Progress, unwrap
from orchestrator.training.knobs import Knobs, Settings, flush_switchable
from orchestrator.training.memory import GIB, is_oom, release_cached_memory, restart_peak
from orchestrator.training.micro_batch import for_world_size
from orchestrator.training.parts import Parts
from orchestrator.training.precision import flush_denormals
from orchestrator.training.step import StepResult, cut, first_compiled_step, train_step
from orchestrator.training.timing import PhaseTimer
from pipelines.tensors import Batch, rows

# steps a candidate runs before it is timed (caches, allocator, a recompile for new shapes)
WARMUP = 1
MIN_TIMED, MAX_TIMED = 3, 8  # timed steps per candidate
# a candidate this many times slower than the best is dropped after its first timed step
HOPELESS = 1.5
# bounds of the noise margin a candidate must beat the best by (twice the start's spread)
MARGIN = (0.02, 0.10)
# What torch.compile is assumed to cost before it is measured: tried only when the budget left
# covers it.
COMPILE_GUESS_S = 30.0
# Settings torch.compile's guards read (process-wide state: threads, TF32, the autocast around the
# model): a compiled model stepped under a new value of one recompiles, so such a candidate costs a
# compile too.
RECOMPILES = frozenset({"torch_threads", "tf32", "precision"})
# What rank 0 decides after each search step (bits of one broadcast integer).
GO_ON, END, ADOPT, STOP = 0, 1, 2, 4


@dataclass
class Trial:
    """A candidate being measured: warm-up steps left and the timed steps' seconds (each the slowest
    rank's)."""

    settings: Settings
    warmup: int = WARMUP
    times: list[float] = field(default_factory=list)
    compile_s: float | None = None
    peak_gb: float = 0.0
    failed: str | None = None
    started: bool = False
    piece_rows: int = 0  # rows of its largest forward
    # rank 0's mean training loss of each timed step
    losses: list[float] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return statistics.median(self.times) if self.times else math.inf


def _spread(times: list[float]) -> float:
    """Relative median absolute deviation: how noisy a candidate's step times are."""
    middle = statistics.median(times)
    return statistics.median(abs(t - middle) for t in times) / middle if middle > 0 else 0.0


def begin(cfg: Config, parts: Parts,
          progress: Progress) -> tuple[Autopilot | None, dict[str, Any] | None]:
    """At the loop's start, on every rank: the search to run, or None with what the first report
    carries (rank 0; None elsewhere): the choice kept from the checkpoint, applied here, or why the
    run is too short to search. A group resized since the checkpoint keeps its choice but the
    micro-batch, which it measures again."""
    t = cfg.train
    rank, world = ranks.world()
    per_worker = t.micro_batch_size * t.grad_accum_steps  # type: ignore[operator]
    knobs = Knobs(parts, t.micro_batch_size, t.flush_denormal,  # type: ignore[arg-type]
                  t.local_sgd)
    start = knobs.read(parts, per_worker)
    saved = progress.autopilot
    resized = saved is not None and saved.get("world") != world
    if saved is not None:
        # A setting a checkpoint predates (sync, tf32) is the run's as configured, as kept_config
        # builds it.
        chosen = Settings(**(asdict(start) | saved["chosen"]))
        if resized or not _joins(chosen.micro_batch_size, knobs.micro, per_worker):
            # The micro-batch depends on the world size (re-measured below after a resize); the rest
            # holds.
            chosen = replace(chosen, micro_batch_size=start.micro_batch_size,
                             grad_accum_steps=start.grad_accum_steps)
        knobs.apply(parts, chosen)
        if not resized:
            kept = summary(Settings(**(asdict(start) | saved["start"])), chosen,
                           predicted_speedup=saved.get("predicted_speedup"),
                           start_samples_per_s=saved.get("start_samples_per_s"))
            return None, (kept | {"from_checkpoint": True} if rank == 0 else None)
        start = chosen
    steps = t.max_steps - progress.step  # type: ignore[operator]
    if cfg.autopilot.budget * steps < 2 * (WARMUP + MIN_TIMED):
        why = (f"run too short to pay for the search: autopilot.budget {cfg.autopilot.budget:g} "
               f"x {steps} steps is {cfg.autopilot.budget * steps:.1f} steps' time, less than "
               f"two candidates' measurement ({2 * (WARMUP + MIN_TIMED)} steps); training with "
               "the config as written")
        return None, (summary(start, start, skipped=why) if rank == 0 else None)
    return Autopilot(cfg, progress, knobs, start, per_worker, micro_only=resized), None


def kept_config(cfg: Config, state: dict[str, Any] | None, world: int) -> Config:
    """The config a resumed or restarted group builds its model and data pipeline with: the sync
    mode the autopilot chose (its local-SGD state is then restored with the model), and at the world
    size it chose at, its micro-batch, so the step cuts nothing (`begin` applies the rest of the
    choice)."""
    saved = (state or {}).get("progress", {}).get("autopilot")
    if not cfg.autopilot.enabled or not saved:
        return cfg
    # The sync mode holds at any size; built with it, the model restores its local-SGD state too.
    sync = saved["chosen"].get("sync", cfg.train.sync)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"sync": sync})})
    if saved.get("world") != world:
        return cfg
    return for_world_size(cfg, world, int(saved["chosen"]["micro_batch_size"]))


def _joins(micro: int, pipeline_micro: int, per_worker: int) -> bool:
    """Whether the step can run `micro` from the pipeline's micro-batches: a multiple of them
    dividing the per-worker batch, or a divisor of them."""
    if micro >= pipeline_micro:
        return micro % pipeline_micro == 0 and per_worker % micro == 0
    return pipeline_micro % micro == 0


def summary(start: Settings, chosen: Settings, **figures: Any) -> dict[str, Any]:
    """The report's "autopilot" dict (the contract the driver prints and logs)."""
    return {"rows": [], "start": asdict(start), "chosen": asdict(chosen), "from_checkpoint": False,
            "search_s": 0.0, "search_steps": 0, "predicted_speedup": None,
            "skipped": None} | figures


class Autopilot:
    """The search, driven by loop.run one step at a time (`step`) until `done`; `report` is then
    rank 0's summary. Every rank runs the same candidates in the same steps: rank 0's decisions are
    broadcast."""

    def __init__(self, cfg: Config, progress: Progress, knobs: Knobs, start: Settings,
                 per_worker: int, micro_only: bool = False) -> None:
        self.cfg, self.progress, self.knobs, self.per_worker = cfg, progress, knobs, per_worker
        # a resized group: the rest of the checkpoint's choice holds at any size
        self.micro_only = micro_only
        self.start, self.trial = start, Trial(start)
        self.best: Trial | None = None
        self.trials: list[Trial] = []
        self.spent, self.steps = 0.0, 0
        # Rows of the largest piece that ran, per precision: fp32's activations take about twice
        # bf16's memory, so a piece known to fit in one precision is not known to fit in a wider
        # one.
        self.fits: dict[str, int] = {}
        # The budget pays for the candidates' steps: the start's are the steps the run takes without
        # a search.
        self.charged = 0.0
        self.steps_left = cfg.train.max_steps - progress.step  # type: ignore[operator]
        self.budget_s, self.margin, self.adopted = math.inf, MARGIN[0], False
        # False where the CPU cannot flush, or a switch mid-run would not reach torch's intra-op
        # threads.
        self.flush_ok = flush_denormals(start.flush_denormal) and flush_switchable()
        self.walker = self._walk() if ranks.world()[0] == 0 else None
        self.done, self.report = False, None

    def step(self, parts: Parts, batch: list[Batch], timer: PhaseTimer) -> StepResult:
        """One real step of the run under the candidate being measured, timed; then rank 0's
        decision."""
        trial = self.trial
        if not trial.started:
            self._open(parts, trial, batch)
        # Timed from when every rank is at the step: under DDP a rank still waiting for its data
        # would hold the others in the gradient all-reduce, and its data wait would be billed to the
        # candidate. Under NCCL the meeting all-reduce returns before it completes: the clock starts
        # once the device has passed it (a search step's wait, at both ends of its window; the run's
        # own steps never wait).
        ranks.meet(parts.device)
        if parts.device.type == "cuda":
            torch.cuda.synchronize(parts.device)
        retries, started = parts.state.oom_retries, time.perf_counter()
        result, compiled = self._run(parts, batch, timer, trial)
        if parts.device.type == "cuda":
            torch.cuda.synchronize(parts.device)
        peak = (torch.cuda.max_memory_allocated(parts.device) / GIB if parts.device.type == "cuda"
                else 0.0)
        seconds, ran_out, peak = ranks.all_reduce_max(
            [time.perf_counter() - started, float(parts.state.oom_retries > retries), peak],
            parts.device)
        self.spent, self.steps = self.spent + seconds, self.steps + 1
        self.charged += seconds if self.best is not None else 0.0
        trial.peak_gb = max(trial.peak_gb, peak)
        # the step's own retry cut its pieces
        if ran_out and trial.failed is None and self.best is not None:
            trial.failed = "failed: out of memory (the step was retried with smaller pieces)"
        if not ran_out and trial.failed is None:
            precision = trial.settings.precision
            self.fits[precision] = max(self.fits.get(precision, 0), trial.piece_rows)
        if compiled:
            trial.compile_s = seconds  # the step that compiled the model, timed apart
        if trial.warmup > 0:
            trial.warmup -= 1
        elif trial.failed is None:
            trial.times.append(seconds)
            trial.losses.append(float(result.loss_sum) / max(float(result.targets), 1.0))
        verdict = self._verdict(trial) if ranks.world()[0] == 0 else GO_ON
        code = ranks.rank0_int(verdict, parts.device)
        if code & END:
            self._close(parts, code)
        return result

    def _open(self, parts: Parts, trial: Trial, batch: list[Batch]) -> None:
        """Put the candidate on `parts`. A micro-batch larger than any that ran in its precision is
        first tried on one piece, off the step (a rank out of memory inside a step's gradient
        all-reduce could not be undone): if any rank runs out, the candidate is dropped on all, and
        the step runs with the best settings."""
        trial.started = True
        self.knobs.apply(parts, trial.settings)
        if parts.eager_model is not None:
            trial.warmup += 1  # the compiling step
        # the candidate's own peak; the report's interval keeps the whole one
        if parts.device.type == "cuda":
            restart_peak(parts.device)
        first = cut(parts, batch)[0]
        trial.piece_rows = rows(first)
        fits = self.fits.get(trial.settings.precision, 0)
        if self.best is not None and trial.piece_rows > fits and _runs_out(parts, first):
            trial.failed = f"failed: out of memory at {trial.piece_rows} rows per forward"
            self.knobs.apply(parts, self.best.settings)

    def _run(self, parts: Parts, batch: list[Batch], timer: PhaseTimer,
             trial: Trial) -> tuple[StepResult, bool]:
        """The step; True with it when the step compiled the model."""
        if parts.eager_model is None:
            return train_step(parts, batch, timer), False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result, _ = first_compiled_step(parts, batch)
        if parts.model is not self.knobs.compiled:  # every rank fell back to eager, together
            why = next((str(w.message) for w in caught if "torch.compile" in str(w.message)),
                       "torch.compile failed")
            trial.failed, self.knobs.compiled = f"failed: {why.splitlines()[0][:200]}", None
        return result, True

    def _verdict(self, trial: Trial) -> int:
        """Rank 0's decision after a search step, from figures every rank shares: go on, or end the
        candidate (adopting it as the best or not), and whether the search stops (budget spent, run
        near its end)."""
        stop = STOP if self.charged >= self.budget_s or self.steps >= self.steps_left - 1 else GO_ON
        n = len(trial.times)
        if trial.failed or (n == 0 and not stop):
            return END | stop if trial.failed else GO_ON
        if self.best is None:  # the start: until its figure is stable
            stable = n >= MAX_TIMED or (n >= MIN_TIMED and _spread(trial.times) <= MARGIN[0])
            return END | stop if stable or stop else GO_ON
        ratio = self._cost(trial) / self._cost(self.best)
        adopt = ADOPT if ratio < 1 - self.margin and n >= MIN_TIMED else GO_ON
        decided = (ratio >= 1 - self.margin / 2 or ratio <= 1 - 2 * self.margin
                   or _spread(trial.times) <= self.margin)
        if stop or ratio >= HOPELESS or n >= MAX_TIMED or (n >= MIN_TIMED and decided):
            return END | stop | adopt
        return GO_ON

    def _cost(self, trial: Trial) -> float:
        """Seconds per step over the rest of the run: the step time, plus compiling spread over the
        steps left."""
        return trial.step_s + (trial.compile_s or 0.0) / max(self.steps_left - self.steps, 1)

    def _close(self, parts: Parts, code: int) -> None:
        """End the candidate on every rank, as rank 0 decided; the next one is rank 0's too."""
        trial = self.trial
        self.trials.append(trial)
        # the start: what it really ran (an out-of-memory retry may have cut it)
        if self.best is None:
            trial.settings = self.start = self.knobs.read(parts, self.per_worker)
            self.best = trial
            self.margin = (min(max(2 * _spread(trial.times), MARGIN[0]), MARGIN[1]) if trial.times
                           else MARGIN[1])
            budget_s = self.cfg.autopilot.budget * self.steps_left * trial.step_s
            self.budget_s = budget_s if math.isfinite(budget_s) else 0.0
        elif code & ADOPT:
            self.best = trial
        self.adopted = bool(code & ADOPT)
        following = self._next() if self.walker is not None and not code & STOP else None
        following = ranks.rank0_object(following)
        if following is not None:
            self.trial = Trial(following)
            return
        self.knobs.apply(parts, self.best.settings)
        start_rate = self.cfg.train.global_batch_size / self.trials[0].step_s
        self.progress.autopilot = saved(self.start, self.best.settings, self._speedup(), start_rate)
        self.done = True
        self.report = self._summary() if ranks.world()[0] == 0 else None

    def recut(self, parts: Parts, resize: Callable[[int], None] | None) -> int | None:
        """After the search, on every rank: the data cut at the chosen micro-batch (`resize`), so
        the rest of the run takes whole micro-batches as a run configured with it from the start
        does, instead of joining or cutting the configured ones at every step. Returns the
        micro-batches a step now takes; None when nothing changes."""
        micro = self.best.settings.micro_batch_size  # type: ignore[union-attr]
        if resize is None or micro == self.knobs.micro:
            return None
        resize(micro)
        self.knobs.micro, parts.state.join, parts.state.split = micro, 1, 1
        return self.per_worker // micro

    def _next(self) -> Settings | None:
        """Rank 0: the next candidate, or None when the budget or the run's steps left cannot
        measure one more."""
        one = (WARMUP + MIN_TIMED) * self.best.step_s  # type: ignore[union-attr]
        out_of_budget = self.charged + one > self.budget_s
        if out_of_budget or self.steps + WARMUP + MIN_TIMED >= self.steps_left - 1:
            return None
        tried = {t.settings for t in self.trials}
        return next((s for s in self.walker if s not in tried), None)  # type: ignore[union-attr]

    def _walk(self) -> Iterator[Settings]:
        """The candidates in order, each from the best so far (rank 0): micro-batches larger than
        the best's while each beats the best, else smaller ones alike; then sync (allowed),
        precision (auto only), tf32 (allowed), compile, threads and flush_denormal, each value
        against the best; then, if one of those changed the best, the micro-batch once more (what
        pays depends on them: a larger micro-batch may gain only with more threads)."""
        yield from self._walk_micro()
        if self.micro_only:
            return
        searched = self.best.settings  # type: ignore[union-attr]
        for key, values in other_options(self.cfg, self.start, self.knobs, self.flush_ok):
            for value in values:
                if value != getattr(self.best.settings, key) and self._worth(key):
                    yield replace(self.best.settings, **{key: value})  # type: ignore[union-attr]
        if self.best.settings != searched:  # type: ignore[union-attr]
            yield from self._walk_micro()

    def _walk_micro(self) -> Iterator[Settings]:
        best = self.best.settings.micro_batch_size  # type: ignore[union-attr]
        larger, smaller = micro_options(self.knobs, self.per_worker, best)
        for direction in (larger, smaller):
            improved = False
            for micro in direction:
                yield replace(self.best.settings,  # type: ignore[union-attr]
                              micro_batch_size=micro, grad_accum_steps=self.per_worker // micro)
                if not self.adopted:
                    break
                improved = True
            if improved:
                break

    def _worth(self, key: str) -> bool:
        """Whether a candidate of `key` is measured now, from the best so far: compile, and a
        setting that recompiles a compiled best, only when the budget left covers a compile; TF32
        only while the best trains in fp32 (bf16 and fp16 autocast already narrow the matrix
        products it would change)."""
        best = self.best.settings  # type: ignore[union-attr]
        if key == "compile" or (key in RECOMPILES and best.compile):
            if self.charged + COMPILE_GUESS_S > self.budget_s:
                return False
        return key != "tf32" or best.precision == "fp32"

    def _speedup(self) -> float | None:
        start, best = self.trials[0].step_s, self.best.step_s  # type: ignore[union-attr]
        return start / best if math.isfinite(start) and math.isfinite(best) else None

    def _summary(self) -> dict[str, Any]:
        start_s, batch = self.trials[0].step_s, self.cfg.train.global_batch_size
        table = []
        for trial in self.trials:
            measured = bool(trial.times) and trial.failed is None
            table.append({
                "candidate": trial.settings.line(), "settings": asdict(trial.settings),
                "samples_per_s": batch / trial.step_s if measured else None,
                "ratio": start_s / trial.step_s if measured and math.isfinite(start_s) else None,
                "peak_memory_gb": trial.peak_gb or None, "compile_s": trial.compile_s,
                "status": trial.failed or ("ok" if trial.times
                                           else "stopped: the budget ran out in its warm-up"),
                "chosen": trial is self.best,
                "loss": statistics.fmean(trial.losses) if trial.losses else None})
        return summary(self.start, self.best.settings, rows=table,  # type: ignore[union-attr]
                       search_s=self.spent, search_steps=self.steps,
                       predicted_speedup=self._speedup(), budget_s=self.budget_s,
                       budget_spent_s=self.charged)


def saved(start: Settings, chosen: Settings, speedup: float | None,
          start_rate: float) -> dict[str, Any]:
    """What a checkpoint keeps of the choice (Progress.autopilot); the starting configuration's
    measured samples/s (0 when it was not measured) lets a resumed run's summary say what the choice
    achieves against it."""
    return {"start": asdict(start), "chosen": asdict(chosen), "world": ranks.world()[1],
            "predicted_speedup": speedup, "start_samples_per_s": start_rate}


def _runs_out(parts: Parts, piece: Batch) -> bool:
    """Whether forward and backward of `piece` run out of memory on any rank. On the bare module (no
    DDP hook nor collective fires), with the RNG forked; the gradients are dropped and the buffers
    put back."""
    model = unwrap(parts.model)
    buffers = {name: value.clone() for name, value in model.named_buffers()}
    ran_out = False
    try:
        with torch.random.fork_rng(devices=[parts.device] if parts.device.type == "cuda" else []):
            with parts.precision.autocast():
                output = parts.call(model, piece)
            step_loss_sum(parts.task, output, piece, parts.model_loss).backward()
    except Exception as exc:
        if not is_oom(exc):
            raise
        ran_out = True
    finally:
        parts.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, value in model.named_buffers():
                value.copy_(buffers[name])
        if ran_out:
            release_cached_memory(parts.device)
    return ranks.any_rank(ran_out, parts.device)
