"""When the loop evaluates, checkpoints and reports (worker side): the step number, rank 0's clock,
Ray's drain notice and the user's stop decide, broadcast so that every rank makes the same
collective calls at the same steps."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from orchestrator.config import Config
from orchestrator.training import ranks
from orchestrator.training.checkpoint import Progress
from orchestrator.training.checkpoint_interval import AutoInterval, auto_interval, mtbf_s


@dataclass(frozen=True)
class Notices:
    """What may cut a run short, asked at report steps (rank 0's answer counts): Ray draining a node
    of the run (`preempted`, a barrier: every report until its deadline saves), the user's stop
    (`stop_requested`, Ctrl+C on the driver: the next report saves, and the loop ends there) and a
    newer attempt of the run (`superseded`)."""

    preempted: Callable[[], bool] | None = None
    stop_requested: Callable[[], bool] | None = None
    # A newer attempt of the run claimed it (training/fence.py): this one saves and reports nothing
    # more, and its loop ends. Asked with now=True at a step that saves: a look in storage right
    # before the checkpoint.
    superseded: Callable[..., bool] | None = None


STOP, SUPERSEDED = 1, 2  # rank 0's answer to both, in one broadcast


@dataclass
class Due:
    """What follows a report step: evaluation, and a checkpoint (`drain`: the first for a node going
    away)."""

    eval: bool
    checkpoint: bool
    drain: bool = False
    last: bool = False  # the run's last step


class Cadence:
    """When to evaluate, checkpoint and report. Decided by the step number, rank 0's clock and the
    drain notice (both broadcast), so every rank makes the same collective calls at the same steps.
    checkpoint.every=auto: a report step saves once rank 0's clock has passed the interval of
    checkpoint_interval.py; until a checkpoint's cost is measured, the first report step saves one.
    `progress` carries what that interval is computed from."""

    def __init__(self, cfg: Config, has_val: bool, notices: Notices | None, device: torch.device,
                 progress: Progress, clock: Callable[[], float] = time.monotonic) -> None:
        self.t, self.ckpt, self.mtbf_minutes = cfg.train, cfg.checkpoint, cfg.failure.mtbf_minutes
        notices = notices or Notices()
        self.has_val, self.preempted, self.stop_requested = (has_val, notices.preempted,
                                                             notices.stop_requested)
        self.superseded = notices.superseded
        # stopped: the user's stop saved at a report, or a newer attempt claimed the run; the loop
        # ends there.
        self.device, self.stopped = device, False
        self.progress, self.clock = progress, clock
        self.drain_saved = False
        self.began = self.last_saved = clock()  # for checkpoint.every_minutes and auto
        self.run_s = progress.run_s  # training seconds before this (re)start
        # only then is the clock kept in the progress (not bitwise)
        self.auto = cfg.checkpoint.every == "auto"
        # Every report step is a multiple of this (log_every, eval_every and a fixed
        # checkpoint.every divide it).
        self.every = math.gcd(cfg.train.log_every,
                              *(n for n in (cfg.train.eval_every if has_val else None,
                                            None if self.auto else cfg.checkpoint.every)
                                if isinstance(n, int)))
        # Restarted from a checkpoint: an interruption (failure, resize, --resume), unless the
        # user's own stop saved it (Ctrl+C is no failure: it would shorten the interval for the rest
        # of the run).
        if self.auto and progress.step > 0 and progress.stopped_at != progress.step:
            progress.interruptions += 1

    def at(self, step: int) -> Due | None:
        """What is due after `step`; None when it is not a report step. Called after every step:
        anything that reads a clock, the drain notice or another rank runs at report steps only."""
        if step % self.every and step != self.t.max_steps:
            return None
        last = step == self.t.max_steps
        due = Due(eval=self.has_val and (last or (self.t.eval_every is not None
                                                  and step % self.t.eval_every == 0)),
                  checkpoint=last or (not self.auto
                                      and step % self.ckpt.every == 0),  # type: ignore[operator]
                  last=last)
        if not (due.eval or due.checkpoint or step % self.t.log_every == 0):
            return None
        if self.preempted is not None and ranks.rank0_says(self.preempted(), self.device):
            # A node is going away: every report until its deadline saves, so its loss costs at most
            # one report interval (Ray resumes from the newest). The first is marked as the drain's.
            due.checkpoint, due.drain, self.drain_saved = True, not self.drain_saved, True
        if not due.checkpoint and (self.auto or self.ckpt.every_minutes is not None):
            due.checkpoint = ranks.rank0_says(self._time_to_save(), self.device)
        if self.stop_requested is not None or self.superseded is not None:
            stops = ranks.rank0_int(self._stops(due.checkpoint), self.device)
            if stops & SUPERSEDED:  # nothing more of this attempt lands: no report, no checkpoint
                self.stopped = True
                return None
            if stops & STOP:
                due.checkpoint, self.stopped = True, True
                # saved with the checkpoint: a resume from it is no interruption
                self.progress.stopped_at = step
        if due.checkpoint:
            self.last_saved = self.clock()
            if self.auto:
                self.progress.run_s = self.run_s + self.last_saved - self.began
        return due

    def _stops(self, saving: bool) -> int:
        """This rank's answer to the user's stop and a newer attempt (STOP, SUPERSEDED bits): rank
        0's counts. About to save (`saving`, or the stop makes it save), a newer claim is looked up
        in storage now."""
        stop = self.stop_requested is not None and bool(self.stop_requested())
        superseded = self.superseded is not None and self.superseded(now=saving or stop)
        return STOP * stop + SUPERSEDED * superseded

    def _time_to_save(self) -> bool:
        since = self.clock() - self.last_saved
        if not self.auto:
            return since >= self.ckpt.every_minutes * 60  # type: ignore[operator]
        interval = self.interval()
        return interval is None or since >= interval.seconds

    def interval(self) -> AutoInterval | None:
        """checkpoint.every=auto's interval now (rank 0's figures); None before a checkpoint's cost
        is measured."""
        cost_s = self.progress.checkpoint_cost_s
        if not self.auto or cost_s is None:
            return None
        run_s = self.run_s + self.clock() - self.began
        return auto_interval(cost_s, mtbf_s(run_s, self.progress.interruptions, self.mtbf_minutes),
                             self.ckpt.every_minutes)

    def figures(self) -> dict[str, float]:
        """checkpoint.every=auto's inputs and interval, for the report (MLflow's charts, the
        driver's summary)."""
        interval = self.interval()
        if interval is None:
            return {}
        return {"checkpoint/interval_s": interval.seconds, "checkpoint/cost_s": interval.cost_s,
                "checkpoint/mtbf_s": interval.mtbf_s,
                "checkpoint/interruptions": self.progress.interruptions}
