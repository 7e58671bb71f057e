"""`orchestrator doctor RUN_ID`: read a run's metric histories from MLflow and name what to change, rule by rule.

Each rule is a small function of a `RunRecord` (metric histories, params, tags) returning a `Finding` or None;
findings are sorted by severity, then by how strongly the rule fired. Add a rule by appending to `RULES`.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.errors import UserError

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

    def values(self, *keys: str) -> list[float]:
        """The first of `keys` that was recorded."""
        for key in keys:
            if self.metrics.get(key):
                return self.metrics[key]
        return []

    def mean(self, *keys: str) -> float | None:
        values = self.values(*keys)
        return statistics.fmean(values) if values else None

    def last(self, *keys: str) -> float | None:
        values = self.values(*keys)
        return values[-1] if values else None

    def param(self, key: str, default: str | None = None) -> str | None:
        value = self.params.get(key, default)
        return None if value in (None, "None") else value


Rule = Callable[[RunRecord], "Finding | None"]


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
        changes.append("data.cache=/local/disk/cache (remote shards)" if remote else "data.cache=memory")
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
    micro = run.last("micro_batch_size")
    changes = ["train.micro_batch_size=auto"]
    if micro:
        changes.append(f"train.micro_batch_size={int(micro) * 2} (or more)")
    accum = run.param("train.grad_accum_steps")
    if accum in (None, "1"):
        changes.append("train.global_batch_size=<2x, with a matching optim.lr> (no accumulation left to trade)")
    return Finding("memory headroom", MEDIUM if used < 0.3 else LOW, 1 - used,
                   f"device memory peaked at {max(peak):.1f} of {total:.0f} GiB ({used:.0%})", tuple(changes))


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
    stages = {key.removeprefix("startup/").removesuffix("_s").replace("_", " "): values[-1]
              for key, values in run.metrics.items()
              if key.startswith("startup/") and key != "startup/total_s" and values}
    slowest = max(stages, key=stages.__getitem__) if stages else None
    title = f"start-up took {share:.0%} of the run's wall clock"
    if slowest:
        title += f" ({run.last('startup/total_s') or 0:.1f} s to the first step; slowest: {slowest} " \
                 f"{stages[slowest]:.1f} s)"
    changes = ["train.max_steps=<more steps per command> (start-up is paid once per run, not per step)",
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


def field_bounds(key: str) -> tuple[Bound | None, Bound | None]:
    """(lower, upper) bound of a dotted config key, from its pydantic field's Ge/Gt/Le/Lt; (None, None) for keys
    the config does not bound (a model's own kwargs)."""
    import annotated_types
    from pydantic import BaseModel

    from orchestrator.config import Config

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


def search_space_edge(run: RunRecord) -> Finding | None:
    """A study whose best value sits at the edge of a searched range: the optimum may lie outside it. The wider
    range stays within the key's own bounds (momentum < 1, weight decay >= 0)."""
    space, best = run.tags.get("orchestrator.search_space"), run.tags.get("orchestrator.best_params")
    if not space or not best:
        return None
    space_d, best_d = json.loads(space), json.loads(best)
    changes, worst = [], 0.0
    for key, domain in space_d.items():
        (kind, bounds), = domain.items()
        if kind not in ("loguniform", "uniform", "randint") or key not in best_d:
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
    return Finding("search space", HIGH, worst, "the best trial's value lies at the edge of the searched range",
                   tuple(changes))


RULES: list[Rule] = [startup, report_blocking, data_pipeline, memory_headroom, precision, compile_small_kernels,
                     nonfinite_steps, search_space_edge]


def diagnose(run: RunRecord, rules: list[Rule] | None = None) -> list[Finding]:
    """Every rule's finding, most severe (then strongest) first."""
    found = [f for rule in (rules or RULES) if (f := rule(run)) is not None]
    return sorted(found, key=lambda f: (-f.severity, -f.score))


def load_run(run_id: str, tracking_uri: str | None = None) -> RunRecord:
    """The run's params, tags and full metric histories (finished or still running)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from orchestrator.tracking import resolve_uri

    uri = resolve_uri(tracking_uri)
    client = MlflowClient(tracking_uri=uri)
    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        raise UserError(f"MLflow run '{run_id}' not found at {uri} ({str(exc).splitlines()[0][:200]}): check the "
                        "run id, or pass --tracking-uri") from None
    except Exception as exc:
        raise UserError(f"MLflow tracking at '{uri}' is unavailable ({type(exc).__name__}): pass --tracking-uri "
                        "or start the server") from None
    metrics = {}
    for key in run.data.metrics:
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
        metrics[key] = [m.value for m in history]
    return RunRecord(metrics, dict(run.data.params), dict(run.data.tags))


def format_findings(run_id: str, run: RunRecord, findings: list[Finding]) -> str:
    status = run.tags.get("orchestrator.status", "")
    name = run.tags.get("mlflow.runName", run_id)
    lines = [f"doctor: run {name} ({run_id}){' ' + status if status else ''}, {int(run.last('step') or 0)} steps"]
    if not findings:
        lines.append("no findings: nothing in the recorded metrics points at an easy win")
    for i, f in enumerate(findings, 1):
        lines.append(f"{i}. [{_SEVERITY[f.severity]}] {f.rule}: {f.title}")
        # Config keys as the --set flag that applies them; search-space edits go in the study's YAML.
        lines.extend(f"     --set {change}" if "=" in change and not change.startswith("tune.") else f"     {change}"
                     for change in f.changes)
    return "\n".join(lines)


def doctor(run_id: str, tracking_uri: str | None = None) -> tuple[RunRecord, list[Finding]]:
    run = load_run(run_id, tracking_uri)
    return run, diagnose(run)


def summary(run_id: str, result: tuple[RunRecord, list[Finding]]) -> str:
    return format_findings(run_id, *result)

