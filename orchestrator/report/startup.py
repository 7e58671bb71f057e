"""Where the seconds between the command and the first training step go (driver side).

The driver marks the end of its own stages; the worker's first report brings when rank 0 entered the
worker function, when its loop started and when it had its first batch (`at/*`, epoch seconds: one
clock per machine, and NTP-close across nodes). Each stage is the time since the previous mark. A
stage the driver runs in a thread beside the series (MLflow's run opened while Ray Train starts the
worker group) is not a part of it: the command does not wait for it before the first step (the
reports wait for it instead), and it is shown alongside the part it ended in, at its own duration.
The parts add up to the wall clock.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

# The stages, in order: the driver's, then the worker's.
STAGES = (
    "command",  # Python start and imports, the config read
    "data inspection",  # Parquet schemas, row counts and sample rows, before any cluster resource
    # the run's plan checked before Ray starts: the model built on the meta device against the data
    # (torch imported), the price table, the tracking server, the run's place in storage
    "checks",
    "ray start",  # the local Ray cluster started, or the running one joined
    "datasets",  # Ray Data pipelines built (a small dataset is cached in the object store here)
    # the MLflow run opened and its params logged: beside the worker group's start, in a thread
    "tracking",
    # Ray Train's controller and the workers' processes started, the process group formed
    "worker group",
    "worker set-up",  # model, optimizer and data shards built in the workers; a checkpoint loaded
    "first batch",  # the first batch read, decoded and handed to the loop
)
_WORKER_MARKS = {"worker group": "at/worker", "worker set-up": "at/loop",
                 "first batch": "at/first_batch"}


def process_started_at() -> float:
    """When this process started (epoch seconds): what a stopwatch around the user's command sees.
    On Linux, from the process's start in clock ticks since boot and the boot clock now: the
    kernel's boot time (which psutil adds the start to) is kept in whole seconds, so a start taken
    from it is up to a second early."""
    try:
        with open("/proc/self/stat") as stat:
            # the name may hold spaces and parentheses
            after_name = stat.read().rsplit(")", 1)[1].split()
        since_boot = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        import psutil

        return float(psutil.Process().create_time())


@dataclass
class StartupClock:
    started_at: float = field(default_factory=time.time)  # epoch seconds the command started
    marks: dict[str, float] = field(default_factory=dict)  # stage -> epoch seconds it ended
    # a stage run beside -> (began, ended)
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)

    def mark(self, stage: str) -> None:
        assert stage in STAGES, stage
        self.marks[stage] = time.time()

    def mark_beside(self, stage: str, began: float, ended: float) -> None:
        """A stage run in a thread beside the series, from `began` to `ended` (epoch seconds)."""
        assert stage in STAGES, stage
        self.spans[stage] = (began, ended)

    def since_start(self) -> float:
        return time.time() - self.started_at

    def take_worker_marks(self, report: dict[str, Any]) -> bool:
        """Take the worker's `at/*` timestamps of a report; True when they complete the breakdown
        (the first report of the run; a restart's later ones are not start-up). They stay in the
        report (MLflow leaves `at/*` out): a restart's marks are the timeline of its recovery
        (bench/chaos.py)."""
        at = {key: report[key] for key in report if key.startswith("at/")}
        if "first batch" in self.marks or not all(key in at for key in _WORKER_MARKS.values()):
            return False
        for stage, key in _WORKER_MARKS.items():
            self.marks[stage] = float(at[key])
        return True

    def seconds(self) -> dict[str, float]:
        """Seconds per part of the series, in order; a part's clock starts where the previous one
        ended. Together they are the wall clock to the first step; stages run beside them are in
        `alongside()`."""
        out, previous = {}, self.started_at
        for stage in STAGES:
            if stage in self.marks:  # a stage run beside is never marked
                out[stage] = max(0.0, self.marks[stage] - previous)
                previous = max(previous, self.marks[stage])
        return out

    def alongside(self) -> dict[str, float]:
        """Seconds of each stage run beside the series (its own duration)."""
        return {stage: max(0.0, ended - began) for stage, (began, ended) in self.spans.items()}

    def beside(self) -> dict[str, str]:
        """The part of the series each stage run beside it ended in (the last part, if it ended
        after them all)."""
        parts = [stage for stage in STAGES if stage in self.marks]
        return {stage: next((part for part in parts if self.marks[part] >= ended),
                            parts[-1] if parts else stage)
                for stage, (_, ended) in self.spans.items()}

    def line(self) -> str:
        """'start-up 16.8 s to the first step: command 0.6 s | data inspection 0.3 s | checks 1.5 s
        | ray start 4.0 s | datasets 0.1 s | worker group 9.0 s (tracking 1.5 s alongside) | ... |
        first batch 0.2 s'"""
        seconds, own, beside = self.seconds(), self.alongside(), self.beside()
        parts = [f"{stage} {s:.1f} s" + "".join(f" ({other} {own[other]:.1f} s alongside)"
                                                for other, part in beside.items() if part == stage)
                 for stage, s in seconds.items()]
        return f"start-up {sum(seconds.values()):.1f} s to the first step: " + " | ".join(parts)

    def metrics(self) -> dict[str, float]:
        seconds = self.seconds()
        out = {f"startup/{stage.replace(' ', '_').replace('-', '_')}_s": s
               for stage, s in (seconds | self.alongside()).items()}
        out["startup/total_s"] = sum(seconds.values())
        return out
