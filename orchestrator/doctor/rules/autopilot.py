"""Doctor and the autopilot (docs/autopilot.md): `autopilot_gain` reports an autopilot run's predicted speed-up (its
search's measurement) against the one achieved (the training's pace after the search over the starting
configuration's measured pace), from the `autopilot/*` rows of the run's summary table, with the chosen settings as
`--set` flags that train with them without a search. `measured` and `MEASURES` serve the speed rules whose finding
the autopilot settles by measurement."""

from __future__ import annotations

from orchestrator.config import AutopilotConfig
from orchestrator.doctor.record import LOW, MEDIUM, Finding, RunRecord

# Below this share of the predicted speed-up, the achieved one is a finding of its own: the search's steps did not
# see what slowed the training (data waits that grew, evaluation, another load on the nodes).
SHORTFALL = 0.9
MEASURES = "`--autopilot` measures this"


def measured(run: RunRecord, key: str) -> bool:
    """Whether the autopilot measured `train.<key>` on this run (its choice is the param `autopilot.<key>`)."""
    return run.param(f"autopilot.{key}") is not None


def chosen_settings(run: RunRecord) -> dict[str, str]:
    """The settings the autopilot chose, by `train.<key>`, as `--set` values (YAML: null, true, false)."""
    words = {"None": "null", "True": "true", "False": "false"}
    return {f"train.{key.removeprefix('autopilot.')}": words.get(value, value) for key, value in run.params.items()
            if key.startswith("autopilot.") and key.removeprefix("autopilot.") not in AutopilotConfig.model_fields
            and key != "autopilot.grad_accum_steps"}  # derived from the micro-batch at the global batch


def autopilot_gain(run: RunRecord) -> Finding | None:
    """An autopilot run: the speed-up its search predicted against the one the training achieved."""
    predicted, achieved = run.last("autopilot/predicted_speedup"), run.last("autopilot/achieved_speedup")
    if predicted is None and achieved is None:
        return None
    search = run.last("autopilot/search_s")
    parts = [f"predicted {predicted:.2f}x" if predicted is not None else "no prediction (kept from the checkpoint)",
             f"achieved {achieved:.2f}x" if achieved is not None else "no achieved figure (no report after the "
             "search)"]
    title = (f"autopilot: {parts[0]} over the configuration as written, {parts[1]}"
             + (f"; its search took {search:.1f} s" if search is not None else ""))
    settings = chosen_settings(run)
    changes = (" --set ".join(f"{k}={v}" for k, v in settings.items()) + " (the autopilot's choice: trains with it "
               "without a search)",) if settings else ()
    if predicted is not None and achieved is not None and achieved < SHORTFALL * predicted:
        return Finding("autopilot", MEDIUM, predicted - achieved, title + ": the training's steps were slower than "
                       "the search's (data waits, evaluation or other load the search did not see)", changes)
    return Finding("autopilot", LOW, achieved or predicted or 0.0, title, changes)
