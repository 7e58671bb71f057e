"""`orchestrator doctor RUN_ID`: read a run's metric histories from MLflow and name what to change, rule by rule.

Each rule is a small function of a `RunRecord` (metric histories, params, tags) returning a `Finding` or None;
findings are sorted by severity, then by how strongly the rule fired. Add a rule by appending to `RULES`.
Metrics are read by the name the loop (or the driver) reports them under; `tracking.mlflow_key` maps it to MLflow's.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from orchestrator.config import Config
from orchestrator.cost import PARTS, RESTARTS
from orchestrator.errors import UserError
from orchestrator.memory_plan import GIB
from orchestrator.startup import STAGES
from orchestrator.tracking.read import read_metrics
from orchestrator.tracking.uri import mask_password, resolve_uri
from orchestrator.tracking.view import mlflow_key

HIGH, MEDIUM, LOW = 3, 2, 1
_SEVERITY = {HIGH: "high", MEDIUM: "medium", LOW: "low"}


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: int
    score: float  # how strongly the rule fired, for the order within a severity
    title: str  # what was seen, with numbers
    changes: tuple[str, ...]  # concrete config changes, as `--set key=value`


@dataclass
class RunRecord:
    """What doctor reads of a run: every metric's values in step order, params (flattened config) and tags."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def values(self, *names: str) -> list[float]:
        """The history of the first of the metrics `names` that was recorded. A name is what the loop (or the
        driver) reports; `mlflow_key` gives the key MLflow holds it under."""
        for name in names:
            if self.metrics.get(key := mlflow_key(name)):
                return self.metrics[key]
        return []

    def mean(self, *names: str) -> float | None:
        values = self.values(*names)
        return statistics.fmean(values) if values else None

    def last(self, *names: str) -> float | None:
        values = self.values(*names)
        return values[-1] if values else None

    def param(self, key: str, default: str | None = None) -> str | None:
        value = self.params.get(key, default)
        return None if value in (None, "None") else value


Rule = Callable[[RunRecord], "Finding | None"]

# The ledger's parts that are the training itself (first step to last): the rest is start-up, restarts, shutdown.
_TRAINING_PARTS = tuple(p for p in PARTS if p not in ("startup", *RESTARTS, "shutdown"))


def training_share(run: RunRecord, phase: str) -> float | None:
    """`phase`'s share of the training's wall clock (first step to last: start-up, which has its own rule, left
    out): the run's summary, else its reports' `time/<phase>_frac` weighted by their seconds, else (a study's
    parent run) the ledger's `cost/<phase>_frac` over the ledger's training parts."""
    summary = run.last(f"summary/time/{phase}_frac")
    if summary is not None:
        return summary
    shares, seconds = run.values(f"time/{phase}_frac"), run.values("interval_s")
    if shares and len(shares) == len(seconds) and sum(seconds) > 0:
        return sum(s * w for s, w in zip(shares, seconds, strict=True)) / sum(seconds)
    if shares:
        return statistics.fmean(shares)
    part = run.last(f"cost/{phase}_frac")
    training = sum(run.last(f"cost/{p}_frac") or 0.0 for p in _TRAINING_PARTS)
    return part / training if part is not None and training > 0 else None


def is_study(run: RunRecord) -> bool:
    return run.tags.get("orchestrator.role") == "study" or "orchestrator.search_space" in run.tags


def trial_counts(run: RunRecord) -> dict[str, int]:
    """A study's trials by how they ended, from its parent run (empty while the study runs)."""
    # Rows of the parent's summary table (`study/trials_*`); metrics of a study recorded before that.
    counts = {status: int(run.last(f"study/trials_{status}", f"trials_{status}") or 0)
              for status in ("completed", "stopped", "error")}
    if not any(counts.values()) and run.last("cost/trials"):
        return {"total": int(run.last("cost/trials") or 0)}
    return {status: n for status, n in counts.items() if n}


def _int_param(run: RunRecord, key: str, default: int | None = None) -> int | None:
    """An integer param; `default` when absent or not a number."""
    value = run.param(key)
    try:
        return int(float(value)) if value is not None else default
    except ValueError:
        return default


def _world(run: RunRecord) -> int:
    """Workers of the run: the largest world size it reported, else the config's (the largest of `[min, max]`)."""
    configured = [int(n) for n in re.findall(r"\d+", run.param("scaling.num_workers") or "")]
    return int(max(run.values("world_size"), default=0)) or max(configured, default=1)


def data_pipeline(run: RunRecord) -> Finding | None:
    """Training waits on data: more prefetch, more read parallelism, the cache."""
    share = run.mean("time/data_wait_frac", "summary/time/data_wait_frac", "data_wait_frac")
    if share is None or share < 0.15:
        return None
    prefetch = int(run.param("data.prefetch_batches", "2") or 2)
    changes = [f"data.prefetch_batches={max(4, 2 * prefetch)}"]
    parallelism = run.param("data.read_parallelism")
    changes.append(f"data.read_parallelism={2 * int(parallelism)}" if parallelism else
                   "data.read_parallelism=<CPUs per node for reading, e.g. 8>")
    cache = run.param("data.cache", "auto")
    remote = str(run.param("data.train", "")).startswith(("s3://", "gs://"))
    if cache in ("none", "auto"):
        changes.append("data.cache=~/.cache/orchestrator/shards (a node-local directory of your own: remote shards)"
                       if remote else "data.cache=memory")
    if run.param("data.transforms") not in (None, "[]"):
        changes.append("data.transforms: cheaper or fewer per-batch transforms (they run in the read path)")
    return Finding("data pipeline", HIGH if share >= 0.3 else MEDIUM, share,
                   f"training waited on data {share:.0%} of the time", tuple(changes))


def memory_headroom(run: RunRecord) -> Finding | None:
    """Device memory mostly free: a larger micro-batch runs the same samples in fewer, larger kernels."""
    peak, total = run.values("memory/peak_allocated_gb"), run.last("device/memory_total_gb")
    if not peak or not total:
        return None
    used = max(peak) / total
    if used >= 0.5:
        return None
    micro, batch = int(run.last("micro_batch_size") or 0), _int_param(run, "train.global_batch_size")
    changes = ["train.micro_batch_size=auto"]
    # global = micro x accumulation x workers: a doubled micro-batch halves an even accumulation, else it needs
    # a doubled global batch (the config refuses a micro-batch that does not divide it).
    accum = batch // (micro * _world(run)) if micro and batch else 0
    if accum and accum % 2 == 0:
        changes.append(f"train.micro_batch_size={2 * micro} (half the accumulation steps)")
    elif micro and batch:
        changes.append(f"train.micro_batch_size={2 * micro} --set train.global_batch_size={2 * batch} (no "
                       "accumulation left to trade: with a matching optim.lr)")
    else:
        changes.append("train.global_batch_size=<2x, with a matching optim.lr> (no accumulation left to trade)")
    return Finding("memory headroom", MEDIUM if used < 0.3 else LOW, 1 - used,
                   f"device memory peaked at {max(peak):.1f} of {total:.0f} GiB ({used:.0%})", tuple(changes))


def model_state(run: RunRecord) -> Finding | None:
    """Under ddp every worker holds the whole model state (parameters, their gradients and the optimizer state,
    from the worker's facts): when it takes over half a worker's memory (train.memory_budget_gb, else the device's)
    or a worker ran out of memory, and fsdp's shards over the run's workers would take at most half, shard it."""
    if (run.param("train.parallel") or "ddp") != "ddp":
        return None
    params, optimizer = run.last("param_bytes_per_rank"), run.last("optimizer_bytes_per_rank")
    budget = run.param("train.memory_budget_gb")
    memory_gb = float(budget) if budget else run.last("device/memory_total_gb")
    world = _world(run)
    if params is None or optimizer is None or not memory_gb or world < 2:
        return None
    state = 2 * params + optimizer  # the gradients are as large as the parameters (fp32 master copies)
    share, sharded = state / (memory_gb * GIB), state / world
    failures = " ".join(v for k, v in run.tags.items() if k.startswith("orchestrator.failure.")).lower()
    oom = bool(run.last("oom_retries")) or "out of memory" in failures
    if sharded > memory_gb * GIB / 2 or (share <= 0.5 and not oom):
        return None
    title = (f"under ddp each worker holds {state / GIB:.1f} GiB of model state (parameters, gradients, optimizer "
             f"state), {share:.0%} of its {memory_gb:g} GiB" + (" and ran out of memory" if oom else "")
             + f"; fsdp over {world} workers would hold {sharded / GIB:.1f} GiB")
    return Finding("model state", HIGH if oom or share >= 1 else MEDIUM, share, title, ("train.parallel=fsdp",))


def precision(run: RunRecord) -> Finding | None:
    """fp32 on a GPU with bf16 support: about twice the math throughput and half the activation memory."""
    used = run.tags.get("orchestrator.precision") or run.param("train.precision")
    if used != "fp32" or not run.last("device/cuda") or not run.last("device/bf16_supported"):
        return None
    return Finding("precision", HIGH, 1.0, "trained in fp32 on a GPU that supports bf16",
                   ("train.precision=bf16",))


def compile_small_kernels(run: RunRecord) -> Finding | None:
    """Low MFU with little work per micro-batch: launch overhead dominates, which torch.compile fuses away."""
    mfu, flops, micro = run.mean("mfu"), run.last("flops_per_sample"), run.last("micro_batch_size")
    if mfu is None or mfu >= 0.2 or run.param("train.compile") in ("True", "true"):
        return None
    if flops and micro and flops * micro >= 5e10:
        return None  # big kernels: compiling will not lift this MFU much; the other findings will
    work = f", {flops * micro / 1e9:.2g} GFLOP per micro-batch" if flops and micro else ""
    return Finding("compile", MEDIUM, 0.2 - mfu, f"MFU {mfu:.1%}{work}: small kernels", ("train.compile=true",))


def nonfinite_steps(run: RunRecord) -> Finding | None:
    """Many steps skipped for a NaN/inf loss or gradient: the LR is too hot early on. Not `skipped_steps`: fp16's
    GradScaler skips a step each time it lowers its loss scale (at the start, then ~1 per 2000 steps), which is
    how it calibrates, not divergence."""
    skipped = run.last("nonfinite_skipped") or 0
    steps = run.last("step") or 0
    if not steps or skipped / steps < 0.01 or skipped < 2:
        return None
    lr = float(run.param("optim.lr", "0") or 0)
    warmup = int(float(run.param("optim.warmup_steps", "0") or 0))
    changes = [f"optim.lr={lr / 3:.2g}" if lr else "optim.lr=<a third of it>",
               f"optim.warmup_steps={max(2 * warmup, int(steps * 0.05), 10)}"]
    if run.param("optim.max_grad_norm") is None:
        changes.append("optim.max_grad_norm=1.0")
    return Finding("non-finite steps", HIGH if skipped / steps >= 0.05 else MEDIUM, skipped / steps,
                   f"{int(skipped)} of {int(steps)} steps skipped for a non-finite loss or gradient", tuple(changes))


Bound = tuple[float, bool]  # (value, exclusive): ge/le -> False, gt/lt -> True


def startup(run: RunRecord) -> Finding | None:
    """Most of the run's wall clock went before the first step: the run is too short for its start-up, or the
    start-up has one slow stage to fix."""
    share = run.last("cost/startup_frac")
    if share is None or share < 0.3:
        return None
    stages = {stage: seconds for stage in STAGES
              if (seconds := run.last(f"startup/{stage.replace(' ', '_').replace('-', '_')}_s")) is not None}
    slowest = max(stages, key=stages.__getitem__) if stages else None
    study = is_study(run)
    whose = "the trials'" if study else "the run's"
    title = f"start-up took {share:.0%} of {whose} wall clock"
    if slowest:
        title += f" ({run.last('startup/total_s') or 0:.1f} s to the first step; slowest: {slowest} " \
                 f"{stages[slowest]:.1f} s)"
    per = "trial" if study else "run"
    changes = [f"train.max_steps=<more steps per {per}> (start-up is paid once per {per}, not per step)",
               "run on a running cluster (--address, or ray job submit): no Ray start per command"]
    if slowest == "datasets" and run.param("data.cache", "auto") in ("auto", "memory"):
        changes.append("data.cache=none (the memory cache reads every row before the first step)")
    if slowest == "tracking":
        changes.append("tracking.uri=http://<mlflow server> (a SQLite file is opened and migrated per command)")
    return Finding("start-up", HIGH if share >= 0.5 else MEDIUM, share, title, tuple(changes))


def report_blocking(run: RunRecord) -> Finding | None:
    """Workers sat blocked registering checkpoints with Ray Train (a barrier that waits for the controller)."""
    share = run.last("cost/report_frac")
    if share is None:
        share = run.mean("time/report_frac")
    if share is None or share < 0.1:
        return None
    every = int(run.param("checkpoint.every", "100") or 100)
    changes = [f"checkpoint.every={2 * every}"]
    if run.param("checkpoint.upload") == "sync":
        changes.append("checkpoint.upload=async")
    changes.append("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S: unset it, or lower it (the product runs at 0.2 s)")
    return Finding("checkpoint reports", HIGH if share >= 0.3 else MEDIUM, share,
                   f"workers were blocked registering checkpoints {share:.0%} of the time", tuple(changes))


def checkpoint_interval(run: RunRecord) -> Finding | None:
    """A run that failed: checkpoints so rare that each failure redoes much work, or so frequent that saving them
    costs more than failures lose. The interval that loses least is about sqrt(2 x checkpoint cost x mean time
    between failures) (Young's approximation), measured here from the run's own ledger and failures."""
    failures = sum(1 for tag in run.tags if tag.startswith("orchestrator.failure."))
    wall, steps = run.last("cost/wall_s"), _int_param(run, "train.max_steps")
    every = _int_param(run, "checkpoint.every")
    if not failures or not wall or not steps or not every:
        return None
    saves = max(1, steps // every)
    # The checkpoint's blocked part: writing it, then registering it with Ray Train.
    cost_s = ((run.last("cost/checkpoint_frac") or 0.0) + (run.last("cost/report_frac") or 0.0)) * wall / saves
    step_s = sum(run.last(f"cost/{p}_frac") or 0.0 for p in _TRAINING_PARTS) * wall / steps
    if cost_s <= 0 or step_s <= 0:
        return None
    mtbf = wall / failures
    best_s = math.sqrt(2 * cost_s * mtbf)
    best = max(1, round(best_s / step_s))
    if every / 2 <= best <= every * 2:
        return None
    title = (f"{failures} failure{'s' * (failures > 1)} in {wall:.0f} s (one every {mtbf:.0f} s) at {cost_s:.1f} s "
             f"per checkpoint: the interval that loses least is about sqrt(2 x {cost_s:.1f} s x {mtbf:.0f} s) = "
             f"{best_s:.0f} s, {best} steps (checkpoint.every is {every})")
    return Finding("checkpoint interval", MEDIUM, abs(math.log(best / every)), title, (f"checkpoint.every={best}",))


def under_asha(run: RunRecord) -> bool:
    """A study whose ASHA scheduler ranks trials by a validation metric at every report: each report must then
    validate (the README's rule), so the evaluation cadence follows the report cadence."""
    scheduler = run.param("tune.scheduler", run.tags.get("orchestrator.scheduler"))
    metric = run.param("tune.metric") or "val_"  # null: the task's metric, a validation one
    return is_study(run) and scheduler == "asha" and metric.startswith("val_")


def _fewer_reports(run: RunRecord) -> str | None:
    """Under ASHA: reports (each one validating) half as often, as one change of both cadences; None without
    a report cadence."""
    log_every = _int_param(run, "train.log_every")
    if not log_every:
        return None
    new = 2 * max(log_every, _int_param(run, "train.eval_every") or log_every)
    return (f"train.log_every={new} --set train.eval_every={new} (ASHA compares trials at every report, so each "
            "report validates: fewer reports, fewer passes)")


# A validation pass as long as this many training steps reads roughly 3x that many global batches of rows (a
# forward pass is about a third of a training step): a large split, whatever the run's length.
LARGE_PASS_STEPS = 100


def evaluation(run: RunRecord) -> Finding | None:
    """Validation passes took a large share of the training: evaluate less often, or on a smaller split. Under
    ASHA every report validates, so fewer reports; a run validating only at its end paid for one pass, a fixed
    cost that a short run's few steps do not spread thin, so the split is named only when that pass is long."""
    share = training_share(run, "eval")
    if share is None or share < 0.15:
        return None
    passes = sum(1 for s in run.values("time/eval_frac") if s > 0)
    title = f"evaluation took {share:.0%} of the training time" + (
        f" ({passes} pass{'es' * (passes > 1)} over the validation split)" if passes else "")
    every = _int_param(run, "train.eval_every")
    steps = _int_param(run, "train.max_steps") or int(run.last("step") or 0)
    smaller = "data.val=<a smaller validation split> (each pass reads all of it: e.g. a few of its shards)"
    severity = HIGH if share >= 0.3 else MEDIUM
    if under_asha(run):
        return Finding("evaluation", severity, share, title, tuple(c for c in (_fewer_reports(run), smaller) if c))
    end_only = steps and ("train.eval_every" in run.params and every is None or every is not None and every >= steps)
    if end_only and share < 1:
        pass_steps = share / (1 - share) * steps  # the one pass, in training steps
        if pass_steps < LARGE_PASS_STEPS:
            return Finding("evaluation", LOW, share,
                           f"the one validation pass, at the end of the run, took {share:.0%} of its training time "
                           f"(as long as ~{pass_steps:.0f} training steps): a fixed cost per run, nothing to change "
                           "for a longer run, which spreads it thinner", ())
    changes = []
    if every is not None and not end_only:
        changes.append("train.eval_every=null (validate at the end only)" if steps and 2 * every >= steps else
                       f"train.eval_every={2 * every}")
    changes.append(smaller)
    return Finding("evaluation", severity, share, title, tuple(changes))


def bookkeeping(run: RunRecord) -> Finding | None:
    """Much of the training in no timed phase ("other"): per-report work (the interval's all-reduce, every node's
    system stats, metric assembly) and per-step work outside compute (the step's target-count all-reduce, Python
    between kernels). Both shrink per sample with fewer reports and more samples per step."""
    share = training_share(run, "other")
    if share is None or share < 0.15:
        return None
    changes = []
    log_every = _int_param(run, "train.log_every")
    if under_asha(run) and (fewer := _fewer_reports(run)):
        changes.append(fewer)
    elif log_every:
        changes.append(f"train.log_every={2 * log_every} (each report gathers figures and node stats from every "
                       "worker outside the timed phases)")
    batch = _int_param(run, "train.global_batch_size")
    changes.append(f"train.global_batch_size={2 * batch if batch else '<2x>'} (with a matching optim.lr: the fixed "
                   "cost of a step is spread over twice the samples)")
    return Finding("other overhead", HIGH if share >= 0.3 else MEDIUM, share,
                   f"{share:.0%} of the training time was in no timed phase (reports, per-step bookkeeping)",
                   tuple(changes))


SMALL_MODEL_BYTES = 100e6  # gradients per step below which an all-reduce is latency-bound, not bandwidth-bound


def gradient_sync(run: RunRecord) -> Finding | None:
    """Workers spent a large share of the training in the gradient all-reduce (the exposed part, beyond compute).
    A small model gains little from more workers: the all-reduce's fixed latency is paid every step while each
    worker's compute shrinks, so fewer workers or local SGD (averaging every few steps) train faster."""
    share, world = training_share(run, "sync"), _world(run)
    if share is None or share < 0.1 or world < 2:
        return None
    per_sample, batch = run.values("comm_bytes_per_sample"), _int_param(run, "train.global_batch_size")
    grad_bytes = statistics.median(per_sample) * batch if per_sample and batch else None
    size = f", {grad_bytes / 1e6:.2g} MB of gradients per step" if grad_bytes else ""
    title = f"gradient sync took {share:.0%} of the training time ({world} workers{size})"
    halve = (f"train.global_batch_size={2 * batch if batch else '<2x>'} (with a matching optim.lr: half the "
             "all-reduces per sample)")
    if run.param("train.parallel") == "fsdp":  # local SGD cannot run on shards (the config refuses it)
        accumulates = (_int_param(run, "train.grad_accum_steps", 1) or 1) > 1
        deferred = run.param("train.fsdp.defer_sync") == "True"
        changes = [*(["train.fsdp.defer_sync=true (one reduce-scatter per optimizer step, not one per "
                      "micro-batch; each worker then holds unsharded gradients)"] if accumulates and not deferred
                     else []), halve]
    elif run.param("train.sync") == "local_sgd":
        every = _int_param(run, "train.sync_every", 8) or 8
        changes = [f"train.sync_every={2 * every} (average parameters half as often)"]
    elif grad_bytes is not None and grad_bytes < SMALL_MODEL_BYTES:
        changes = [f"scaling.num_workers={max(1, world // 2)} (a model this small is latency-bound: compare "
                   "samples/s)", "train.sync=local_sgd (average parameters every 8 steps, not gradients every step)"]
    else:
        changes = ["train.sync=local_sgd (average parameters every 8 steps, not gradients every step)", halve]
    return Finding("gradient sync", HIGH if share >= 0.25 else MEDIUM, share, title, tuple(changes))


# Each rank's own pace: its samples over its own compute and data-wait seconds (waits on other ranks left out).
# The loop does not report it yet (see the README's doctor section); the rule reads it when it is there.
WORKER_RATE = "worker/{rank}/samples_per_s"


def uneven_workers(run: RunRecord) -> Finding | None:
    """One worker much faster or slower than the others: under DDP every rank waits for the slowest each step,
    so the run goes at its pace. A lone fast worker means the others are slow (sharing a node's cores, say)."""
    rates = {rank: statistics.median(values) for rank in range(_world(run))
             if (values := run.values(WORKER_RATE.format(rank=rank)))}
    if len(rates) < 2:
        return None

    def ratio(rank: int) -> float:
        return rates[rank] / max(statistics.median(r for k, r in rates.items() if k != rank), 1e-9)

    odd = max(rates, key=lambda rank: abs(math.log(max(ratio(rank), 1e-9))))
    factor = ratio(odd)
    if 1 / 1.5 < factor < 1.5:
        return None
    others = sorted(r for k, r in rates.items() if k != odd)
    spread = f"{others[0]:,.0f}" if len(others) == 1 else f"{others[0]:,.0f}-{others[-1]:,.0f}"
    title = (f"worker {odd} ran at {rates[odd]:,.0f} samples/s, {factor:.1f}x the others ({spread}); every step "
             f"waits for the slowest")
    cpus = run.param("scaling.cpus_per_worker", "1")
    slow = "the other workers' nodes" if factor > 1 else f"worker {odd}'s node"
    changes = (f"check {slow}: other load, fewer free cores, a slower device (`ray status`, the dashboard)",
               f"scaling.cpus_per_worker=<a node's cores / its workers> (now {cpus}: Ray places workers by it and "
               "each worker runs that many torch threads)")
    severity = HIGH if max(factor, 1 / factor) >= 2 else MEDIUM
    return Finding("uneven workers", severity, abs(math.log(factor)), title, changes)


TRIALS_PER_PARAMETER = 4
OPTUNA_STARTUP_TRIALS = 10  # Optuna's TPE samples at random until it has this many trials


def study_size(run: RunRecord) -> Finding | None:
    """Too few trials for the searched keys: fewer than 4 per sampled key leaves each range seen at a couple of
    points, so the best trial is mostly luck (a grid key multiplies the trials instead of needing samples)."""
    space = run.tags.get("orchestrator.search_space")
    trials = sum(trial_counts(run).values())
    if not space or not trials:
        return None
    domains = json.loads(space)
    sampled = [key for key, domain in domains.items() if next(iter(domain)) != "grid"]
    grid = math.prod(len(domain["grid"]) for domain in domains.values() if "grid" in domain)
    needed = TRIALS_PER_PARAMETER * len(sampled) * grid
    if not sampled or trials >= needed:
        return None
    samples = TRIALS_PER_PARAMETER * len(sampled)
    notes = ["ASHA stops weak trials early, so extra ones cost less than full runs"
             if run.param("tune.scheduler", run.tags.get("orchestrator.scheduler")) == "asha" else "each is a full run"]
    if run.param("tune.searcher", run.tags.get("orchestrator.searcher")) == "optuna":
        samples = max(samples, 2 * OPTUNA_STARTUP_TRIALS)
        notes.append(f"Optuna's TPE samples at random for its first {OPTUNA_STARTUP_TRIALS} trials")
    return Finding("study size", HIGH if trials <= len(sampled) * grid else MEDIUM, 1 - trials / needed,
                   f"study of {trials} trials for {len(sampled)} searched keys ({', '.join(sampled)}): under "
                   f"{TRIALS_PER_PARAMETER} per key, the best trial is mostly luck",
                   (f"tune.num_samples={samples} ({'; '.join(notes)})",))


def field_bounds(key: str) -> tuple[Bound | None, Bound | None]:
    """(lower, upper) bound of a dotted config key, from its pydantic field's Ge/Gt/Le/Lt; (None, None) for keys
    the config does not bound (a model's own kwargs)."""
    import annotated_types
    from pydantic import BaseModel


    model: Any = Config
    *sections, leaf = key.split(".")
    for name in sections:
        section = model.model_fields.get(name)
        model = section.annotation if section is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None, None
    found = model.model_fields.get(leaf)
    lower = upper = None
    for meta in found.metadata if found is not None else []:
        if isinstance(meta, annotated_types.Ge | annotated_types.Gt):
            lower = (float(meta.ge if isinstance(meta, annotated_types.Ge) else meta.gt),
                     isinstance(meta, annotated_types.Gt))
        elif isinstance(meta, annotated_types.Le | annotated_types.Lt):
            upper = (float(meta.le if isinstance(meta, annotated_types.Le) else meta.lt),
                     isinstance(meta, annotated_types.Lt))
    return lower, upper


def _clamp(new: float, edge: float, bound: Bound, integer: bool, lower: bool) -> float:
    """`new` (a range end moved past `edge`) kept on the valid side of the lower (or upper) `bound`: at an
    inclusive bound; short of an exclusive one, which is itself invalid (halfway from the edge, one step for
    integers)."""
    value, exclusive = bound
    side = 1 if lower else -1
    if (new - value) * side > 0:
        return new
    if not exclusive:
        return value
    return value + side if integer else (edge + value) / 2


def _widened(key: str, kind: str, low: float, high: float, lower_edge: bool) -> float | None:
    """The new low (or high) of a range whose best value sits at that edge, kept within the field's bounds;
    None when the range already reaches the bound."""
    integer = kind == "randint"
    lower, upper = field_bounds(key)
    if lower is None and upper is None and low >= 0:
        lower = (0.0, False)  # no bounds known (a model kwarg): sizes, rates, dropout do not turn negative
    if lower_edge:
        new = low / 10 if kind == "loguniform" else low - (high - low)
        new = _clamp(new, low, lower, integer, lower=True) if lower is not None else new
        return new if new < low else None
    new = high * 10 if kind == "loguniform" else high + (high - low)
    new = _clamp(new, high, upper, integer, lower=False) if upper is not None else new
    return new if new > high else None


def _extended(key: str, values: list[Any], best: Any) -> list[Any] | None:
    """A numeric choice list (3 values or more: 2 are a comparison, not a scan) whose best value is its smallest or
    largest, with one value more past that edge: spaced like the last two (by their ratio when they are 2x apart or
    more, else by their difference) and kept within the key's bounds. None otherwise."""
    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    ordered = sorted(set(values)) if all(number(v) for v in values) and number(best) else []
    if len(ordered) < 3 or best not in (ordered[0], ordered[-1]):
        return None
    up = best == ordered[-1]
    edge, near = (ordered[-1], ordered[-2]) if up else (ordered[0], ordered[1])
    new = edge * (edge / near) if edge * near > 0 and max(edge / near, near / edge) >= 2 else 2 * edge - near
    integer = all(isinstance(v, int) for v in values)
    new = round(new) if integer else float(f"{new:.6g}")  # as printed: 0.9999999999999999 would print as 1
    lower, upper = field_bounds(key)
    if lower is None and upper is None and ordered[0] >= 0:
        lower = (0.0, False)  # as for ranges: a model kwarg's sizes and rates do not turn negative
    bound = upper if up else lower
    new = _clamp(new, edge, bound, integer, lower=not up) if bound else new
    if (new <= edge) if up else (new >= edge):
        return None
    return sorted([*values, int(new) if integer else new])


def search_space_edge(run: RunRecord) -> Finding | None:
    """A study whose best value sits at the edge of a searched range, or is the smallest or largest value of a
    numeric choice list: the optimum may lie outside it. The wider range (or the value added to the list) stays
    within the key's own bounds (momentum < 1, weight decay >= 0)."""
    space, best = run.tags.get("orchestrator.search_space"), run.tags.get("orchestrator.best_params")
    if not space or not best:
        return None
    space_d, best_d = json.loads(space), json.loads(best)
    changes, worst = [], 0.0
    for key, domain in space_d.items():
        (kind, bounds), = domain.items()
        if key not in best_d:
            continue
        if kind in ("choice", "grid"):
            if (longer := _extended(key, bounds, best_d[key])) is not None:
                listed = ", ".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in longer)
                changes.append(f"tune.space.{key}: {{{kind}: [{listed}]}}")
                worst = 0.5
            continue
        low, high, value = float(bounds[0]), float(bounds[1]), float(best_d[key])
        scale = math.log if kind == "loguniform" else float
        span = scale(high) - scale(low)
        position = (scale(value) - scale(low)) / span if span else 0.5
        if 0.1 < position < 0.9:
            continue
        new = _widened(key, kind, low, high, lower_edge=position <= 0.1)
        if new is None:
            continue
        new_low, new_high = (new, high) if position <= 0.1 else (low, new)
        # 6 digits: 3 would print 0.9995 (momentum widened toward its bound of 1) as the invalid 1.
        changes.append(f"tune.space.{key}: {{{kind}: [{new_low:.6g}, {new_high:.6g}]}}")
        worst = max(worst, abs(position - 0.5))
    if not changes:
        return None
    return Finding("search space", HIGH, worst, "the best trial's value lies at the edge of what was searched",
                   tuple(changes))


RULES: list[Rule] = [startup, report_blocking, checkpoint_interval, data_pipeline, evaluation, bookkeeping,
                     gradient_sync, uneven_workers, memory_headroom, model_state, precision, compile_small_kernels,
                     nonfinite_steps, study_size, search_space_edge]


def diagnose(run: RunRecord, rules: list[Rule] | None = None) -> list[Finding]:
    """Every rule's finding, most severe (then strongest) first."""
    found = [f for rule in (rules or RULES) if (f := rule(run)) is not None]
    return sorted(found, key=lambda f: (-f.severity, -f.score))


def load_run(run_id: str, tracking_uri: str | None = None) -> RunRecord:
    """The run's params, tags and full metric histories (finished or still running), with the figures of its
    summary table (start-up breakdown, cost ledger, whole-run shares: written when the run ends) as one-value
    histories."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient


    uri = resolve_uri(tracking_uri)
    client = MlflowClient(tracking_uri=uri)
    try:
        run = client.get_run(run_id)
    except MlflowException as exc:  # the URI is shown masked, MLflow's own detail (which repeats it) too
        detail = mask_password(str(exc).splitlines()[0][:200])
        raise UserError(f"MLflow run '{run_id}' not found at {mask_password(uri)} ({detail}): check the run id, or "
                        "pass --tracking-uri") from None
    except Exception as exc:
        raise UserError(f"MLflow tracking at '{mask_password(uri)}' is unavailable ({type(exc).__name__}): pass "
                        "--tracking-uri or start the server") from None
    with _quiet_downloads():
        metrics = read_metrics(client, run_id)
    return RunRecord(metrics, dict(run.data.params), dict(run.data.tags))


@contextlib.contextmanager
def _quiet_downloads() -> Iterator[None]:
    """No MLflow progress bar for the summary table's download (doctor prints a report, not transfers); the
    user's own setting of the variable is back as it was afterwards."""
    name = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    before = os.environ.get(name)
    os.environ[name] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def format_findings(run_id: str, run: RunRecord, findings: list[Finding]) -> str:
    status = run.tags.get("orchestrator.status", "")
    name = run.tags.get("mlflow.runName", run_id)
    lines = [f"doctor: run {name} ({run_id}){' ' + status if status else ''}, {_length(run)}"]
    if not findings:
        lines.append("no findings: nothing in the recorded metrics points at an easy win")
    for i, f in enumerate(findings, 1):
        lines.append(f"{i}. [{_SEVERITY[f.severity]}] {f.rule}: {f.title}")
        # Config keys as the --set flag that applies them; search-space edits go in the study's YAML.
        lines.extend(f"     --set {change}" if "=" in change and not change.startswith("tune.space.")
                     else f"     {change}" for change in f.changes)
    return "\n".join(lines)


def _length(run: RunRecord) -> str:
    """'300 steps' for a run; 'study of 4 trials (3 completed, 1 stopped early)' for a study's parent run."""
    if not is_study(run):
        return f"{int(run.last('step') or 0)} steps"
    counts = trial_counts(run)
    if not counts:
        return "study (no trials recorded yet)"
    words = {"completed": "completed", "stopped": "stopped early", "error": "failed"}
    ended = ", ".join(f"{n} {words[status]}" for status, n in counts.items() if status in words)
    return f"study of {sum(counts.values())} trials" + (f" ({ended})" if ended else "")


def doctor(run_id: str, tracking_uri: str | None = None) -> tuple[RunRecord, list[Finding]]:
    run = load_run(run_id, tracking_uri)
    return run, diagnose(run)


def summary(run_id: str, result: tuple[RunRecord, list[Finding]]) -> str:
    return format_findings(run_id, *result)

