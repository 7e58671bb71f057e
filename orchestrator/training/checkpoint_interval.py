"""checkpoint.every=auto: the interval between checkpoints that loses least to interruptions. A
checkpoint blocks training for C seconds; an interruption (a failure, a preemption, a resize, a
Ctrl+C and `--resume`) redoes on average half an interval. Their sum per unit of time is least at
about sqrt(2 x C x MTBF) (Young's approximation), MTBF being the mean time between interruptions.
Clamped: never so often that checkpoints block more than 3% of the time (C / 0.03), never rarer than
checkpoint.every_minutes. Pure arithmetic: the loop (Cadence) decides with it on rank 0, and the
driver's summary line and doctor's checkpoint rule explain a run with the same figures."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_COST_SHARE = 0.03  # of the time between checkpoints, at most, spent blocked in one
# The MTBF assumed while failure.mtbf_minutes is unset and the run has seen no interruption. A fixed
# figure, not the run's seconds so far: those differ between identical runs, and so would their
# intervals.
STAND_IN_MTBF_MINUTES = 60.0


@dataclass(frozen=True)
class AutoInterval:
    """The interval chosen and why: `bound` is "cost" (the 3% floor), "cap"
    (checkpoint.every_minutes) or None (the formula itself)."""

    seconds: float
    cost_s: float
    mtbf_s: float
    bound: str | None

    def why(self) -> str:
        formula = (f"sqrt(2 x {self.cost_s:.2g} s a checkpoint x {self.mtbf_s:,.0f} s "
                   "between interruptions)")
        if self.bound == "cost":
            return (f"{formula} = {young(self.cost_s, self.mtbf_s):.1f} s, raised so checkpoints "
                    f"block at most {MAX_COST_SHARE:.0%} of the time")
        if self.bound == "cap":
            return (f"{formula} = {young(self.cost_s, self.mtbf_s):,.0f} s, "
                    "capped by checkpoint.every_minutes")
        return formula


def young(cost_s: float, mtbf_s: float) -> float:
    """sqrt(2 x C x MTBF): the interval at which checkpoint cost and work redone after interruptions
    sum least."""
    return math.sqrt(2 * cost_s * mtbf_s)


def mtbf_s(run_s: float, interruptions: int, mtbf_minutes: float | None) -> float:
    """The mean time between interruptions: failure.mtbf_minutes when the user knows it (spot
    markets publish it); else, once the run has been interrupted, its training seconds per
    interruption, counting the next one as due now; before that, STAND_IN_MTBF_MINUTES."""
    if mtbf_minutes is not None:
        return mtbf_minutes * 60
    if interruptions == 0:
        return STAND_IN_MTBF_MINUTES * 60
    return run_s / (interruptions + 1)


def mtbf_origin(mtbf: float, interruptions: int, mtbf_minutes: float | None) -> str:
    """`mtbf` (mtbf_s's answer) and where it came from, in the user's terms: `1,800 s:
    failure.mtbf_minutes=30`."""
    if mtbf_minutes is not None:
        return f"{mtbf:,.0f} s: failure.mtbf_minutes={mtbf_minutes:g}"
    if interruptions == 0:
        return f"{mtbf:,.0f} s assumed (none yet): set failure.mtbf_minutes"
    return (f"{mtbf:,.0f} s: the run's {mtbf * (interruptions + 1):,.0f} s of training "
            f"/ ({interruptions} interruption{'s' * (interruptions != 1)} + the next)")


def auto_interval(cost_s: float, mtbf: float, cap_minutes: float | None) -> AutoInterval:
    """The clamped interval, in seconds. The cap (the user's) wins over the cost floor where they
    cross."""
    seconds, bound = young(cost_s, mtbf), None
    if seconds < cost_s / MAX_COST_SHARE:
        seconds, bound = cost_s / MAX_COST_SHARE, "cost"
    if cap_minutes is not None and seconds > cap_minutes * 60:
        seconds, bound = cap_minutes * 60, "cap"
    return AutoInterval(seconds, cost_s, mtbf, bound)
