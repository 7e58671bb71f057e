"""One writer per run: every attempt of a run (its first command, each `--resume`, a job's retry, a
driver that lives on behind a partition) claims the next attempt number in the run's storage before
it trains, and writes to the run (a checkpoint, and with it Ray Train's record of the latest; the
MLflow run) only while no newer attempt has claimed one.

A claim is a file `claims/<number>-<token>` in the run's directory. Object stores have no
create-if-absent, so two attempts may claim the same number at once; claims are ordered by (number,
token), which every attempt computes alike from one listing of that directory, and the greater is
the newer. Used on both sides: the driver claims and watches (run/fencing.py), rank 0 of the workers
watches (`Fence`, at report steps a flag; at a checkpoint a listing of its own)."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow.fs as pafs

    from pipelines.storage import Storage

CLAIMS_DIR = "claims"  # in the run's directory, beside attempts/ (each attempt's record)
_NAME = re.compile(r"^(\d{8})-([0-9a-f]{12})$")


@dataclass(frozen=True, order=True)
class Claim:
    """One attempt's claim: its number and the token that breaks a tie; `at` (epoch seconds, by the
    storage's clock: the file's modification time) says when, and takes no part in the order."""

    number: int
    token: str
    at: float = field(default=0.0, compare=False)

    @property
    def name(self) -> str:
        return f"{self.number:08d}-{self.token}"

    @staticmethod
    def parse(name: str, at: float = 0.0) -> Claim | None:
        """The claim a file is named for; None for anything else in the directory."""
        match = _NAME.match(name)
        return Claim(int(match.group(1)), match.group(2), at) if match else None


def read_claims(storage: Storage, run_path: str) -> list[Claim]:
    """Every attempt's claim on the run at `run_path` (in `storage`'s filesystem), oldest first: one
    listing."""
    return claims_in(storage.filesystem(), run_path)


def claims_in(filesystem: pafs.FileSystem, run_path: str) -> list[Claim]:
    """read_claims on a pyarrow filesystem."""
    import pyarrow.fs as pafs

    infos = filesystem.get_file_info(pafs.FileSelector(f"{run_path}/{CLAIMS_DIR}",
                                                       allow_not_found=True))
    found = [Claim.parse(i.base_name, i.mtime.timestamp() if i.mtime else 0.0) for i in infos
             if i.type == pafs.FileType.File]
    return sorted(c for c in found if c is not None)


def claim_attempt(storage: Storage, run_path: str) -> Claim:
    """Claim the next attempt of the run at `run_path`: one more than every claim in storage,
    written as a file (who claimed it inside, for a person who looks). Returns the claim as listed
    back (with its time)."""
    number = max((c.number for c in read_claims(storage, run_path)), default=0) + 1
    claim = Claim(number, uuid.uuid4().hex[:12])
    fs, folder = storage.filesystem(), f"{run_path}/{CLAIMS_DIR}"
    fs.create_dir(folder, recursive=True)
    with fs.open_output_stream(f"{folder}/{claim.name}") as f:
        f.write(json.dumps({"attempt": number, "host": socket.gethostname(), "pid": os.getpid(),
                            "began": time.time()}).encode())
    return next((c for c in read_claims(storage, run_path) if c == claim), claim)


class Fence:
    """This attempt's claim on its run, and the newer one once seen: `newer` is what the last look
    found, `check()` looks now (one listing). `watch` keeps looking in a thread, so that those who
    ask often read only a field."""

    def __init__(self, storage: Storage, run_path: str, mine: Claim) -> None:
        self.storage, self.run_path, self.mine = storage, run_path, mine
        self.newer: Claim | None = None

    def check(self) -> Claim | None:
        """The newest claim when it is newer than this attempt's (kept in `newer`), else None.
        Storage that does not answer leaves the last answer as it was."""
        if self.newer is None:
            try:
                newest = max(read_claims(self.storage, self.run_path), default=None)
            except OSError:
                return None
            if newest is not None and newest > self.mine:
                self.newer = newest
        return self.newer

    def __call__(self, now: bool = False) -> bool:
        """Whether a newer attempt claimed the run: looked up in storage `now`, else the watch's
        last answer."""
        return (self.check() if now else self.newer) is not None

    def watch(self, every_s: float = 1.0) -> Fence:
        """Look every `every_s` seconds in a daemon thread (it ends with its process) until a newer
        claim shows."""

        def look() -> None:
            while self.check() is None:
                time.sleep(every_s)

        threading.Thread(target=look, name="orchestrator-fence", daemon=True).start()
        return self

    def line(self, run: str) -> str:
        """What the older attempt says, once, when it stops."""
        newer = self.newer or self.mine
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(newer.at)) if newer.at else "?"
        other = "another attempt" if newer.number == self.mine.number else "attempt"
        return (f"attempt {self.mine.number} of run {run} stopped: {other} "
                f"{newer.number} of the same run started at {when}; this attempt commits "
                "no checkpoint and writes nothing more to the run or its MLflow run")


def rank_fence(attempt: tuple[Storage, str, Claim] | None, rank: int) -> Callable[..., bool] | None:
    """What the loop asks at report steps (Notices.superseded): rank 0 watches the run's claims; the
    other ranks answer no (Cadence takes rank 0's answer). None without a claim (a Tune trial)."""
    if attempt is None:
        return None
    return Fence(*attempt).watch() if rank == 0 else (lambda now=False: False)
