"""The user's stop (Ctrl+C on the driver) reaching rank 0: the driver writes a request file beside
the run's checkpoints, and a thread of rank 0 looks for it every second, so that the loop reads only
a flag, at its report steps (Cadence broadcasts rank 0's answer). No actor: one more would cost
every run's start a process."""

from __future__ import annotations

import threading

import pyarrow.fs as pafs

from pipelines.storage import Storage

STOP_FILE = "stop-requested"  # in the run's directory


class StopWatch:
    """Rank 0's view of the request: True once the file exists. Polls `path` in `storage` every
    `every_s`."""

    def __init__(self, storage: Storage, path: str, every_s: float = 1.0) -> None:
        self.storage, self.path, self.every_s = storage, path, every_s
        self.seen = threading.Event()
        # A daemon: it ends with the worker process, which ends with its run.
        threading.Thread(target=self._watch, name="orchestrator-stop-watch", daemon=True).start()

    def __call__(self) -> bool:
        return self.seen.is_set()

    def _watch(self) -> None:
        while not self.seen.wait(self.every_s):
            try:
                found = self.storage.filesystem().get_file_info(self.path).type
                if found != pafs.FileType.NotFound:
                    self.seen.set()
                    return
            except OSError:  # storage briefly unreachable: look again at the next tick
                continue
