"""What a run is known by besides its figures and its name (runs.run_name): MLflow's context tags
for where it came from (the command or script, LOCAL or JOB, the user, the git commit), the keys its
command changed, and its params (the complete resolved config, the model builder's defaults
included, a password in a URI masked)."""

from __future__ import annotations

import functools
import getpass
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.config import flatten, to_dict
from orchestrator.tracking.uri import mask_password

if TYPE_CHECKING:
    from orchestrator.config import Config, ModelConfig

# The command, exact (a password masked): what `orchestrator doctor` completes. MLflow's Source
# holds it too.
COMMAND_TAG = "orchestrator.command"


# Run context: MLflow's own tags for where a run came from (the UI's Source and User columns), set
# on new runs.


def source_name(argv: list[str] | None = None) -> str:
    """The command (`orchestrator train --config ...`, a password in it masked) or, for a run
    started from Python, the script."""
    argv = sys.argv if argv is None else argv
    if not argv or not argv[0]:
        return "<console>"
    if _is_orchestrator(argv):
        return mask_password(shlex.join(["orchestrator", *argv[1:]]))[:2000]
    return argv[0]


def _is_orchestrator(argv: list[str]) -> bool:
    program = Path(argv[0]) if argv and argv[0] else Path()
    return (program.name == "orchestrator"
            or (program.name == "__main__.py" and program.parent.name == "orchestrator"))


def changed_keys(argv: list[str] | None = None) -> list[str]:
    """The config keys an `orchestrator` command's `--set` flags set (`-s`, `--set=`, `-sKEY=...`
    too), and `autopilot.enabled` for `--autopilot`, in order: what its run's name shows
    (runs.run_name). [] for a run started from Python (its script's flags are its own)."""
    argv = sys.argv if argv is None else argv
    if not _is_orchestrator(argv):
        return []
    values: list[str] = []
    args = iter(argv[1:])
    for arg in args:
        if arg in ("--set", "-s"):
            values.append(next(args, ""))
        elif arg.startswith("--set="):
            values.append(arg.removeprefix("--set="))
        elif arg.startswith("-s") and not arg.startswith("--"):  # -sKEY=VALUE
            values.append(arg[2:])
        elif arg == "--autopilot":
            values.append("autopilot.enabled=true")
    return [value.split("=", 1)[0].strip() for value in values if "=" in value]


def source_type(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> str:
    """JOB for an `orchestrator` command (it runs a Ray Train job) and for any Ray job's entrypoint
    (`ray job submit`, a KubeRay RayJob: Ray gives it its job config); LOCAL for a script run by
    hand. MLflow's UI shows a JOB's source whole and a LOCAL one as its text after the last "/" (a
    script's file name): the command's Source would read `runs` for `... --set
    storage.path=/tmp/runs`."""
    argv = sys.argv if argv is None else argv
    environ = os.environ if environ is None else environ
    return "JOB" if _is_orchestrator(argv) or "RAY_JOB_CONFIG_JSON_ENV_VAR" in environ else "LOCAL"


def current_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name (a container user without a passwd entry)
        return "unknown"


@functools.cache
def git_commit(directory: str | None = None) -> str | None:
    """HEAD of the git checkout at `directory` (the working directory), or None: not a checkout, no
    git."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory or os.getcwd(),
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and len(commit) >= 40 else None


def context_tags() -> dict[str, str]:
    """`mlflow.source.name`, `mlflow.source.type`, `mlflow.user`, in a git checkout
    `mlflow.source.git.commit`, and for an `orchestrator` command the command itself
    (COMMAND_TAG)."""
    source = source_name()
    tags = {"mlflow.source.name": source, "mlflow.source.type": source_type(),
            "mlflow.user": current_user()}
    if _is_orchestrator(sys.argv):
        tags[COMMAND_TAG] = source
    commit = git_commit(os.getcwd())
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags


# Params: the complete resolved config.


def model_defaults(model: ModelConfig) -> dict[str, Any]:
    """The builder's own options with their signature defaults (what the model is built with when
    the config leaves them out); {} when the builder cannot be loaded here."""
    import inspect

    try:
        from orchestrator.models.zoo import model_builder

        builder = model_builder(model.name, model.entrypoint)
        parameters = inspect.signature(builder).parameters.values()
    # a checked config loads its builder; anything else is not worth failing tracking over
    except Exception:
        return {}
    return {p.name: list(p.default) if isinstance(p.default, tuple) else p.default
            for p in parameters if p.default is not inspect.Parameter.empty
            and p.name not in ("in_features", "num_classes", "self")
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}


def config_params(config: Config, study: bool = False) -> dict[str, Any]:
    """The flattened resolved config, defaults included: the model's options from its builder's
    signature under `model.*`, overridden by the config's (an option set to null means the builder's
    default). Keys left null are left out, and so is the `tune` section unless `study` (a study's
    parent run): the full config is the run's `config.yaml`. A password in a URI (tracking.uri) is
    masked."""
    tree = to_dict(config)
    model = tree["model"]
    defaults = model_defaults(config.model)
    from_builder = {key: value for key, value in defaults.items() if model.get(key) is None}
    tree["model"] = {**model, **from_builder}
    if not study:
        tree.pop("tune", None)
    return {key: mask_password(value) if isinstance(value, str) else value
            for key, value in flatten(tree).items() if value is not None}
