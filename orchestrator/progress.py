"""Reports travel from the Ray Train controller to the driver, which prints progress and logs them to MLflow.

Train V2 runs user callbacks inside the controller actor, so the callback only forwards rank 0's metrics through
a Ray queue; printing and MLflow stay in the driver process.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ray.train import UserCallback
from ray.util.queue import Empty, Queue


class ForwardReports(UserCallback):
    """Runs in the controller: puts each report (rank 0's metrics + checkpoint path) on the queue."""

    def __init__(self, queue: Queue) -> None:
        self.queue = queue

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        if metrics:
            self.queue.put({**metrics[0], "checkpoint_path": checkpoint.path if checkpoint else None})

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        rank, exc = next(iter(sorted(worker_exceptions.items())))
        self.queue.put({"event": "worker_failure", "rank": rank, "error": str(exc).strip().splitlines()[-1][:300]})


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def progress_line(report: dict[str, Any], total_steps: int, started: float) -> str:
    """'step 50/300 | loss 0.4120 | lr 2.9e-03 | 12,345 samples/s | data wait 2% | val acc 0.912 | eta 0:00:21'"""
    step = report["step"]
    elapsed = time.monotonic() - started
    eta = elapsed / max(step, 1) * (total_steps - step)
    parts = [
        f"step {step}/{total_steps}",
        f"loss {report['train_loss']:.4f}",
        f"lr {report['lr']:.1e}",
        f"{report['samples_per_s']:,.0f} samples/s",
        f"data wait {report['data_wait_frac']:.0%}",
    ]
    if "val_accuracy" in report:
        parts.append(f"val acc {report['val_accuracy']:.3f}")
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

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

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
