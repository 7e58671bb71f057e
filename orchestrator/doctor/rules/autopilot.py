"""Doctor and the autopilot (docs/autopilot.md): `autopilot_gain` reports an autopilot run's
predicted speed-up (its search's measurement) against the one achieved (the training's pace after
the search over the starting configuration's measured pace), from the `autopilot/*` rows of the
run's summary table, with the chosen settings as `--set` flags that train with them without a
search. `measured` and `MEASURES` serve the speed rules whose finding the autopilot settles by
measurement."""

from __future__ import annotations

from orchestrator.config import AutopilotConfig
from orchestrator.doctor.record import LOW, MEDIUM, Finding, RunRecord, batch_split

# Below this share of the predicted speed-up, the achieved one is a finding of its own: the search's
# steps did not see what slowed the training (data waits that grew, evaluation, another load on the
# nodes).
SHORTFALL = 0.9
MEASURES = "`--autopilot` measures this"


def measured(run: RunRecord, key: str) -> bool:
    """Whether the autopilot measured `train.<key>` on this run (its choice is the param
    `autopilot.<key>`)."""
    return run.param(f"autopilot.{key}") is not None


# MLflow's param strings as `--set` values (YAML)
_WORDS = {"None": "null", "True": "true", "False": "false"}


def chosen_settings(run: RunRecord) -> dict[str, str]:
    """The settings the autopilot chose that differ from the run's config, by `train.<key>`, as
    `--set` values (a key left null is not a param). A chosen micro-batch comes with its
    accumulation at the run's global batch (batch_split): a config that pins grad_accum_steps
    refuses one without the other."""
    chosen = {f"train.{key.removeprefix('autopilot.')}": _WORDS.get(value, value)
              for key, value in run.params.items()
              if key.startswith("autopilot.")
              and key.removeprefix("autopilot.") not in AutopilotConfig.model_fields
              # derived from the micro-batch at the global batch
              and key != "autopilot.grad_accum_steps"}
    changed = {key: value for key, value in chosen.items()
               if value != _WORDS.get(run.params.get(key, "None"), run.params.get(key))}
    micro = changed.pop("train.micro_batch_size", "")
    split = batch_split(run, micro=int(micro)) if micro.isdigit() else None
    pairs = [value.partition("=") for value in split.split(" --set ")] if split else []
    batch = ({key: value for key, _, value in pairs}
             or ({"train.micro_batch_size": micro} if micro else {}))
    return {**batch, **changed}


def autopilot_gain(run: RunRecord) -> Finding | None:
    """An autopilot run: the speed-up its search predicted against the one the training achieved."""
    predicted, achieved = (run.last("autopilot/predicted_speedup"),
                           run.last("autopilot/achieved_speedup"))
    if predicted is None and achieved is None:
        return None
    search = run.last("autopilot/search_s")
    parts = [f"predicted {predicted:.2f}x" if predicted is not None
             else "no prediction (kept from the checkpoint)",
             f"achieved {achieved:.2f}x" if achieved is not None
             else "no achieved figure (no report after the search)"]
    title = (f"{parts[0]} over the configuration as written, {parts[1]}"
             + (f"; its search took {search:.1f} s" if search is not None else ""))
    settings = chosen_settings(run)
    changes = (" --set ".join([*(f"{k}={v}" for k, v in settings.items()),
                               "autopilot.enabled=false"])
               + " (the autopilot's choice: trains with it without a search)",) if settings else ()
    if predicted is not None and achieved is not None and achieved < SHORTFALL * predicted:
        return Finding("autopilot", MEDIUM, predicted - achieved,
                       title + ": the training's steps ran slower than the search measured them "
                       "(other load on the nodes, or a search too short for a stable figure: a "
                       "larger autopilot.budget)", changes)
    return Finding("autopilot", LOW, achieved or predicted or 0.0, title, changes)
