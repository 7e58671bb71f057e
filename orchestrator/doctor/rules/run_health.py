"""Doctor's rules on the run around its steps: non-finite steps skipped (`nonfinite_steps`), a
start-up long for the run (`startup`), workers blocked registering checkpoints (`report_blocking`),
a checkpoint interval far from the one its failures call for (`checkpoint_interval`), validation
passes (`evaluation`) and time in no timed phase (`bookkeeping`), with the ASHA helpers the last two
share (`under_asha`, `_fewer_reports`)."""

from __future__ import annotations

import math

from orchestrator.doctor.record import (
    _TRAINING_PARTS,
    HIGH,
    LOW,
    MEDIUM,
    Finding,
    RunRecord,
    _int_param,
    batch_split,
    is_study,
    training_share,
)
from orchestrator.report.startup import STAGES
from orchestrator.training.checkpoint_interval import auto_interval


def nonfinite_steps(run: RunRecord) -> Finding | None:
    """Many steps skipped for a NaN/inf loss or gradient: the LR is too hot early on. Not
    `skipped_steps`: fp16's GradScaler skips a step each time it lowers its loss scale (at the
    start, then ~1 per 2000 steps), which is how it calibrates, not divergence."""
    skipped = run.last("nonfinite_skipped") or 0
    steps = run.last("step") or 0
    if not steps or skipped / steps < 0.01 or skipped < 2:
        return None
    lr = float(run.param("optim.lr", "0") or 0)
    warmup = int(float(run.param("optim.warmup_steps", "0") or 0))
    changes = [*([f"optim.lr={lr / 3:.2g}"] if lr else []),
               f"optim.warmup_steps={max(2 * warmup, int(steps * 0.05), 10)}"]
    if run.param("optim.max_grad_norm") is None:
        changes.append("optim.max_grad_norm=1.0")
    return Finding("non-finite steps", HIGH if skipped / steps >= 0.05 else MEDIUM, skipped / steps,
                   f"{int(skipped)} of {int(steps)} steps skipped for "
                   "a non-finite loss or gradient", tuple(changes))


def startup(run: RunRecord) -> Finding | None:
    """Most of the run's wall clock went before the first step: the run is too short for its
    start-up, or the start-up has one slow stage to fix."""
    share = run.last("cost/startup_frac")
    if share is None or share < 0.3:
        return None
    # MLflow's opening runs beside the others (while the worker group starts): it does not hold the
    # first step.
    stages = {stage: seconds for stage in STAGES if stage != "tracking"
              and (seconds := run.last(f"startup/{stage.replace(' ', '_').replace('-', '_')}_s"))
              is not None}
    slowest = max(stages, key=stages.__getitem__) if stages else None
    study = is_study(run)
    whose = "the trials'" if study else "the run's"
    title = f"start-up took {share:.0%} of {whose} wall clock"
    if slowest:
        title += (f" ({run.last('startup/total_s') or 0:.1f} s to the first step; "
                  f"slowest: {slowest} {stages[slowest]:.1f} s)")
    per = "trial" if study else "run"
    changes = [*([longer] if (longer := _longer(run, share, per)) else []),
               "cluster.keep_warm_minutes=10 (the next command joins this one's "
               "local cluster instead of starting one; or run on a running cluster, "
               "with --address or ray job submit: no Ray start per command)"]
    if slowest == "datasets" and run.param("data.cache", "auto") in ("auto", "memory"):
        changes.append("data.cache=none (the memory cache reads every row before the first step)")
    return Finding("start-up", HIGH if share >= 0.5 else MEDIUM, share, title, tuple(changes))


STARTUP_SHARE = 0.1  # of the wall clock: what a run long enough for its start-up pays


def _longer(run: RunRecord, share: float, per: str) -> str | None:
    """train.max_steps (or train.epochs) long enough that a start-up taking `share` of the wall
    clock now would take STARTUP_SHARE of it: the training scaled by share x (1 - S) / (S x (1 -
    share)); steps rounded up to a report."""
    factor = share * (1 - STARTUP_SHARE) / (STARTUP_SHARE * (1 - share))
    why = (f" (start-up is paid once per {per}, not per step: this "
           f"makes it about {STARTUP_SHARE:.0%} of the wall clock)")
    steps, epochs = _int_param(run, "train.max_steps"), run.param("train.epochs")
    if steps:
        every = _int_param(run, "train.log_every") or 1
        return f"train.max_steps={math.ceil(steps * factor / every) * every}{why}"
    if epochs is not None:
        return f"train.epochs={math.ceil(float(epochs) * factor)}{why}"
    return None


def report_blocking(run: RunRecord) -> Finding | None:
    """Workers sat blocked registering checkpoints with Ray Train (a barrier that waits for the
    controller)."""
    share = run.last("cost/report_frac")
    if share is None:
        share = run.mean("time/report_frac")
    if share is None or share < 0.1:
        return None
    every = run.param("checkpoint.every", "100") or "100"
    changes = [] if every == "auto" else [f"checkpoint.every={2 * int(every)}"]
    if run.param("checkpoint.upload") == "sync":
        changes.append("checkpoint.upload=async")
    changes.append("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S: unset "
                   "it, or lower it (the product runs at 0.2 s)")
    return Finding("checkpoint reports", HIGH if share >= 0.3 else MEDIUM, share,
                   f"workers were blocked registering checkpoints {share:.0%} of the time",
                   tuple(changes))


def checkpoint_interval(run: RunRecord) -> Finding | None:
    """A run that failed: checkpoints so rare that each failure redoes much work, or so frequent
    that saving them costs more than failures lose. The interval that loses least is about sqrt(2 x
    checkpoint cost x mean time between failures) (Young's approximation), clamped as
    checkpoint.every=auto clamps it (training/checkpoint_interval.py), measured here from the run's
    own ledger and failures."""
    failures = sum(1 for tag in run.tags if tag.startswith("orchestrator.failure."))
    wall, steps = run.last("cost/wall_s"), _int_param(run, "train.max_steps")
    # None under auto: it sets the interval from these figures itself
    every = _int_param(run, "checkpoint.every")
    if not failures or not wall or not steps or not every:
        return None
    saves = max(1, steps // every)
    # The checkpoint's blocked part: writing it, then registering it with Ray Train.
    cost_s = ((run.last("cost/checkpoint_frac") or 0.0)
              + (run.last("cost/report_frac") or 0.0)) * wall / saves
    step_s = sum(run.last(f"cost/{p}_frac") or 0.0 for p in _TRAINING_PARTS) * wall / steps
    if cost_s <= 0 or step_s <= 0:
        return None
    minutes = run.param("checkpoint.every_minutes")
    interval = auto_interval(cost_s, wall / failures,
                             float(minutes) if minutes not in (None, "None") else None)
    best = max(1, round(interval.seconds / step_s))
    if every / 2 <= best <= every * 2:
        return None
    title = (f"{failures} failure{'s' * (failures > 1)} in {wall:.0f} s: the "
             f"interval that loses least is {interval.why()} = "
             f"{interval.seconds:.0f} s, {best} steps (checkpoint.every is {every})")
    return Finding("checkpoint interval", MEDIUM, abs(math.log(best / every)), title,
                   ("checkpoint.every=auto (sets it from these figures as the run goes)",
                    f"checkpoint.every={best}"))


def under_asha(run: RunRecord) -> bool:
    """A study whose ASHA scheduler ranks trials by a validation metric at every report: each report
    must then validate (docs/tune.md's rule), so the evaluation cadence follows the report
    cadence."""
    scheduler = run.param("tune.scheduler", run.tags.get("orchestrator.scheduler"))
    metric = run.param("tune.metric") or "val_"  # null: the task's metric, a validation one
    return is_study(run) and scheduler == "asha" and metric.startswith("val_")


def _fewer_reports(run: RunRecord) -> str | None:
    """Under ASHA: reports (each one validating) half as often, as one change of both cadences; None
    without a report cadence."""
    log_every = _int_param(run, "train.log_every")
    if not log_every:
        return None
    new = 2 * max(log_every, _int_param(run, "train.eval_every") or log_every)
    return (f"train.log_every={new} --set train.eval_every={new} (ASHA compares trials "
            "at every report, so each report validates: fewer reports, fewer passes)")


# A validation pass as long as this many training steps reads roughly 3x that many global batches of
# rows (a forward pass is about a third of a training step): a large split, whatever the run's
# length.
LARGE_PASS_STEPS = 100


def evaluation(run: RunRecord) -> Finding | None:
    """Validation passes took a large share of the training: evaluate less often, or on a smaller
    split. Under ASHA every report validates, so fewer reports; a run validating only at its end
    paid for one pass, a fixed cost that a short run's few steps do not spread thin, so the split is
    named only when that pass is long."""
    share = training_share(run, "eval")
    if share is None or share < 0.15:
        return None
    passes = sum(1 for s in run.values("time/eval_frac") if s > 0)
    title = f"evaluation took {share:.0%} of the training time" + (
        f" ({passes} pass{'es' * (passes > 1)} over the validation split)" if passes else "")
    every = _int_param(run, "train.eval_every")
    steps = _int_param(run, "train.max_steps") or int(run.last("step") or 0)
    smaller = ("a smaller validation split: each pass reads all of data.val (point it at a few of "
               "its shards)")
    severity = HIGH if share >= 0.3 else MEDIUM
    if under_asha(run):
        return Finding("evaluation", severity, share, title,
                       tuple(c for c in (_fewer_reports(run), smaller) if c))
    end_only = steps and ("train.eval_every" in run.params and every is None
                          or every is not None and every >= steps)
    if end_only and share < 1:
        pass_steps = share / (1 - share) * steps  # the one pass, in training steps
        if pass_steps < LARGE_PASS_STEPS:
            return Finding("evaluation", LOW, share,
                           "the one validation pass, at the end of the run, took "
                           f"{share:.0%} of its training time (as long as ~{pass_steps:.0f} "
                           "training steps): a fixed cost per run, nothing to change for a "
                           "longer run, which spreads it thinner", ())
    changes = []
    if every is not None and not end_only:
        changes.append("train.eval_every=null (validate at the end only)"
                       if steps and 2 * every >= steps else f"train.eval_every={2 * every}")
    changes.append(smaller)
    return Finding("evaluation", severity, share, title, tuple(changes))


def bookkeeping(run: RunRecord) -> Finding | None:
    """Much of the training in no timed phase ("other"): per-report work (the interval's all-reduce,
    every node's system stats, metric assembly) and per-step work outside compute (the step's
    target-count all-reduce, Python between kernels). Both shrink per sample with fewer reports and
    more samples per step."""
    share = training_share(run, "other")
    if share is None or share < 0.15:
        return None
    changes = []
    log_every = _int_param(run, "train.log_every")
    if under_asha(run) and (fewer := _fewer_reports(run)):
        changes.append(fewer)
    elif log_every:
        changes.append(f"train.log_every={2 * log_every} (each report gathers figures "
                       "and node stats from every worker outside the timed phases)")
    batch = _int_param(run, "train.global_batch_size")
    if batch and (doubled := batch_split(run, 2 * batch)):
        changes.append(f"{doubled} (the fixed cost of a step spread over twice the samples; "
                       "that changes the optimisation, so retune optim.lr and compare the loss)")
    return Finding("other overhead", HIGH if share >= 0.3 else MEDIUM, share,
                   f"{share:.0%} of the training time was in no "
                   "timed phase (reports, per-step bookkeeping)",
                   tuple(changes))
