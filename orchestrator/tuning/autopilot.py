"""One autopilot search for a whole study (`autopilot.enabled` in `orchestrator tune`): the first
trial to start measures the candidates on its own first steps (training/autopilot.py) and every
other trial trains with its choice from its first step, rather than each trial paying a search of
its own. A trial that starts while the search runs waits for its choice (its resources idle for the
search's seconds, at most `autopilot.budget` of one trial's run).

The choice is shared only when the space searches nothing that changes what is fastest (the
autopilot's own keys, the batch, the model, the data, the workers); otherwise each trial searches
its own, and the study says why.

A board (a named Ray actor the driver owns, so it ends with the study) holds who searches and the
choice: trials ask it, the searching trial posts the autopilot's report when it has one, the driver
releases a searcher whose trial ended without posting (stopped by ASHA, failed) so a waiting trial
searches instead, and keeps the report in the study's state so a continued study applies it without
searching again."""

from __future__ import annotations

import time
from typing import Any

from orchestrator.config import Config, with_values
from orchestrator.report.autopilot import record_autopilot
from orchestrator.run.place import RunPlace
from orchestrator.tracking.tracker import Tracker

# Searched keys that change what the autopilot would choose: with one of them, each trial searches
# its own.
_PER_TRIAL_KEYS = {"train.micro_batch_size", "train.grad_accum_steps", "train.global_batch_size",
                   "train.compile", "train.torch_threads", "train.flush_denormal",
                   "train.precision", "train.parallel", "train.sync", "train.tf32"}
_PER_TRIAL_SECTIONS = {"model", "data", "scaling", "autopilot"}
_WAIT_S = 0.5  # how often a waiting trial asks again


def board_name(study: str) -> str:
    return f"orchestrator-autopilot:{study}"


def per_trial_reason(config: Config) -> str | None:
    """Why each trial of this study searches on its own (None: one search serves the study, or no
    autopilot)."""
    if not config.autopilot.enabled:
        return None
    keys = [k for k in config.tune.space
            if k in _PER_TRIAL_KEYS or k.split(".")[0] in _PER_TRIAL_SECTIONS]
    if not keys:
        return None
    return ("each trial searches its own: tune.space searches "
            f"{', '.join(keys)}, which changes what is fastest")


class Board:
    """Who searches and what was chosen (a Ray actor: `open_board`)."""

    def __init__(self, report: dict[str, Any] | None) -> None:
        self.report, self.searcher = report, None

    def ask(self, trial_id: str) -> tuple[str, dict[str, Any] | None]:
        """"apply" with the chosen settings, "search" (this trial measures), or "wait"."""
        if self.report is not None:
            return "apply", self.report["chosen"]
        if self.searcher in (None, trial_id):
            self.searcher = trial_id
            return "search", None
        return "wait", None

    def post(self, trial_id: str, report: dict[str, Any]) -> None:
        if self.report is None and self.searcher == trial_id:
            self.report = report | {"trial_id": trial_id}

    def release(self, trial_id: str) -> None:
        if self.searcher == trial_id:
            self.searcher = None

    def result(self) -> dict[str, Any] | None:
        return self.report


def study_board(config: Config, study: str, saved: dict[str, Any] | None,
                verbose: bool) -> Any | None:
    """The driver's board for the study's one search, holding `saved` (the report a continued study
    kept); None when the autopilot is off or each trial searches its own (said in one line)."""
    import ray

    if not config.autopilot.enabled:
        return None
    reason = per_trial_reason(config)
    if verbose:
        shared = ("one search for the study, in the first trial to start; "
                  "every other trial trains with its choice from its first step")
        print(f"autopilot: {reason or shared}", flush=True)
    if reason:
        return None
    return ray.remote(num_cpus=0)(Board).options(name=board_name(study)).remote(saved)


def record_study_choice(board: Any, place: RunPlace, state_file: str, tracker: Tracker,
                        verbose: bool) -> None:
    """The study's autopilot report, once a trial posted it: its table printed and logged on the
    study's run, and kept in the study's state (`state_file`) for a continued study, which recorded
    it already."""
    import ray

    report, state = ray.get(board.result.remote()), place.read_record(state_file) or {}
    if report is None or "autopilot" in state:
        return
    if verbose:
        print(f"autopilot: searched in trial {report['trial_id']}; "
              "every other trial trained with its choice",
              flush=True)
    record_autopilot(tracker, report, 0, verbose)
    place.write_record(state | {"autopilot": report}, state_file)


def find_board(study: str) -> Any | None:
    """The study's board, from a trial or the driver's callback; None when the study shares no
    search."""
    import ray

    try:
        return ray.get_actor(board_name(study))
    except ValueError:
        return None


def trial_config_with_choice(board: Any, trial_id: str, config: Config) -> tuple[Config, bool]:
    """A trial's config: with the study's choice applied (the autopilot off), or as written and True
    (this trial searches). While another trial searches, waits for its choice."""
    import ray

    while True:
        verdict, chosen = ray.get(board.ask.remote(trial_id))
        if verdict == "search":
            return config, True
        if verdict == "apply":
            return chosen_config(config, chosen), False
        time.sleep(_WAIT_S)


def chosen_config(config: Config, chosen: dict[str, Any]) -> Config:
    """The config that trains with the autopilot's choice from the start: its settings as the
    train.* keys."""
    return with_values(config, {f"train.{key}": value for key, value in chosen.items()}
                       | {"autopilot.enabled": False})


def post_choice(board: Any, trial_id: str, metrics: dict[str, Any]) -> None:
    """The searching trial: hand the autopilot's report to the board once a report carries it."""
    report = metrics.get("autopilot")
    if isinstance(report, dict):
        board.post.remote(trial_id, report)
