"""Ray Train's user callbacks: what only the controller sees, a worker's failure and a committed
checkpoint, sent to the run's report channel beside rank 0's metrics (progress.py drains it). Train
V2 runs them in the controller actor, so they only forward. Imported where the trainer is built: Ray
Train is no part of the command's own start."""

from __future__ import annotations

from typing import Any

from ray.train import UserCallback

from orchestrator.errors import UserError, raised_in_model_code
from orchestrator.training.channel import ChannelSender

# Errors in the user's code or config that every restart would raise again (a missing key, a bad
# option, a non-finite loss): not worth a restart when they come before the run's first report. A
# crash, a network error or a collective's RuntimeError may be transient and is retried.
DETERMINISTIC = (TypeError, ValueError, AttributeError, KeyError, IndexError, NameError,
                 ImportError, NotImplementedError, UserError)
# ...and these too when raised in the model's own code (the user's, or the product's models): a
# shape that does not multiply, an assertion, a file the builder cannot find. Never out of memory (a
# retry may fit), nor a collective's.
IN_MODEL_CODE = (RuntimeError, AssertionError, ArithmeticError, FileNotFoundError,
                 IsADirectoryError, NotADirectoryError, PermissionError)


def repeats(raised: BaseException, where: str | None) -> bool:
    """Whether a failure before the run's first report would fail every restart the same way."""
    if isinstance(raised, DETERMINISTIC):
        return True
    transient = "OutOfMemory" in type(raised).__name__ or type(raised).__name__.startswith("Dist")
    return where is not None and isinstance(raised, IN_MODEL_CODE) and not transient


def forward(reports: ChannelSender, event: dict[str, Any]) -> None:
    """Send `event` to the driver. A driver that is gone (Ctrl+C, a lost node) is not the
    controller's failure: an error raised in a callback would end the run that the checkpoints still
    serve."""
    try:
        reports.put(event)
    except (OSError, EOFError):
        pass


class ForwardFailures(UserCallback):
    """Runs in the controller: sends each worker failure (the lowest failed rank, its error and
    whether it is one that would repeat) to the driver."""

    def __init__(self, reports: ChannelSender) -> None:
        self.reports = reports

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        rank, exc = next(iter(sorted(worker_exceptions.items())))
        # The training function's own exception (some Ray versions wrap it, keeping it as
        # `_base_exc`).
        raised = getattr(exc, "_base_exc", exc)
        text = (str(exc).strip().splitlines() or [""])[-1]
        name = type(raised).__name__
        # a traceback's last line names it already
        error = text if text.startswith(name) else f"{name}: {text}"
        # marked by the worker, or in Ray's text
        where = raised_in_model_code(raised) or raised_in_model_code(exc)
        forward(self.reports, {"event": "worker_failure", "rank": rank, "error": error[:300],
                               "at": where, "repeats": repeats(raised, where)})


class ForwardCheckpoints(UserCallback):
    """Runs in the controller: sends each checkpoint it committed (registered after every rank's
    report), with its step and path in run storage, to the driver to track
    (tracking/checkpoint_models.py)."""

    def __init__(self, reports: ChannelSender) -> None:
        self.reports = reports

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]],
                     checkpoint: Any) -> None:
        step = metrics[0].get("step") if metrics and metrics[0] else None
        if checkpoint is not None and isinstance(step, int):
            forward(self.reports, {"event": "checkpoint", "step": step, "path": checkpoint.path})
