"""The autopilot's report on the driver (its contract: docs/autopilot.md): rank 0's first report after the search
carries it under "autopilot", a plain dict that is never a metric. Here: taking it out of the report, the table
printed on the terminal, what MLflow keeps of it (the `autopilot.json` table artifact, the chosen settings as
`autopilot.<key>` params, the predicted speed-up and search seconds as `autopilot/*` rows of the run's summary table)
and the line the run's summary prints of what it gained over the configuration the user wrote: predicted (measured
in the search) and achieved (the training's pace after the search against the starting configuration's)."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

from orchestrator.tracking.tracker import Tracker

REPORT_KEY = "autopilot"
TABLE = "autopilot.json"  # MLflow's table format: `columns` and `data` rows
PARAM_PREFIX = "autopilot."  # the chosen settings' params; the config's own keys (autopilot.enabled...) differ
FIGURES = "autopilot/"  # the summary table's section (tracking/view.py)
AT_STEP = "reported_at_step"  # added by the driver: the step of the report that carried it
COLUMNS = ["candidate", "samples_per_s", "ratio", "peak_memory_gb", "compile_s", "loss", "status", "chosen"]
_HEADER = ("candidate", "samples/s", "vs start", "peak memory", "compile s", "chosen")
_LOSS = "train loss"  # a column of its own once a candidate that changes the math was measured (autopilot.allow)
# The phases of an interval the search's timed steps measure (a step's forward, backward and gradient sync; its
# batch is at hand): the achieved pace counts these seconds only, so the two figures compare like with like.
_STEP_PHASES = ("time/compute_frac", "time/sync_frac")


def take_autopilot(report: dict[str, Any]) -> dict[str, Any] | None:
    """The autopilot's report removed from rank 0's `report` (so it is never charted nor kept in the history's
    figures), with the step it came at; None when the report carries none."""
    found = report.pop(REPORT_KEY, None)
    if not isinstance(found, Mapping):
        return None
    return dict(found) | {AT_STEP: report.get("step")}


def _number(value: Any, form: str) -> str:
    return "-" if not isinstance(value, int | float) or isinstance(value, bool) else format(value, form)


def _settings(settings: Mapping[str, Any] | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (settings or {}).items()) or "(none)"


def _chosen_name(autopilot: Mapping[str, Any]) -> str:
    """'chose <the chosen candidate's one-line name, else its settings written out>', or that it kept the
    configuration as written (no candidate beat it by the noise margin)."""
    if autopilot.get("start") and autopilot.get("chosen") == autopilot.get("start"):
        return "kept the configuration as written (no candidate beat it)"
    row = next((r for r in autopilot.get("rows") or [] if r.get("chosen")), None)
    return "chose " + (str(row["candidate"]) if row else _settings(autopilot.get("chosen")))


def table_lines(autopilot: Mapping[str, Any], mark: str = "✓") -> list[str]:
    """The terminal's table: one line per measured candidate (samples/s, ratio to the starting config, peak memory,
    compile seconds, `mark` on the chosen one), then a line per failed candidate, and one closing line (what was
    chosen and predicted, or why nothing was searched)."""
    if autopilot.get("from_checkpoint"):
        return [f"autopilot: kept from the checkpoint, nothing searched: {_settings(autopilot.get('chosen'))}"]
    rows = list(autopilot.get("rows") or [])
    measured = [r for r in rows if r.get("status", "ok") == "ok"]
    # The loss beside the speed where a measured candidate changes the math (its loss may then differ).
    math = any((r.get("settings") or {}).get("sync", "ddp") != "ddp" for r in measured)
    cells = [(*_HEADER, *([_LOSS] if math else []))] + [
        (str(r.get("candidate")), _number(r.get("samples_per_s"), ",.1f"),
         _number(r.get("ratio"), ".2f") + ("x" if isinstance(r.get("ratio"), int | float) else ""),
         _number(r.get("peak_memory_gb"), ".2f") + (" GB" if r.get("peak_memory_gb") else ""),
         _number(r.get("compile_s"), ".1f"), mark if r.get("chosen") else "",
         *([_number(r.get("loss"), ".4f")] if math else [])) for r in measured]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    lines = []
    if measured:
        lines.append("autopilot: candidates measured on the run's own steps")
        lines += [("  " + "  ".join(c[0].ljust(widths[0]) if i == 0 else c[i].rjust(widths[i])
                                    for i in range(len(c)))).rstrip() for c in cells]
    for r in rows:  # failed on a rank (dropped on all), or not measured (the budget ran out in its warm-up)
        status = str(r.get("status", "ok"))
        if status.startswith("failed"):
            lines.append(f"autopilot: dropped {r.get('candidate')}: {status.removeprefix('failed: ')}")
        elif status != "ok":
            lines.append(f"autopilot: not measured {r.get('candidate')}: {status}")
    if autopilot.get("skipped"):
        lines.append(f"autopilot: skipped ({autopilot['skipped']}): training with the configuration as written")
    else:
        lines.append(f"autopilot: {_chosen_name(autopilot)}: {_predicted(autopilot)}; search "
                     f"{_number(autopilot.get('search_s'), '.1f')} s over {autopilot.get('search_steps', '-')} "
                     "steps of the run")
    return lines


def _predicted(autopilot: Mapping[str, Any]) -> str:
    speedup = autopilot.get("predicted_speedup")
    return ("predicted speed-up unknown" if not isinstance(speedup, int | float)
            else f"predicted {speedup:.2f}x the configuration as written")


def print_table(autopilot: Mapping[str, Any]) -> None:
    """The table on stdout; its check mark only where the terminal's encoding can write it."""
    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "✓".encode(encoding)
        mark = "✓"
    except (LookupError, UnicodeEncodeError):
        mark = "*"
    print("\n".join(table_lines(autopilot, mark)), flush=True)


def table(autopilot: Mapping[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """The MLflow table's columns and rows: one per candidate, failed ones included, with its status (a figure
    that is not finite is left empty: JSON has no NaN)."""
    def cell(value: Any) -> Any:
        return None if isinstance(value, float) and not math.isfinite(value) else value

    rows = [[cell(r.get(c)) for c in COLUMNS] for r in autopilot.get("rows") or []]
    return list(COLUMNS), rows


def record_autopilot(tracker: Tracker, autopilot: Mapping[str, Any], step: int, verbose: bool) -> None:
    """The autopilot's report shown (`verbose`) and tracked: the table artifact (when candidates were measured),
    the chosen settings as params, the search's figures in the summary table."""
    if verbose:
        print_table(autopilot)
    if autopilot.get("rows"):
        tracker.log_table(TABLE, *table(autopilot))
    tracker.log_params(params(autopilot))
    tracker.log_metrics(search_figures(autopilot), step=step)


def params(autopilot: Mapping[str, Any]) -> dict[str, Any]:
    """The settings the run trains with as `autopilot.<key>` params (MLflow params never change: the run's config
    params keep the values the user wrote under their own keys)."""
    return {PARAM_PREFIX + str(k): v for k, v in (autopilot.get("chosen") or {}).items()}


def start_samples_per_s(autopilot: Mapping[str, Any]) -> float | None:
    """The starting configuration's measured samples/s: its row's, else the chosen row's over the predicted
    speed-up, else (a choice kept from the checkpoint) what the search measured of it."""
    rows = [r for r in autopilot.get("rows") or [] if r.get("status", "ok") == "ok"
            and isinstance(r.get("samples_per_s"), int | float)]
    start = next((r for r in rows if autopilot.get("start") and r.get("settings") == autopilot.get("start")), None)
    if start is not None:
        return float(start["samples_per_s"])
    chosen, speedup = next((r for r in rows if r.get("chosen")), None), autopilot.get("predicted_speedup")
    if chosen is not None and isinstance(speedup, int | float) and speedup > 0:
        return float(chosen["samples_per_s"]) / speedup
    kept = autopilot.get("start_samples_per_s")
    return float(kept) if isinstance(kept, int | float) and math.isfinite(kept) and kept > 0 else None


def search_figures(autopilot: Mapping[str, Any]) -> dict[str, float]:
    """The summary table's rows known once the search has ended: predicted speed-up, search seconds and steps, the
    budget in seconds and what of it the candidates spent, the starting and chosen configurations' measured
    samples/s, candidates measured and not."""
    rows = list(autopilot.get("rows") or [])
    chosen = next((r for r in rows if r.get("chosen")), {})
    figures = {"predicted_speedup": autopilot.get("predicted_speedup"), "search_s": autopilot.get("search_s"),
               "search_steps": autopilot.get("search_steps"), "start_samples_per_s": start_samples_per_s(autopilot),
               "chosen_samples_per_s": chosen.get("samples_per_s"),
               "candidates": sum(r.get("status", "ok") == "ok" for r in rows),
               "dropped": sum(r.get("status", "ok") != "ok" for r in rows),
               "budget_s": autopilot.get("budget_s"), "budget_spent_s": autopilot.get("budget_spent_s"),
               "skipped": float(bool(autopilot.get("skipped"))),
               "from_checkpoint": float(bool(autopilot.get("from_checkpoint")))}
    return {FIGURES + k: float(v) for k, v in figures.items() if isinstance(v, int | float)}


def achieved_samples_per_s(autopilot: Mapping[str, Any], history: list[dict[str, Any]]) -> float | None:
    """The training's pace after the search: the samples of every report after the one that carried the
    autopilot's, over those intervals' seconds in training steps (compute and gradient sync, what the search times;
    data waits, evaluation, checkpoints and reports left out: doctor's other rules speak of those); a step redone
    after a restart counts once. None without such a report."""
    after = autopilot.get(AT_STEP)
    kept = {int(r["step"]): r for r in history if "interval_s" in r and "samples_per_s" in r
            and after is not None and int(r["step"]) > int(after)}
    samples = sum(r["samples_per_s"] * r["interval_s"] for r in kept.values())
    seconds = sum(r["interval_s"] * sum(r.get(k, 0.0) for k in _STEP_PHASES) for r in kept.values())
    return samples / seconds if seconds > 0 else None


def achieved_figures(autopilot: Mapping[str, Any] | None, history: list[dict[str, Any]]) -> dict[str, float]:
    """The summary table's rows known when the run ends: the achieved samples/s and its ratio to the starting
    configuration's measured samples/s."""
    if autopilot is None:
        return {}
    achieved, start = achieved_samples_per_s(autopilot, history), start_samples_per_s(autopilot)
    figures = {} if achieved is None else {FIGURES + "achieved_samples_per_s": achieved}
    if achieved is not None and start:
        figures[FIGURES + "achieved_speedup"] = achieved / start
    return figures


def gain_line(autopilot: Mapping[str, Any] | None, history: list[dict[str, Any]]) -> str | None:
    """The summary's line on what the autopilot gained over the configuration the user wrote; None for a run
    without it."""
    if autopilot is None:
        return None
    if autopilot.get("skipped"):
        return f"autopilot: skipped ({autopilot['skipped']}): trained with the configuration as written"
    if autopilot.get("from_checkpoint"):
        line = f"autopilot: settings kept from the checkpoint ({_settings(autopilot.get('chosen'))})"
    else:
        start = start_samples_per_s(autopilot)
        chosen = search_figures(autopilot).get(FIGURES + "chosen_samples_per_s")
        measured = (f" ({start:,.0f} -> {chosen:,.0f} samples/s in its search)" if start and chosen else "")
        line = (f"autopilot: {_chosen_name(autopilot)}; {_predicted(autopilot)}{measured}; search "
                f"{_number(autopilot.get('search_s'), '.1f')} s")
    figures = achieved_figures(autopilot, history)
    if FIGURES + "achieved_speedup" in figures:
        line += (f"; achieved {figures[FIGURES + 'achieved_speedup']:.2f}x "
                 f"({figures[FIGURES + 'achieved_samples_per_s']:,.0f} samples/s in training steps after the search)")
    elif FIGURES + "achieved_samples_per_s" in figures:
        line += f"; achieved {figures[FIGURES + 'achieved_samples_per_s']:,.0f} samples/s after the search"
    else:
        line += "; achieved: no report after the search to measure it"
    return line
