"""One writer per run, on the driver: the command claims the next attempt of its run before it
trains (training/fence.py), watches for a newer claim while it runs, and refuses the run's writes
from then on: its MLflow run's (through `FencedTracker`, reading a flag) and the run's own records
(looked up in storage right before them). The workers stop themselves (Cadence): no checkpoint of
theirs lands after the newer claim."""

from __future__ import annotations

from orchestrator.errors import UserError
from orchestrator.run.place import RunPlace
from orchestrator.training.fence import Fence, claim_attempt


class SupersededError(UserError):
    """A newer attempt of the run claimed it: this one stops, writing nothing more to the run."""


def claim_run(place: RunPlace) -> Fence:
    """This command's claim on the run at `place`, watched from now on. A claim that lost to one
    made at the same time (the same number, a greater token) is refused at once."""
    fence = Fence(place.storage, place.path, claim_attempt(place.storage, place.path))
    refuse_if_newer(fence, place, now=True)
    return fence.watch()


def refuse_if_newer(fence: Fence | None, place: RunPlace, now: bool = False) -> None:
    """Raise SupersededError, with the one line the attempt says, once a newer attempt claimed the
    run: as the watch last saw it, or looked up in storage `now` (before a write that must not
    land)."""
    if fence is not None and fence(now=now):
        raise SupersededError(fence.line(place.name))
