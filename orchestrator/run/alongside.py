"""A driver stage run in a thread while the main thread does another (MLflow's run opened while Ray
Train starts the worker group): the main thread keeps Ctrl+C and Ray's signal handlers."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from orchestrator.tracking.tracker import closed_on_error


class Alongside:
    """A driver stage run in a thread while the main thread does another; `result()` waits for it
    (Ctrl+C still reaching the main thread) and raises what it raised."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self.began = time.time()
        self.ended: float | None = None
        self._outcome: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(work,),
                                        name="orchestrator-alongside", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], Any]) -> None:
        try:
            self._outcome["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread as is
            self._outcome["error"] = exc
        finally:
            self.ended = time.time()

    def result(self) -> Any:
        while self._thread.is_alive():
            self._thread.join(timeout=0.2)
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["value"]

    def wait(self, seconds: float | None) -> bool:
        """Whether it has ended, waiting `seconds` at most (None: until it has)."""
        self._thread.join(timeout=seconds)
        return not self._thread.is_alive()

    def failed(self) -> bool:
        """Whether it ended with an error (which `result()` raises)."""
        return not self._thread.is_alive() and "error" in self._outcome


@contextmanager
def ended_on_error(opening: Alongside) -> Iterator[None]:
    """The MLflow run being opened beside the run ends KILLED on Ctrl+C, FAILED on an error, never
    left RUNNING (once it is open: a failed opening ended what it opened itself). Ctrl+C before it
    is open waits for it, saying so: a second Ctrl+C leaves at once."""
    try:
        yield
    except BaseException as exc:
        # a wait as long as the opening's
        if isinstance(exc, KeyboardInterrupt) and not opening.wait(0.5):
            print("interrupted: waiting for the MLflow run being opened, to end "
                  "it as KILLED (Ctrl+C again to leave without waiting: the run "
                  "may then stay RUNNING in MLflow)", file=sys.stderr, flush=True)
        try:
            tracker = opening.result()
        # its own failure: the error being raised is the one to raise
        except BaseException:  # noqa: BLE001
            tracker = None
        if tracker is None:
            raise
        with closed_on_error(tracker):  # KILLED on Ctrl+C, FAILED otherwise
            raise
