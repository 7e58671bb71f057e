"""The MLflow UI as the product prints it: where the UI answers (the tracking server, else the local
`orchestrator ui`), the command that opens it, and the URLs of an experiment and of a run, always in
MLflow's training view. The experiments of the runs this process tracked are remembered here (the
tracker records them)."""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from orchestrator.tracking.uri import mask_password, without_userinfo

# `orchestrator ui`'s default (or the next free one): not 5000, which macOS's AirPlay takes
UI_PORT = 5055
_EXPERIMENT_OF: dict[str, str] = {}  # run id -> experiment id, for the runs this process tracked
# MLflow 3 opens an experiment on its GenAI views unless asked for the training ones (the
# experiment's `mlflow.experimentKind` tag does not change that in 3.17): every URL the product
# prints asks.
TRAINING_VIEW = "workflowType=machine_learning"
# The runs table as the product opens it: MLflow shows no metric column until the user picks one. A
# saved view (an experiment tag `mlflow.sharedViewState.<key>`, listed under the table's Views,
# applied when the runs page's URL names its key) is MLflow's way to open it with some. Every
# experiment the product tracks into holds this one; the experiment URLs it prints name it.
RUNS_VIEW_KEY = "orchestrator-runs"
RUNS_VIEW_TAG = f"mlflow.sharedViewState.{RUNS_VIEW_KEY}"
RUNS_VIEW_NAME = "Training runs"
_SOURCE = "attributes.`Source`"
_AFTER = ("attributes.`Duration`", "attributes.`Dataset`", "attributes.`Models`")
# Pixels: a run's name and a command whole (MLflow's default widths show `steps60-digits-mlp-20...`,
# `orchestr...`), a metric's key (`headline/val_accuracy`).
_NAME = "attributes.`Run Name`"
_WIDTHS = {"name": 280, "source": 480, "metric": 170}


def ui_base(uri: str, port: int = UI_PORT) -> str:
    """Where the UI for the store `uri` answers: the tracking server itself (without credentials),
    else the local `orchestrator ui`."""
    return (without_userinfo(uri).rstrip("/") if uri.startswith(("http://", "https://"))
            else f"http://127.0.0.1:{port}")


def ui_command(uri: str, experiment: str | None = None) -> str:
    """The command that opens the MLflow UI on these results, as a new shell runs it: this
    environment's own `orchestrator ui` (its path when the environment is not on PATH), or the
    server's address. No password in it: a store whose URI holds one is named by
    $MLFLOW_TRACKING_URI, which the user exports (README)."""
    if uri.startswith(("http://", "https://")):
        return f"open {ui_base(uri)}"
    shown = mask_password(uri)
    command = f"{orchestrator_program()} ui"
    command += f" --tracking-uri {shlex.quote(uri)}" if shown == uri else ""
    command += f" --experiment {shlex.quote(experiment)}" if experiment else ""
    return (command if shown == uri
            else f"{command}  # with MLFLOW_TRACKING_URI={shown} exported, password filled in")


def orchestrator_program() -> str:
    """`orchestrator` as a new shell finds this installation: its path in this Python's bin
    directory (relative to the working directory when below it), or the bare name where no such
    script exists."""
    program = Path(sys.executable).parent / "orchestrator"
    if not program.is_file():
        return "orchestrator"
    try:
        return str(program.relative_to(Path.cwd()))
    except ValueError:
        return str(program)


def experiment_url(uri: str, experiment_id: str, port: int = UI_PORT, view: bool = True) -> str:
    """The experiment's runs list in the UI, in its training view, opened in the product's runs view
    (`view`: the experiment holds RUNS_VIEW_TAG, as every experiment the product tracked into
    does)."""
    shared = f"&viewStateShareKey={RUNS_VIEW_KEY}" if view else ""
    return f"{ui_base(uri, port)}/#/experiments/{experiment_id}/runs?{TRAINING_VIEW}{shared}"


def runs_view(metrics: Iterable[str], saved: str | None = None) -> str:
    """The runs view (RUNS_VIEW_TAG's value: MLflow's saved-view envelope around the table's state)
    with the metric keys `metrics` as columns after those of the view `saved` (a run of another task
    in the same experiment keeps its metric's column), right after the name and start, then the
    Source widened to show the command; `saved` itself when that is what it holds already."""
    try:
        envelope = json.loads(saved) if saved else {}
        before = [c for c in json.loads(envelope["state"])["selectedColumns"]
                  if c.startswith("metrics.")]
    except (ValueError, KeyError, TypeError):  # none yet, or a view edited by hand: made again
        envelope, before = {}, []
    columns = list(dict.fromkeys([*before, *(f"metrics.`{key}`" for key in metrics)]))
    state = json.dumps({
        "selectedColumns": [*columns, _SOURCE, *_AFTER],
        "columnOrder": [_NAME, "attributes.`Created`", *columns, _SOURCE, *_AFTER],
        "columnWidths": {_NAME: _WIDTHS["name"], _SOURCE: _WIDTHS["source"],
                         **dict.fromkeys(columns, _WIDTHS["metric"])}})
    if saved and envelope.get("state") == state:
        return saved
    now = int(time.time() * 1000)
    return json.dumps({"name": RUNS_VIEW_NAME, "createdAt": envelope.get("createdAt", now),
                       "updatedAt": now, "state": state})


def run_url(uri: str, run_id: str, experiment_id: str | None = None, tab: str = "model-metrics",
            port: int = UI_PORT) -> str | None:
    """The run's page in the MLflow UI, on its `tab` (model-metrics: the charts, headline first;
    overview: the description, params and datasets): on the tracking server for an http(s) URI, else
    on the one `orchestrator ui` starts. None when the run's experiment is unknown (not tracked by
    this process nor given)."""
    experiment_id = experiment_id or _EXPERIMENT_OF.get(run_id)
    if not experiment_id:
        return None
    page = "" if tab == "overview" else f"/{tab}"
    return f"{ui_base(uri, port)}/#/experiments/{experiment_id}/runs/{run_id}{page}?{TRAINING_VIEW}"


def experiment_of(run_id: str) -> str | None:
    """The experiment id of a run this process tracked."""
    return _EXPERIMENT_OF.get(run_id)
