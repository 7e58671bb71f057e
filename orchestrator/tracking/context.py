"""What a run is known by besides its figures: its short MLflow name, MLflow's context tags for where it came from
(the command or script, LOCAL or JOB, the user, the git commit) and its params (the complete resolved config, the
model builder's defaults included, a password in a URI masked)."""

from __future__ import annotations

import functools
import getpass
import hashlib
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


def short_run_name(config: Config, place_name: str) -> str:
    """A run's MLflow name, short enough for the runs table and different between runs in its first 20
    characters: the model, its learning rate and 4 hex digits of the run's directory name (`mlp-lr3e-3-0f2a`). A
    model built by `model.entrypoint` is named by its module (`my_models:build` -> `my_models`): the function's
    name is most often a verb (`build`) that says nothing of the model."""
    entrypoint = config.model.entrypoint
    model = (entrypoint.split(":")[0].split(".")[-1] if entrypoint else config.model.name)[:10]
    tag = hashlib.sha1(place_name.encode()).hexdigest()[:4]
    return f"{model}-lr{compact_number(config.optim.lr)}-{tag}"


def compact_number(value: float) -> str:
    """3e-3, 2.5e-4, 0.05, 1: a number in the fewest characters that keep 2 significant digits."""
    if value != 0 and not 1e-2 <= abs(value) < 1e4:
        mantissa, exponent = f"{value:.1e}".split("e")
        return f"{mantissa.removesuffix('.0')}e{int(exponent)}"
    return f"{value:.2g}"


# Run context: MLflow's own tags for where a run came from (the UI's Source and User columns), set on new runs.


def source_name(argv: list[str] | None = None) -> str:
    """The command (`orchestrator train --config ...`) or, for a run started from Python, the script."""
    argv = sys.argv if argv is None else argv
    if not argv or not argv[0]:
        return "<console>"
    program = Path(argv[0])
    if program.name == "orchestrator" or (program.name == "__main__.py" and program.parent.name == "orchestrator"):
        return mask_password(shlex.join(["orchestrator", *argv[1:]]))[:2000]
    return argv[0]


def source_type(environ: Mapping[str, str] | None = None) -> str:
    """JOB for a Ray job's entrypoint (`ray job submit`, a KubeRay RayJob: Ray gives it its job config), else
    LOCAL."""
    environ = os.environ if environ is None else environ
    return "JOB" if "RAY_JOB_CONFIG_JSON_ENV_VAR" in environ else "LOCAL"


def current_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name (a container user without a passwd entry)
        return "unknown"


@functools.cache
def git_commit(directory: str | None = None) -> str | None:
    """HEAD of the git checkout at `directory` (the working directory), or None: not a checkout, no git."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory or os.getcwd(), capture_output=True,
                              text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and len(commit) >= 40 else None


def context_tags() -> dict[str, str]:
    """`mlflow.source.name`, `mlflow.source.type`, `mlflow.user` and, in a git checkout, `mlflow.source.git.commit`."""
    tags = {"mlflow.source.name": source_name(), "mlflow.source.type": source_type(), "mlflow.user": current_user()}
    commit = git_commit(os.getcwd())
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags


# Params: the complete resolved config.


def model_defaults(model: ModelConfig) -> dict[str, Any]:
    """The builder's own options with their signature defaults (what the model is built with when the config leaves
    them out); {} when the builder cannot be loaded here."""
    import inspect

    try:
        from orchestrator.models import model_builder

        parameters = inspect.signature(model_builder(model.name, model.entrypoint)).parameters.values()
    except Exception:  # a checked config loads its builder; anything else is not worth failing tracking over
        return {}
    return {p.name: list(p.default) if isinstance(p.default, tuple) else p.default for p in parameters
            if p.default is not inspect.Parameter.empty and p.name not in ("in_features", "num_classes", "self")
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}


def config_params(config: Config, study: bool = False) -> dict[str, Any]:
    """The flattened resolved config, defaults included: the model's options from its builder's signature under
    `model.*`, overridden by the config's (an option set to null means the builder's default). Keys left null are
    left out, and so is the `tune` section unless `study` (a study's parent run): the full config is the run's
    `config.yaml`. A password in a URI (tracking.uri) is masked."""
    tree = to_dict(config)
    model = tree["model"]
    defaults = model_defaults(config.model)
    tree["model"] = {**model, **{key: value for key, value in defaults.items() if model.get(key) is None}}
    if not study:
        tree.pop("tune", None)
    return {key: mask_password(value) if isinstance(value, str) else value for key, value in flatten(tree).items()
            if value is not None}
