"""MLflow writes off the report path: MlflowTracker puts a run's metric points and tags (and the
calls that must come after them, such as a checkpoint's model) on a queue, and one daemon thread
writes them with `log_batch` every `every_s` seconds, in the order they were put (a series' steps
stay in order), at most MLflow's 1000 entities a batch. A store that is slow only delays the thread;
one that is down keeps what it did not take for the next try, up to `limit` points (past that the
oldest go, said in one warning line). `flush()` writes everything now (the run's end and Ctrl+C,
before its end status); `refused` (a newer attempt claimed the run) empties the queue: nothing of it
lands after the refusal."""

from __future__ import annotations

import atexit
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

BATCH_METRICS = 1000  # MLflow's log_batch limits: 1000 metrics, 100 tags, 1000 entities in all
BATCH_TAGS = 100
# points and tags kept while the store does not take them (~15 MB): a long outage's oldest go
MAX_PENDING = 100_000
# The cadence of the writes, whatever the reports' rate: a SQLite store's log_batch costs ~10 ms of
# CPU a call plus ~0.2 ms a point, so a call every 5 s (not every second) cuts the driver's CPU at
# rest for a chart that is at most 5 s behind; the run's end and Ctrl+C write everything at once.
EVERY_S = 5.0

# One queued write: ("metric", Metric), ("tag", RunTag), or ("call", what, fn) run alone, in its
# place.
Entry = tuple[Any, ...]
# The tracker's writer of one batch or call: `write(what, call, force)` -> "done", "refused" (the
# store answered no: warned and dropped) or "down" (kept for the next try). `force` tries while the
# store is down.
Write = Callable[[str, Callable[[], None], bool], str]


class Writer:
    """One daemon thread writing the queued entries of one MLflow run through `write`."""

    def __init__(self, log_batch: Callable[..., None], write: Write, dropped: Callable[[int], None],
                 every_s: float = EVERY_S, limit: int = MAX_PENDING) -> None:
        self._log_batch, self._write, self._dropped = log_batch, write, dropped
        self.every_s, self.limit = every_s, limit
        self.refused: Callable[[], bool] = lambda: False
        self._queue: deque[Entry] = deque()
        self._cond = threading.Condition()
        self._asked = 0  # flushes asked for, and done: a flush waits until done catches up
        self._done = 0
        self._busy = False  # the thread is writing what it took off the queue
        self._ended = False  # the run ended: the thread stops (a later put starts another)
        self._thread: threading.Thread | None = None
        self._exit_flush = False
        # metric keys the store refused (a name it does not take): not sent again
        self._refused_keys: set[str] = set()
        # entries the store never took (dropped past `limit`, or left when a flush met it down)
        self.lost = 0

    def put(self, *entries: Entry) -> None:
        """Queue entries; returns at once (the thread starts with the first)."""
        with self._cond:
            self._queue.extend(entries)
            over = len(self._queue) - self.limit
            for _ in range(max(0, over)):
                self._queue.popleft()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="orchestrator-mlflow",
                                                daemon=True)
                self._thread.start()
                if not self._exit_flush:  # a run never finished (a crash) still writes what it had
                    self._exit_flush = True
                    atexit.register(self.flush, end=True)
        if over > 0:
            self.lost += over
            self._dropped(over)

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + (1 if self._busy else 0)

    def flush(self, end: bool = False) -> int:
        """Write everything queued now (tried once even while the store is down) and wait for it;
        returns how many entries the store did not take. At the run's `end` those are left out
        (counted in `lost`), else kept."""
        with self._cond:
            if self._thread is None:
                return 0
            self._asked += 1
            asked = self._asked
            self._cond.notify_all()
            while self._done < asked:
                self._cond.wait(1.0)
            left = len(self._queue)
            if end:
                self._queue.clear()
                self.lost += left
                self._ended = True  # the thread ends (a Tune study's trials do not each keep one)
                self._cond.notify_all()
        return left

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._asked > self._done or self._ended,
                                    timeout=self.every_s)
                if self._ended and not self._queue and self._asked == self._done:
                    self._thread, self._ended = None, False
                    return
                asked = self._asked
            self._drain(force=asked > self._done)
            with self._cond:
                self._done = asked
                self._cond.notify_all()

    def _drain(self, force: bool) -> None:
        """Write the queue's batches in order until it is empty or the store is down (the batch kept
        in front)."""
        while True:
            with self._cond:
                if self.refused():
                    self._queue.clear()
                    return
                batch = self._take()
                self._busy = bool(batch)
            if not batch:
                return
            done = self._write_batch(batch, force)
            with self._cond:
                self._busy = False
                if not done:
                    self._queue.extendleft(reversed(batch))
                    return
            force = False  # once the store answered, the next batches go as usual

    def _take(self) -> list[Entry]:
        """The queue's front: one call, or the metrics and tags before the next call, within
        MLflow's limits."""
        if not self._queue:
            return []
        if self._queue[0][0] == "call":
            return [self._queue.popleft()]
        batch: list[Entry] = []
        metrics = tags = 0
        while self._queue and self._queue[0][0] != "call" and metrics + tags < BATCH_METRICS:
            kind = self._queue[0][0]
            if ((kind == "metric" and metrics == BATCH_METRICS)
                    or (kind == "tag" and tags == BATCH_TAGS)):
                break
            batch.append(self._queue.popleft())
            metrics, tags = metrics + (kind == "metric"), tags + (kind == "tag")
        return batch

    def _write_batch(self, batch: list[Entry], force: bool) -> bool:
        """Write `batch`: True once the store took it (or refused it), False when it is down. A
        refused batch is written again in halves, so that only what the store refuses itself is left
        out (one bad key among a thousand good points)."""
        if batch[0][0] == "call":
            _, what, call = batch[0]
            return self._write(what, call, force) != "down"
        batch = [entry for entry in batch
                 if entry[0] != "metric" or entry[1].key not in self._refused_keys]
        if not batch:
            return True
        metrics = [entry[1] for entry in batch if entry[0] == "metric"]
        # the last value wins
        tags = list({entry[1].key: entry[1] for entry in batch if entry[0] == "tag"}.values())
        outcome = self._write("log_metrics" if metrics else "set_tags",
                              lambda: self._log_batch(metrics=metrics, tags=tags), force)
        if outcome != "refused":
            return outcome == "done"
        if len(batch) == 1:
            if batch[0][0] == "metric":
                self._refused_keys.add(batch[0][1].key)
            return True
        half = len(batch) // 2
        return self._write_batch(batch[:half], False) and self._write_batch(batch[half:], False)
