"""What the driver does with each entry of the run's report channel: rank 0's reports, and the
checkpoints and worker failures Ray Train's controller adds (callbacks.py). Each role is a small
handler; the launch composes them into one `RunReports`, which the channel's consumer thread
(progress.py `ReportConsumer`) calls for every entry."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from orchestrator.report.autopilot import record_autopilot, take_autopilot
from orchestrator.report.progress import ProgressLines, setup_line
from orchestrator.report.startup import StartupClock

if TYPE_CHECKING:
    from orchestrator.tracking.tracker import Tracker


class Record(Protocol):
    """Where the attempt's reports are kept as they come (run/place.py `AttemptLog`)."""

    def save(self, history: list[dict[str, Any]], force: bool = False) -> None: ...


@dataclass
class FailureCounter:
    """The worker failures Ray Train restarted from, each tagged on the run. One that every restart
    would repeat, before the first report on a `private_cluster`, is kept in `doomed`: the main
    thread then stops the run."""

    private_cluster: bool
    times: list[float] = field(default_factory=list)  # seconds from the command's start
    doomed: list[str] = field(default_factory=list)

    def __call__(self, report: dict[str, Any], tracker: Tracker, history: list[dict[str, Any]],
                 at: float) -> None:
        self.times.append(at)
        step = history[-1]["step"] if history else 0
        tracker.set_tags({f"orchestrator.failure.{len(self.times)}": f"after step {step}: "
                                                                     f"{report['error']}"})
        if report.get("repeats") and not history and self.private_cluster:
            self.doomed.append(report["error"]
                               + (f" (at {report['at']})" if report.get("at") else ""))
            return
        print(f"worker {report['rank']} failed: {report['error']} "
              "(restarting from the last checkpoint)",
              file=sys.stderr)


@dataclass
class AutopilotTable:
    """The autopilot's search, shown and tracked once. A restarted worker group sends its choice
    again, kept from the checkpoint: one line then, and the search this driver saw stays the one the
    summary speaks of (`found`)."""

    verbose: bool
    found: dict[str, Any] | None = None

    def __call__(self, autopilot: dict[str, Any], tracker: Tracker, step: int) -> None:
        if self.found is not None and autopilot.get("from_checkpoint"):
            if self.verbose:
                print("autopilot: the restarted workers kept its choice", flush=True)
            return
        self.found = autopilot
        record_autopilot(tracker, autopilot, step, self.verbose)


@dataclass
class Console:
    """What the terminal shows: the workers' setup (once, and again when it changed), the start-up
    line, each report's progress line; `verbose=False` shows none of them."""

    verbose: bool
    lines: ProgressLines
    train_rows: int | None
    setup: dict[str, Any] | None = None  # what the workers said they run, as last shown

    def setup_changed(self, report: dict[str, Any]) -> None:
        if self.verbose and report != self.setup:
            print(setup_line(report, self.train_rows), flush=True)
        self.setup = report

    def show(self, line: str) -> None:
        if self.verbose:
            print(line, flush=True)


def checkpoint_uri(storage_path: str, path: str) -> str:
    """Ray's checkpoint path as the user names it: s3://... for S3 storage (Ray keeps it without the
    scheme)."""
    return f"s3://{path}" if storage_path.startswith("s3://") and "://" not in path else path


def events(previous: dict[str, Any] | None, report: dict[str, Any],
           n: int) -> list[tuple[dict[str, str], str]]:
    """MLflow tags (and a printed line) for what a report reveals: a resized worker group, a drain
    checkpoint."""
    found = []
    world = report.get("world_size")
    if (previous is not None and world is not None
            and previous.get("world_size") not in (None, world)):
        text = f"step {report['step']}: {previous['world_size']} -> {world} workers"
        if "global_batch" in report:
            text += (f", global batch {report['global_batch']} "
                     f"(accumulation {report.get('grad_accum_steps')})")
        found.append(({f"orchestrator.resize.{n}": text}, f"worker group resized at {text}"))
    if report.get("drain_checkpoint"):
        text = f"step {report['step']}: a node is being drained; checkpoint saved"
        found.append(({f"orchestrator.drain.{n}": text}, text))
    return found


@dataclass
class RunReports:
    """Every entry of the run's channel, in order: a committed checkpoint becomes a LoggedModel of
    the run, a worker failure is counted, the workers' setup shown; a report marks the start-up
    clock, shows the autopilot's table, tags what it reveals, is stamped with its arrival (the cost
    ledger's timeline), kept in `history` and the attempt's `record`, tracked and shown. `tracker()`
    waits for MLflow's run; `closed()` says its opening failed (the main thread then ends the run).
    `first_step` runs at each report (the end's warm-up: run/ending.py)."""

    tracker: Callable[[], Tracker]
    closed: Callable[[], bool]
    clock: StartupClock
    history: list[dict[str, Any]]
    record: Record
    console: Console
    storage_path: str
    first_step: Callable[[], None] = lambda: None
    failures: FailureCounter = field(default_factory=lambda: FailureCounter(False))
    autopilot: AutopilotTable = field(default_factory=lambda: AutopilotTable(False))

    def __call__(self, report: dict[str, Any]) -> None:
        if self.closed():
            return
        tracker, history, clock = self.tracker(), self.history, self.clock
        event = report.get("event")
        if event == "checkpoint":  # committed by Ray Train
            tracker.log_checkpoint(report["step"],
                                   checkpoint_uri(self.storage_path, report["path"]))
        elif event == "worker_failure":
            self.failures(report, tracker, history, clock.since_start())
        elif event == "setup":  # before the first step of each (re)start
            self.console.setup_changed(report)
        else:
            self._report(report, tracker)

    def _report(self, report: dict[str, Any], tracker: Tracker) -> None:
        history, clock = self.history, self.clock
        autopilot = take_autopilot(report)  # a dict, never a metric
        if clock.take_worker_marks(report):
            tracker.log_metrics(clock.metrics(), step=report["step"])
            self.console.show(clock.line())
        # its table after the start-up line: the search ran after the first step
        if autopilot is not None:
            self.autopilot(autopilot, tracker, report["step"])
        for tag, line in events(history[-1] if history else None, report, len(history)):
            tracker.set_tags(tag)
            print(line, file=sys.stderr)
        report["elapsed_s"] = clock.since_start()
        history.append(report)
        self.record.save(history)
        tracker.log_metrics(report, step=report["step"])
        if "precision" in report:
            tracker.set_tags({"orchestrator.precision": report["precision"]})
        self.console.show(self.console.lines(report))
        self.first_step()
