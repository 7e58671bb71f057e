"""Metrics reach the driver, which prints progress and logs them to MLflow.

Rank 0 puts each interval's metrics on a Ray queue itself (training/reporting.py), and the driver drains it in a
thread while `fit()` blocks. Ray Train's controller adds what only it sees, a worker's failure and a committed
checkpoint, through user callbacks (Train V2 runs those in the controller actor, so the callbacks only forward).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from ray.train import UserCallback
from ray.util.queue import Empty, Queue

from orchestrator.errors import UserError, raised_in_model_code

# Errors in the user's code or config that every restart would raise again (a missing key, a bad option, a
# non-finite loss): not worth a restart when they come before the run's first report. A crash, a network error or a
# collective's RuntimeError may be transient and is retried.
DETERMINISTIC = (TypeError, ValueError, AttributeError, KeyError, IndexError, NameError, ImportError,
                 NotImplementedError, UserError)
# ...and these too when raised in the model's own code (the user's, or the product's models): a shape that does not
# multiply, an assertion, a file the builder cannot find. Never out of memory (a retry may fit), nor a collective's.
IN_MODEL_CODE = (RuntimeError, AssertionError, ArithmeticError, FileNotFoundError, IsADirectoryError,
                 NotADirectoryError, PermissionError)


def repeats(raised: BaseException, where: str | None) -> bool:
    """Whether a failure before the run's first report would fail every restart the same way."""
    if isinstance(raised, DETERMINISTIC):
        return True
    transient = "OutOfMemory" in type(raised).__name__ or type(raised).__name__.startswith("Dist")
    return where is not None and isinstance(raised, IN_MODEL_CODE) and not transient


class ForwardFailures(UserCallback):
    """Runs in the controller: puts each worker failure (the lowest failed rank, its error and whether it is one
    that would repeat) on the queue."""

    def __init__(self, queue: Queue) -> None:
        self.queue = queue

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        rank, exc = next(iter(sorted(worker_exceptions.items())))
        # The training function's own exception (some Ray versions wrap it, keeping it as `_base_exc`).
        raised = getattr(exc, "_base_exc", exc)
        text = (str(exc).strip().splitlines() or [""])[-1]
        name = type(raised).__name__
        error = text if text.startswith(name) else f"{name}: {text}"  # a traceback's last line names it already
        where = raised_in_model_code(exc)
        self.queue.put({"event": "worker_failure", "rank": rank, "error": error[:300], "at": where,
                        "repeats": repeats(raised, where)})


class ForwardCheckpoints(UserCallback):
    """Runs in the controller: puts each checkpoint it committed (registered after every rank's report) on the
    queue, with its step and path in run storage, for the driver to track (checkpoint_models.py)."""

    def __init__(self, queue: Queue) -> None:
        self.queue = queue

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        step = metrics[0].get("step") if metrics and metrics[0] else None
        if checkpoint is not None and isinstance(step, int):
            self.queue.put({"event": "checkpoint", "step": step, "path": checkpoint.path})


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def progress_line(report: dict[str, Any], total_steps: int, global_batch: int, metric: str = "val_accuracy") -> str:
    """'step 50/300 | loss 0.4120 | lr 2.9e-03 | 12,345 samples/s | data wait 2% | val acc 0.912 | eta 0:00:21'
    with the task's headline validation `metric` where the step evaluated. The ETA is the steps left at this
    interval's wall-clock rate."""
    step = report["step"]
    rate = report["samples_per_s"]
    eta = (total_steps - step) * global_batch / rate if rate > 0 else 0.0
    parts = [
        f"step {step}/{total_steps}",
        f"loss {report['train_loss']:.4f}",
        f"lr {report['lr']:.1e}",
        f"{rate:,.0f} samples/s",
        f"data wait {report['data_wait_frac']:.0%}",
    ]
    if metric in report:
        label = "val acc" if metric == "val_accuracy" else metric.replace("_", " ")
        parts.append(f"{label} {report[metric]:.3f}")
    parts.append(f"eta {_duration(eta)}")
    return " | ".join(parts)


class ReportConsumer:
    """Driver thread: drains the queue while `fit()` blocks, calling `handle` for every report."""

    def __init__(self, queue: Queue, handle: Callable[[dict[str, Any]], None]) -> None:
        self.queue = queue
        self.handle = handle
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="orchestrator-reports", daemon=True)

    def __enter__(self) -> ReportConsumer:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._stop.set()
        # After fit() returned, the last reports are drained; after Ctrl+C or an error the command must end now.
        self._thread.join(timeout=30 if exc_type is None else 2)

    def _loop(self) -> None:
        # After stop, keep draining: the last reports may still be in the queue.
        while True:
            try:
                item = self.queue.get(timeout=0.5)
            except Empty:
                if self._stop.is_set():
                    return
                continue
            except Exception:  # queue actor gone (Ray shutting down)
                return
            try:
                self.handle(item)
            except Exception as exc:  # never let display or tracking kill the run
                print(f"warning: could not handle a report: {exc}", file=sys.stderr)
