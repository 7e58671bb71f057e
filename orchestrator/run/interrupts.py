"""The fit in a thread, and how it ends early: the user's Ctrl+C (the workers save at their next
report first), an error every restart would repeat (a model bug on the first attempt), MLflow's run
that could not be opened."""

from __future__ import annotations

import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from orchestrator.run.alongside import Alongside
from orchestrator.run.place import RunPlace
from orchestrator.training.stop import STOP_FILE


class Doomed(Exception):
    """A worker raised an error that a restart would raise again, before the run's first report."""


def fit_interruptibly(trainer: Any, doomed: list[str], opening: Alongside,
                      stop: Callable[[], float]) -> Any:
    """`trainer.fit()` in a thread, so that Ctrl+C reaches this (main) thread as KeyboardInterrupt,
    and so that a run whose first attempt failed in the user's code or config (`doomed`, filled by
    the report handler) stops now instead of after every restart Ray Train would make; so does a run
    whose MLflow run could not be opened (`opening`'s error is raised). Called in the main thread,
    Ray Train installs its own SIGINT handler, which waits for its controller to abort and then
    exits the process with status 1, before the run is marked or the user told how to continue. The
    run's actors end with the driver (the local cluster is shut down; a joined cluster drops the
    job's actors when the driver leaves it). The first Ctrl+C calls `stop`, which asks the workers
    to save and end at their next report and returns how many seconds that may take; the
    KeyboardInterrupt follows once they did (or that time passed, or a second Ctrl+C came)."""
    outcome: dict[str, Any] = {}
    # Waited for as an event, not with Thread.join: a KeyboardInterrupt inside join() can leave the
    # thread marked as ended while it still runs (CPython before 3.13), and the run must go on to
    # its checkpoint.
    ended = threading.Event()

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread as is
            outcome["error"] = exc
        finally:
            ended.set()

    threading.Thread(target=fit, name="orchestrator-fit", daemon=True).start()
    # set by the user's first Ctrl+C: how long the run may take to save
    deadline: float | None = None
    while not ended.is_set():
        try:
            ended.wait(timeout=0.2)
        except KeyboardInterrupt:
            if deadline is not None:  # a second Ctrl+C: stop now, without that checkpoint
                raise
            deadline = time.monotonic() + stop()
            continue
        if deadline is not None and time.monotonic() > deadline:
            raise KeyboardInterrupt
        if doomed:
            raise Doomed(doomed[0])
        if opening.failed():
            opening.result()
    if "error" in outcome:
        raise outcome["error"]
    if deadline is not None:  # the workers saved at the user's stop and ended there
        raise KeyboardInterrupt
    return outcome["result"]


def stop_at_next_report(place: RunPlace, history: list[dict[str, Any]]) -> float:
    """The user's Ctrl+C: ask rank 0 to save at its next report and end the run there
    (training/stop.py). Returns how long to wait for it: two report intervals, at least 10 s and at
    most 2 minutes; said in one line."""
    try:
        place.write_text(STOP_FILE, f"{time.time()}\n")
    except OSError as exc:
        print(f"interrupted: could not ask the workers to save ({exc}); stopping now",
              file=sys.stderr, flush=True)
        return 0.0
    wait_s = min(120.0, max(10.0, 2 * float(history[-1].get("interval_s", 0.0))
                            if history else 30.0))
    print(f"interrupted: saving a checkpoint at the next report (at most {wait_s:.0f} "
          "s; Ctrl+C again to stop without it)", file=sys.stderr, flush=True)
    return wait_s


@contextmanager
def interrupted(place: RunPlace, history: list[dict[str, Any]]) -> Iterator[None]:
    """Ctrl+C: say where the run stopped, what a resume continues from and the command for it; the
    interrupt then ends the command (exit 130, the MLflow run KILLED)."""
    try:
        yield
    except KeyboardInterrupt:
        import ray

        # a joined cluster: leaving it ends the run's actors, so nothing more registers
        if ray.is_initialized():
            ray.shutdown()
        saved = place.registered_step()
        # A checkpoint can register before its step's report reaches this driver: the run got at
        # least that far.
        step = max(history[-1]["step"] if history else 0, saved or 0)
        command = (["orchestrator", *sys.argv[1:]] if sys.argv[1:2] == ["train"]
                   else ["orchestrator", "train", "..."])
        again = shlex.join(command + ([] if "--resume" in command else ["--resume"]))
        print(f"interrupted at step {step}; " + (f"last checkpoint step {saved}; "
                                                 f"continue with: {again}"
                                                 if saved else "no checkpoint yet: a new "
                                                               "run starts from step 0"),
              file=sys.stderr, flush=True)
        raise
