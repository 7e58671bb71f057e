"""Errors that reach the user as one clear line (the CLI prints them and exits non-zero), and where
in the user's code an exception was raised."""

from __future__ import annotations

import re
import sysconfig
import traceback
from pathlib import Path


class UserError(Exception):
    """Something the user can fix: the message names the thing and the fix."""


class ConfigError(UserError):
    """An invalid, unknown or contradictory configuration value."""


_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+)', re.MULTILINE)
_STDLIB = sysconfig.get_paths()["stdlib"]
_PRODUCT = Path(__file__).resolve().parent
# The product's own code around the user's: its loop and data code call into torch's collectives and
# Ray Data, whose errors may be transient. Its models are model code like a user's (a shape error in
# them repeats).
_AROUND = (str(_PRODUCT) + "/", str(_PRODUCT.parent / "pipelines") + "/")
_MODELS = str(_PRODUCT / "models") + "/"


# raised_in_model_code's answer, kept on an exception that leaves a worker
RAISED_AT = "orchestrator_raised_at"


def mark_where_raised(exc: BaseException) -> None:
    """Keep `raised_in_model_code(exc)` on `exc` itself, while its traceback is alive: Ray Train
    hands the driver's callbacks the exception without it (pickled across processes, only its
    attributes go along)."""
    where = raised_in_model_code(exc)
    if where is not None:
        try:
            setattr(exc, RAISED_AT, where)
        # an exception type that takes no attributes: the driver reads its text instead
        except AttributeError:
            pass


def raised_in_model_code(exc: BaseException, users_only: bool = False) -> str | None:
    """'path:line' of the innermost frame outside the libraries (site-packages, the standard
    library) where `exc` was raised, when that frame is the user's code or a model's (the product's
    models included); None where it is the product's loop or data code (any of the product's code,
    `users_only`), or unknown. `exc` may have crossed a process: a worker marked it
    (`mark_where_raised`), or Ray's wrapper kept the traceback's text."""
    if getattr(exc, RAISED_AT, None) and not users_only:
        return str(getattr(exc, RAISED_AT))
    if exc.__traceback__ is not None:
        frames = [(f.filename, f.lineno or 0) for f in traceback.extract_tb(exc.__traceback__)]
    else:
        frames = [(m["path"], int(m["line"])) for m in _FRAME.finditer(str(exc))]
    own = [(path, line) for path, line in frames if not _library(path)]
    if not own:
        return None
    path, line = own[-1]
    if path.startswith(_AROUND) and (users_only or not path.startswith(_MODELS)):
        return None
    return f"{path}:{line}"


def _library(path: str) -> bool:
    return ("site-packages" in path or "dist-packages" in path or path.startswith((_STDLIB, "<")))
