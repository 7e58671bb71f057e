"""Metrics reach the driver, which prints progress and logs them to MLflow.

Rank 0 sends each interval's metrics to the driver itself (training/reporting.py, over
training/channel.py), and the driver hands them on in a thread while `fit()` blocks. Ray Train's
controller adds what only it sees, a worker's failure and a committed checkpoint, through user
callbacks (callbacks.py).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.training.channel import ReportChannel

SMOOTHING = 0.3  # the newest interval's weight in the progress line's averages (tqdm's default)


class _Average:
    """tqdm's smoothed average: exponential, SMOOTHING on the newest value, its start-up bias
    divided out (the first value is the average, not 30% of it)."""

    def __init__(self) -> None:
        self.sum, self.count = 0.0, 0

    def add(self, value: float) -> None:
        self.sum = SMOOTHING * value + (1 - SMOOTHING) * self.sum
        self.count += 1

    @property
    def value(self) -> float:
        return self.sum / (1 - (1 - SMOOTHING) ** self.count) if self.count else 0.0


def _duration(seconds: float) -> str:
    # to the nearest second: cutting the fraction off would read early
    seconds = round(max(0.0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _evals_after(step: int, total: int, every: int | None) -> int:
    """Validation passes after `step`: every `every` steps and at the last (training/cadence.py)."""
    if every is None or step >= total:
        return 0
    return total // every - step // every + (1 if total % every else 0)


class ProgressLines:
    """The driver's line per report: 'step 100/300 | loss 0.0789 | lr 2.4e-03 | 15,900 samples/s |
    data wait 1% | val acc 0.980 (eval 0.2 s) | eta 0:00:03', with the task's headline validation
    `metric` where the step evaluated.

    samples/s is training's pace (evaluation, checkpoint and report time taken out: the loop's
    `train_samples_per_s`), smoothed over the reports as tqdm smooths its rate. The ETA is the wall
    clock left: the steps left at the smoothed training seconds per step, plus the checkpoint and
    report seconds per step so far, plus the evaluations left (`eval_every`: None without validation
    data) at their smoothed seconds. Before the first evaluation its cost is unknown, and the ETA
    says how many it leaves out ('eta 0:00:02 + 3 evals')."""

    def __init__(self, total_steps: int, global_batch: int, eval_every: int | None,
                 metric: str = "val_accuracy") -> None:
        self.total, self.batch = total_steps, global_batch
        self.eval_every, self.metric = eval_every, metric
        self.step_s, self.eval_s = _Average(), _Average()
        # checkpoint and report seconds, and the steps they were spread over
        self.aside_s = self.steps = 0.0

    def __call__(self, report: dict[str, Any]) -> str:
        step, wall = report["step"], report["interval_s"]
        pace = report.get("train_samples_per_s", report["samples_per_s"])
        samples = report["samples_per_s"] * wall
        self.step_s.add(self.batch / pace)
        evaluated = report.get("eval_s")
        if evaluated is not None:
            self.eval_s.add(evaluated)
        self.aside_s += max(0.0, wall - samples / pace - (evaluated or 0.0))
        self.steps += samples / self.batch
        evals = _evals_after(step, self.total, self.eval_every)
        per_step = self.step_s.value + self.aside_s / max(self.steps, 1.0)
        eta = (self.total - step) * per_step + evals * self.eval_s.value
        parts = [
            f"step {step}/{self.total}",
            f"loss {report['train_loss']:.4f}",
            f"lr {report['lr']:.1e}",
            f"{self.batch / self.step_s.value:,.0f} samples/s",
            f"data wait {report['data_wait_frac']:.0%}",
        ]
        if self.metric in report:
            label = "val acc" if self.metric == "val_accuracy" else self.metric.replace("_", " ")
            took = f" (eval {evaluated:.1f} s)" if evaluated is not None else ""
            parts.append(f"{label} {report[self.metric]:.3f}{took}")
        unknown = f" + {evals} evals" if evals and not self.eval_s.count else ""
        parts.append(f"eta {_duration(eta)}{unknown}")
        return " | ".join(parts)


def setup_line(facts: dict[str, Any], train_rows: int | None) -> str:
    """'run: 85,002 params | fp32 | 2 x cpu | micro-batch 64 per device x accumulation 1 x 2 devices
    = global batch 128 | 300 steps, about 26.7 epochs of 1,438 rows': what the workers' rank 0 said
    it runs before its first step (training/worker.py `what_runs`); the epochs from the training
    split's rows."""
    steps = f"{facts['max_steps']:,} steps"
    if facts.get("from_step"):
        steps += f" from step {facts['from_step']:,}"
    if train_rows:
        epochs = facts["max_steps"] * facts["global_batch"] / train_rows
        steps += f", about {epochs:,.1f} epochs of {train_rows:,} rows"
    return " | ".join([
        f"run: {facts['params']:,} params", facts["precision"], f"{facts['workers']} "
                                                                f"x {facts['device']}",
        f"micro-batch {facts['micro_batch']} per device x accumulation {facts['grad_accum_steps']} "
        f"x {facts['workers']} devices = global batch {facts['global_batch']:,}", steps])


class ReportConsumer:
    """Driver thread: hands every item of the run's channel to `handle` while `fit()` blocks. It
    waits on the channel without polling; leaving closes the channel, whose end mark comes after
    every item sent until then."""

    def __init__(self, channel: ReportChannel, handle: Callable[[dict[str, Any]], None]) -> None:
        self.channel = channel
        self.handle = handle
        self._thread = threading.Thread(target=self._loop, name="orchestrator-reports", daemon=True)

    def __enter__(self) -> ReportConsumer:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.channel.close()
        # After fit() returned, the last reports are handled; after Ctrl+C or an error the command
        # must end now.
        self._thread.join(timeout=30 if exc_type is None else 2)

    def _loop(self) -> None:
        while (item := self.channel.get()) is not self.channel.END:
            try:
                self.handle(item)
            except Exception as exc:  # never let display or tracking kill the run
                print(f"warning: could not handle a report: {exc}", file=sys.stderr)
