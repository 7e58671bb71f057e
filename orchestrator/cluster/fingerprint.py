"""What a warm cluster must share with a command that joins it (cluster/warm.py): Ray, Python, the
working directory, PYTHONPATH, the auth mode, the listening address and the environment its workers
inherit, compared as digests (the warm cluster's state file holds no secret)."""

from __future__ import annotations

import hashlib
import os
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

LISTENS = "127.0.0.1"  # where every server of the warm cluster listens (warm.start)


# Variables of a shell or terminal session, those compared on their own (PYTHONPATH, RAY_AUTH_MODE)
# and those Ray or the product set in a driver, which say nothing of what a Ray worker computes:
# commands that differ only in these share a warm cluster. Every other variable must match.
SESSION_VARIABLES = frozenset({
    "_", "PWD", "OLDPWD", "SHLVL", "COLUMNS", "LINES", "TERM", "COLORTERM", "PS1", "PS2",
    "PROMPT_COMMAND", "LS_COLORS", "DISPLAY", "WINDOWID", "TMUX", "TMUX_PANE", "STY", "WINDOW",
    "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "MAKE_TERMOUT", "MAKE_TERMERR",
    "HISTFILE", "HISTSIZE", "HISTCONTROL",
    "PYTHONPATH", "RAY_AUTH_MODE", "RAY_API_SERVER_ADDRESS", "PYTHONBREAKPOINT",
})
SESSION_PREFIXES = ("SSH_", "TERM_", "XDG_SESSION_", "PYTEST_")
# What the workers read, write and run on (S3's, MLflow's and the Hugging Face Hub's credentials and
# endpoints; the GPUs): compared as they are in the command's process now, so that a notebook that
# changes one between two runs gets a cluster started with it. Passing them in each job's
# runtime_env instead would have Ray's runtime-env agent log them in clear. The MLflow settings the
# product sets in itself are set again by every tracking process.
LIVE_PREFIXES = ("AWS_", "MLFLOW_", "HF_", "CUDA_VISIBLE_DEVICES")


def start_environment() -> dict[str, str]:
    """The environment this process was started with (on Linux): what the user's shell gave the
    command, not what the product or a library set in it since (a run's temporary files, Ray's
    driver settings), so the same for every command run from the same shell, and for every run of
    one notebook."""
    try:
        raw = Path(f"/proc/{os.getpid()}/environ").read_bytes()
    except OSError:
        return dict(os.environ)
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {name.decode(errors="replace"): value.decode(errors="replace") for name, value in pairs}


def command_environment() -> dict[str, str]:
    """start_environment(), with the LIVE_PREFIXES variables as they are in this process now."""
    from orchestrator.tracking.client import PROCESS_SETTINGS

    def live(name: str) -> bool:
        return name.startswith(LIVE_PREFIXES) and name not in PROCESS_SETTINGS

    return ({k: v for k, v in start_environment().items() if not live(k)}
            | {k: v for k, v in os.environ.items() if live(k)})


def fingerprint(pythonpath: str, auth_mode: str,
                environment: dict[str, str] | None = None) -> dict[str, Any]:
    """What a warm cluster must share with the command that joins it: its workers import the user's
    modules from the working directory and PYTHONPATH, with this Python and Ray, and inherit the
    environment it was started in (`environment`, by default `command_environment()`; each variable
    kept as a digest: the state file holds no secret)."""
    given = command_environment() if environment is None else environment
    env = {name: hashlib.sha256(value.encode()).hexdigest()[:16]
           for name, value in sorted(given.items())
           if name not in SESSION_VARIABLES and not name.startswith(SESSION_PREFIXES)}
    return {"ray": version("ray"), "python": sys.executable, "cwd": os.getcwd(),
            "pythonpath": pythonpath, "auth_mode": auth_mode, "env": env, "listens": LISTENS}
