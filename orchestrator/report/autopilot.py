"""The autopilot's report on the driver (its contract: docs/autopilot.md): rank 0's first report
after the search carries it under "autopilot", a plain dict that is never a metric. Here: taking it
out of the report, the table printed on the terminal, what MLflow keeps of it (the `autopilot.json`
table artifact, the chosen settings as `autopilot.<key>` params, the predicted speed-up and search
seconds as `autopilot/*` rows of the run's summary table) and the line the run's summary prints of
what it did: what it chose with its predicted speed-up over the configuration the user wrote, and
one figure per pace, each named as its line names it: samples/s in training steps (compute and
gradient sync, as the search times them) in the search and after it, beside the throughput line's
samples/s over the training's wall clock."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

from orchestrator.tracking.tracker import Tracker

REPORT_KEY = "autopilot"
TABLE = "autopilot.json"  # MLflow's table format: `columns` and `data` rows
# the chosen settings' params; the config's own keys (autopilot.enabled...) differ
PARAM_PREFIX = "autopilot."
FIGURES = "autopilot/"  # the summary table's section (tracking/view.py)
AT_STEP = "reported_at_step"  # added by the driver: the step of the report that carried it
COLUMNS = ["candidate", "samples_per_s", "ratio", "peak_memory_gb", "compile_s", "loss", "status",
           "chosen"]
# The name of the search's figures and of the training's pace after it, and what such a figure
# counts; the summary's throughput line is the other samples/s, over the training's wall clock.
_IN_STEPS = "samples/s in training steps"
_STEPS_ARE = "compute and gradient sync"
# a column of its own once a candidate that changes the math was measured (autopilot.allow)
_LOSS = "train loss"
# The phases of an interval the search's timed steps measure (a step's forward, backward and
# gradient sync; its batch is at hand): the achieved pace counts these seconds only, so the two
# figures compare like with like.
_STEP_PHASES = ("time/compute_frac", "time/sync_frac")


def take_autopilot(report: dict[str, Any]) -> dict[str, Any] | None:
    """The autopilot's report removed from rank 0's `report` (so it is never charted nor kept in the
    history's figures), with the step it came at; None when the report carries none."""
    found = report.pop(REPORT_KEY, None)
    if not isinstance(found, Mapping):
        return None
    return dict(found) | {AT_STEP: report.get("step")}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(value: Any, form: str) -> str:
    return format(value, form) if _is_number(value) else "-"


def rate(value: float) -> str:
    """A samples/s figure as every autopilot line writes it (the progress and throughput lines'
    form)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _settings(settings: Mapping[str, Any] | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (settings or {}).items()) or "(none)"


def _kept(autopilot: Mapping[str, Any]) -> bool:
    return bool(autopilot.get("start")) and autopilot.get("chosen") == autopilot.get("start")


def _chosen_name(autopilot: Mapping[str, Any]) -> str:
    """'chose <the chosen candidate's one-line name, else its settings written out>', or that it
    kept the configuration as written (no candidate beat it by the noise margin)."""
    if _kept(autopilot):
        return "kept the configuration as written (no candidate beat it)"
    row = next((r for r in autopilot.get("rows") or [] if r.get("chosen")), None)
    return "chose " + (str(row["candidate"]) if row else _settings(autopilot.get("chosen")))


# A column of the terminal's table: its heading, and its cell of a candidate's row.
_Column = tuple[str, Callable[[Mapping[str, Any]], str]]


def _columns(measured: list[Mapping[str, Any]], mark: str) -> list[_Column]:
    """The table's columns, heading and cell: peak memory and compile seconds only where a measured
    candidate has the figure, the training loss only where one changes the math (its loss may then
    differ)."""
    columns: list[_Column] = [
        ("candidate", lambda r: str(r.get("candidate"))),
        ("samples/s",
         lambda r: rate(r["samples_per_s"]) if _is_number(r.get("samples_per_s")) else "-"),
        ("vs start",
         lambda r: _number(r.get("ratio"), ".2f") + ("x" if _is_number(r.get("ratio")) else ""))]
    if _has_peak(measured):
        columns.append(("peak memory", lambda r: _number(r.get("peak_memory_gb"), ".2f")
                        + (" GB" if _is_number(r.get("peak_memory_gb")) else "")))
    if _has_compile(measured):
        columns.append(("compile s", lambda r: _number(r.get("compile_s"), ".1f")))
    columns.append(("chosen", lambda r: mark if r.get("chosen") else ""))
    # The loss where a candidate changes the math: another sync, or TF32 flipped.
    if (any((r.get("settings") or {}).get("sync", "ddp") != "ddp" for r in measured)
            or len({bool((r.get("settings") or {}).get("tf32")) for r in measured}) > 1):
        columns.append((_LOSS, lambda r: _number(r.get("loss"), ".4f")))
    return columns


def _has_peak(measured: list[Mapping[str, Any]]) -> bool:
    return any(_is_number(r.get("peak_memory_gb")) and r["peak_memory_gb"] > 0 for r in measured)


def _has_compile(measured: list[Mapping[str, Any]]) -> bool:
    return any(_is_number(r.get("compile_s")) for r in measured)


def _not_shown(autopilot: Mapping[str, Any], measured: list[Mapping[str, Any]]) -> str | None:
    """The line that says which of the table's columns are left out, and why (they would be
    empty)."""
    why = [] if _has_peak(measured) else ["peak memory (measured on GPUs only)"]
    if not _has_compile(measured):
        why.append(f"compile s ({_no_compile(autopilot)})")
    return f"autopilot: columns left out: {'; '.join(why)}" if why else None


def _no_compile(autopilot: Mapping[str, Any]) -> str:
    """Why no measured candidate has compile seconds."""
    if any((r.get("settings") or {}).get("compile") for r in autopilot.get("rows") or []):
        return "no candidate with torch.compile was measured"
    from orchestrator.training.autopilot import COMPILE_GUESS_S

    budget = autopilot.get("budget_s")
    if _is_number(budget) and budget < COMPILE_GUESS_S:
        return ("torch.compile not tried: a compile, assumed to take "
                f"{COMPILE_GUESS_S:.0f} s, does not fit the search's {budget:.2g} s budget")
    return "torch.compile not tried in this search"


def table_lines(autopilot: Mapping[str, Any], mark: str = "✓") -> list[str]:
    """The terminal's table: its heading (what its samples/s are), one line per measured candidate
    (samples/s in training steps, ratio to the starting config, peak memory and compile seconds
    where measured, `mark` on the chosen one), which columns are left out and why, a line per failed
    candidate, and one closing line (what was chosen and predicted, or why nothing was searched)."""
    if autopilot.get("from_checkpoint"):
        return ["autopilot: kept from the checkpoint, nothing "
                f"searched: {_settings(autopilot.get('chosen'))}"]
    rows = list(autopilot.get("rows") or [])
    measured = [r for r in rows if r.get("status", "ok") == "ok"]
    columns = _columns(measured, mark)
    cells = ([[heading for heading, _ in columns]]
             + [[cell(r) for _, cell in columns] for r in measured])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = []
    if measured:
        lines.append(f"autopilot: candidates measured on the run's own steps, {_IN_STEPS} "
                     f"({_STEPS_ARE}; the progress lines' samples/s also count data waits)")
        lines += [("  " + "  ".join(c[0].ljust(widths[0]) if i == 0 else c[i].rjust(widths[i])
                                    for i in range(len(c)))).rstrip() for c in cells]
        hidden = _not_shown(autopilot, measured)
        lines += [hidden] if hidden else []
    # failed on a rank (dropped on all), or not measured (the budget ran out in its warm-up)
    for r in rows:
        status = str(r.get("status", "ok"))
        if status.startswith("failed"):
            lines.append(f"autopilot: dropped {r.get('candidate')}: "
                         f"{status.removeprefix('failed: ')}")
        elif status != "ok":
            lines.append(f"autopilot: not measured {r.get('candidate')}: {status}")
    if autopilot.get("skipped"):
        lines.append(f"autopilot: skipped ({autopilot['skipped']}): "
                     "training with the configuration as written")
    else:
        lines.append(f"autopilot: {_decision(autopilot)}; search "
                     f"{_number(autopilot.get('search_s'), '.1f')} s over "
                     f"{autopilot.get('search_steps', '-')} steps of the run")
    return lines


def _decision(autopilot: Mapping[str, Any]) -> str:
    """What the search chose, with its predicted speed-up (none for the configuration as written: it
    is 1)."""
    return _chosen_name(autopilot) + ("" if _kept(autopilot) else f", {_predicted(autopilot)}")


def _predicted(autopilot: Mapping[str, Any]) -> str:
    speedup = autopilot.get("predicted_speedup")
    return ("predicted speed-up unknown" if not _is_number(speedup)
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
    """The MLflow table's columns and rows: one per candidate, failed ones included, with its status
    (a figure that is not finite is left empty: JSON has no NaN)."""
    def cell(value: Any) -> Any:
        return None if isinstance(value, float) and not math.isfinite(value) else value

    rows = [[cell(r.get(c)) for c in COLUMNS] for r in autopilot.get("rows") or []]
    return list(COLUMNS), rows


def record_autopilot(tracker: Tracker, autopilot: Mapping[str, Any], step: int,
                     verbose: bool) -> None:
    """The autopilot's report shown (`verbose`) and tracked: the table artifact (when candidates
    were measured), the chosen settings as params, the search's figures in the summary table."""
    if verbose:
        print_table(autopilot)
    if autopilot.get("rows"):
        tracker.log_table(TABLE, *table(autopilot))
    tracker.log_params(params(autopilot))
    tracker.log_metrics(search_figures(autopilot), step=step)


def params(autopilot: Mapping[str, Any]) -> dict[str, Any]:
    """The settings the run trains with as `autopilot.<key>` params (MLflow params never change: the
    run's config params keep the values the user wrote under their own keys)."""
    return {PARAM_PREFIX + str(k): v for k, v in (autopilot.get("chosen") or {}).items()}


def start_samples_per_s(autopilot: Mapping[str, Any]) -> float | None:
    """The starting configuration's measured samples/s: its row's, else the chosen row's over the
    predicted speed-up, else (a choice kept from the checkpoint) what the search measured of it."""
    rows = [r for r in autopilot.get("rows") or [] if r.get("status", "ok") == "ok"
            and isinstance(r.get("samples_per_s"), int | float)]
    start = next((r for r in rows
                  if autopilot.get("start") and r.get("settings") == autopilot.get("start")), None)
    if start is not None:
        return float(start["samples_per_s"])
    chosen, speedup = (next((r for r in rows if r.get("chosen")), None),
                       autopilot.get("predicted_speedup"))
    if chosen is not None and isinstance(speedup, int | float) and speedup > 0:
        return float(chosen["samples_per_s"]) / speedup
    kept = autopilot.get("start_samples_per_s")
    return (float(kept) if isinstance(kept, int | float) and math.isfinite(kept) and kept > 0
            else None)


def search_figures(autopilot: Mapping[str, Any]) -> dict[str, float]:
    """The summary table's rows known once the search has ended: predicted speed-up, search seconds
    and steps, the budget in seconds and what of it the candidates spent, the starting and chosen
    configurations' measured samples/s, candidates measured and not."""
    rows = list(autopilot.get("rows") or [])
    chosen = next((r for r in rows if r.get("chosen")), {})
    figures = {"predicted_speedup": autopilot.get("predicted_speedup"),
               "search_s": autopilot.get("search_s"),
               "search_steps": autopilot.get("search_steps"),
               "start_samples_per_s": start_samples_per_s(autopilot),
               "chosen_samples_per_s": chosen.get("samples_per_s"),
               "candidates": sum(r.get("status", "ok") == "ok" for r in rows),
               "dropped": sum(r.get("status", "ok") != "ok" for r in rows),
               "budget_s": autopilot.get("budget_s"),
               "budget_spent_s": autopilot.get("budget_spent_s"),
               "skipped": float(bool(autopilot.get("skipped"))),
               "from_checkpoint": float(bool(autopilot.get("from_checkpoint")))}
    return {FIGURES + k: float(v) for k, v in figures.items() if isinstance(v, int | float)}


def achieved_samples_per_s(autopilot: Mapping[str, Any],
                           history: list[dict[str, Any]]) -> float | None:
    """The training's pace after the search: the samples of every report after the one that carried
    the autopilot's, over those intervals' seconds in training steps (compute and gradient sync,
    what the search times; data waits, evaluation, checkpoints and reports left out: doctor's other
    rules speak of those); a step redone after a restart counts once. None without such a report."""
    after = autopilot.get(AT_STEP)
    kept = {int(r["step"]): r for r in history if "interval_s" in r and "samples_per_s" in r
            and after is not None and int(r["step"]) > int(after)}
    samples = sum(r["samples_per_s"] * r["interval_s"] for r in kept.values())
    seconds = sum(r["interval_s"] * sum(r.get(k, 0.0) for k in _STEP_PHASES) for r in kept.values())
    return samples / seconds if seconds > 0 else None


def achieved_figures(autopilot: Mapping[str, Any] | None,
                     history: list[dict[str, Any]]) -> dict[str, float]:
    """The summary table's rows known when the run ends: the achieved samples/s and its ratio to the
    starting configuration's measured samples/s."""
    if autopilot is None:
        return {}
    achieved, start = achieved_samples_per_s(autopilot, history), start_samples_per_s(autopilot)
    figures = {} if achieved is None else {FIGURES + "achieved_samples_per_s": achieved}
    if achieved is not None and start:
        figures[FIGURES + "achieved_speedup"] = achieved / start
    return figures


def gain_line(autopilot: Mapping[str, Any] | None, history: list[dict[str, Any]]) -> str | None:
    """The summary's line of what the autopilot did: what it chose (with its predicted speed-up over
    the configuration as written), the samples/s in training steps it measured in its search (the
    configuration as written's, then the chosen one's) and the training's after it, and what sets
    them apart from the throughput line's samples/s over the wall clock. None for a run without the
    autopilot."""
    if autopilot is None:
        return None
    if autopilot.get("skipped"):
        return (f"autopilot: skipped ({autopilot['skipped']}): trained with the configuration "
                "as written")
    achieved = achieved_samples_per_s(autopilot, history)
    if autopilot.get("from_checkpoint"):
        head = ("autopilot: settings kept from the checkpoint "
                f"({_settings(autopilot.get('chosen'))})")
        head += (f", {_predicted(autopilot)}" if _is_number(autopilot.get("predicted_speedup"))
                 else "")
        paces, tail = (f"{rate(achieved)} since the resume" if achieved is not None
                       else "not measured since the resume (no report after the first)"), ""
    else:
        start, chosen = (start_samples_per_s(autopilot),
                         search_figures(autopilot).get(FIGURES + "chosen_samples_per_s"))
        searched = ([] if not (start and chosen)
                    else [start] if _kept(autopilot) else [start, chosen])
        head, tail = (f"autopilot: {_decision(autopilot)}",
                      f"; search {_number(autopilot.get('search_s'), '.1f')} s")
        after = "after it" if searched else "after the search"
        paces = (" -> ".join(map(rate, searched)) + " in the search, " if searched else "") + (
            f"{rate(achieved)} {after}" if achieved is not None
            else f"none measured {after} (no report followed)")
    return (f"{head}; {_IN_STEPS}: {paces} ({_STEPS_ARE}; the throughput over the training's "
            f"wall clock also counts data waits, evaluation and checkpoints){tail}")
