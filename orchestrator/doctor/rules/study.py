"""Doctor's rules on a study (its parent run): too few trials for the searched keys (`study_size`),
and a best value at the edge of a searched range or choice list (`search_space_edge`), widened
within the key's own config bounds (`field_bounds`, `_clamp`, `_widened`, `_extended`)."""

from __future__ import annotations

import json
import math
from typing import Any

from orchestrator.config import Config
from orchestrator.doctor.record import HIGH, MEDIUM, Finding, RunRecord, trial_counts

TRIALS_PER_PARAMETER = 4
OPTUNA_STARTUP_TRIALS = 10  # Optuna's TPE samples at random until it has this many trials


def study_size(run: RunRecord) -> Finding | None:
    """Too few trials for the searched keys: fewer than 4 per sampled key leaves each range seen at
    a couple of points, so the best trial is mostly luck (a grid key multiplies the trials instead
    of needing samples)."""
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
             if run.param("tune.scheduler", run.tags.get("orchestrator.scheduler")) == "asha"
             else "each is a full run"]
    if run.param("tune.searcher", run.tags.get("orchestrator.searcher")) == "optuna":
        samples = max(samples, 2 * OPTUNA_STARTUP_TRIALS)
        notes.append(f"Optuna's TPE samples at random for its first {OPTUNA_STARTUP_TRIALS} trials")
    return Finding("study size", HIGH if trials <= len(sampled) * grid else MEDIUM,
                   1 - trials / needed,
                   f"study of {trials} trials for {len(sampled)} searched keys "
                   f"({', '.join(sampled)}): under {TRIALS_PER_PARAMETER} per "
                   "key, the best trial is mostly luck",
                   (f"tune.num_samples={samples} ({'; '.join(notes)})",))


Bound = tuple[float, bool]  # (value, exclusive): ge/le -> False, gt/lt -> True


def field_bounds(key: str) -> tuple[Bound | None, Bound | None]:
    """(lower, upper) bound of a dotted config key, from its pydantic field's Ge/Gt/Le/Lt; (None,
    None) for keys the config does not bound (a model's own kwargs)."""
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
    """`new` (a range end moved past `edge`) kept on the valid side of the lower (or upper) `bound`:
    at an inclusive bound; short of an exclusive one, which is itself invalid (halfway from the
    edge, one step for integers)."""
    value, exclusive = bound
    side = 1 if lower else -1
    if (new - value) * side > 0:
        return new
    if not exclusive:
        return value
    return value + side if integer else (edge + value) / 2


def _widened(key: str, kind: str, low: float, high: float, lower_edge: bool) -> float | None:
    """The new low (or high) of a range whose best value sits at that edge, kept within the field's
    bounds; None when the range already reaches the bound."""
    integer = kind == "randint"
    lower, upper = field_bounds(key)
    if lower is None and upper is None and low >= 0:
        # no bounds known (a model kwarg): sizes, rates, dropout do not turn negative
        lower = (0.0, False)
    if lower_edge:
        new = low / 10 if kind == "loguniform" else low - (high - low)
        new = _clamp(new, low, lower, integer, lower=True) if lower is not None else new
        return new if new < low else None
    new = high * 10 if kind == "loguniform" else high + (high - low)
    new = _clamp(new, high, upper, integer, lower=False) if upper is not None else new
    return new if new > high else None


def _extended(key: str, values: list[Any], best: Any) -> list[Any] | None:
    """A numeric choice list (3 values or more: 2 are a comparison, not a scan) whose best value is
    its smallest or largest, with one value more past that edge: spaced like the last two (by their
    ratio when they are 2x apart or more, else by their difference) and kept within the key's
    bounds. None otherwise."""
    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    ordered = sorted(set(values)) if all(number(v) for v in values) and number(best) else []
    if len(ordered) < 3 or best not in (ordered[0], ordered[-1]):
        return None
    up = best == ordered[-1]
    edge, near = (ordered[-1], ordered[-2]) if up else (ordered[0], ordered[1])
    new = (edge * (edge / near) if edge * near > 0 and max(edge / near, near / edge) >= 2
           else 2 * edge - near)
    integer = all(isinstance(v, int) for v in values)
    # as printed: 0.9999999999999999 would print as 1
    new = round(new) if integer else float(f"{new:.6g}")
    lower, upper = field_bounds(key)
    if lower is None and upper is None and ordered[0] >= 0:
        lower = (0.0, False)  # as for ranges: a model kwarg's sizes and rates do not turn negative
    bound = upper if up else lower
    new = _clamp(new, edge, bound, integer, lower=not up) if bound else new
    if (new <= edge) if up else (new >= edge):
        return None
    return sorted([*values, int(new) if integer else new])


def search_space_edge(run: RunRecord) -> Finding | None:
    """A study whose best value sits at the edge of a searched range, or is the smallest or largest
    value of a numeric choice list: the optimum may lie outside it. The wider range (or the value
    added to the list) stays within the key's own bounds (momentum < 1, weight decay >= 0)."""
    space, best = (run.tags.get("orchestrator.search_space"),
                   run.tags.get("orchestrator.best_params"))
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
    return Finding("search space", HIGH, worst, "the best trial's value lies at "
                                                "the edge of what was searched",
                   tuple(changes))
