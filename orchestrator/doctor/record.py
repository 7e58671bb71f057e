"""What doctor reads of a run and what a rule returns: `RunRecord` (metric histories in step order,
params, tags) with the small readers rules share (`training_share`, `is_study`, `trial_counts`,
`_int_param`, `_world`), `Finding` with its severities (HIGH, MEDIUM, LOW), and `Rule`, the type of
every rule. A metric is read by the name the loop (or the driver) reports it under;
`tracking.view.mlflow_key` maps it to MLflow's."""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.report.cost import PARTS, RESTARTS
from orchestrator.tracking.view import mlflow_key

HIGH, MEDIUM, LOW = 3, 2, 1


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: int
    score: float  # how strongly the rule fired, for the order within a severity
    title: str  # what was seen, with numbers
    changes: tuple[str, ...]  # concrete config changes, as `--set key=value`


# One `--set` value: a dotted config key and a value without spaces (a YAML scalar, or a flow list
# like [1,2]).
_SETTING = re.compile(r"[a-z_]\w*(?:\.\w+)+=\S+")


def settings(change: str) -> list[str] | None:
    """The `--set` values of a config change, written `key=value[ --set key=value ...][ (why)]`;
    None for advice that is not one (a check to make, a search-space edit of the study's YAML)."""
    flags = change.split(" (", 1)[0].split(" --set ")
    return flags if all(_SETTING.fullmatch(flag) for flag in flags) else None


def reason(change: str) -> str | None:
    """The why of a config change: the text in parentheses after its values."""
    _, found, why = change.partition(" (")
    return why.removesuffix(")") if found else None


@dataclass
class RunRecord:
    """What doctor reads of a run: every metric's values in step order, params (flattened config)
    and tags."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def values(self, *names: str) -> list[float]:
        """The history of the first of the metrics `names` that was recorded. A name is what the
        loop (or the driver) reports; `mlflow_key` gives the key MLflow holds it under."""
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


# The ledger's parts that are the training itself (first step to last): the rest is start-up,
# restarts, shutdown.
_TRAINING_PARTS = tuple(p for p in PARTS if p not in ("startup", *RESTARTS, "shutdown"))


def training_share(run: RunRecord, phase: str) -> float | None:
    """`phase`'s share of the training's wall clock (first step to last: start-up, which has its own
    rule, left out): the run's summary, else its reports' `time/<phase>_frac` weighted by their
    seconds, else (a study's parent run) the ledger's `cost/<phase>_frac` over the ledger's training
    parts."""
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
    # Rows of the parent's summary table (`study/trials_*`); metrics of a study recorded before
    # that.
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
    """Workers of the run: the largest world size it reported, else the config's (the largest of
    `[min, max]`)."""
    configured = [int(n) for n in re.findall(r"\d+", run.param("scaling.num_workers") or "")]
    return int(max(run.values("world_size"), default=0)) or max(configured, default=1)


def _elastic(run: RunRecord) -> bool:
    return len(_world_sizes(run)) > 1


def _world_sizes(run: RunRecord) -> range:
    """Every world size the config allows (one, or `[min, max]`'s range), else the largest
    reported."""
    configured = [int(n) for n in re.findall(r"\d+", run.param("scaling.num_workers") or "")]
    if configured:
        return range(min(configured), max(configured) + 1)
    return range(_world(run), _world(run) + 1)


def batch_split(run: RunRecord, global_batch: int | None = None, micro: int | None = None,
                workers: int | None = None) -> str | None:
    """`--set` values of a batch split that loads whatever the run's config pins (global =
    micro-batch x accumulation x workers): the micro-batch with its accumulation (null in an elastic
    group: derived per size), the global batch and the worker count where they change. The run's own
    figures where not given; None when they do not divide."""
    batch = _int_param(run, "train.global_batch_size")
    if batch is None:
        return None
    target = global_batch or batch
    sizes = range(workers, workers + 1) if workers else _world_sizes(run)
    changed = [*([f"scaling.num_workers={workers}"] if workers else []),
               *([f"train.global_batch_size={target}"] if target != batch else [])]
    if micro is None and run.param("train.micro_batch_size") == "auto":
        return " --set ".join(changed) or None  # auto: each worker derives its accumulation
    micro = (micro or _int_param(run, "train.micro_batch_size")
             or int(run.last("micro_batch_size") or 0))
    if not micro or any(target % size or (target // size) % micro for size in sizes):
        return None
    accum = str(target // (micro * sizes[0])) if len(sizes) == 1 else "null"
    return " --set ".join([*changed, f"train.micro_batch_size={micro}",
                           f"train.grad_accum_steps={accum}"])
