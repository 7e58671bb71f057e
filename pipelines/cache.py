"""Node-local disk cache of remote shards: the first read of an object downloads it once per node,
later reads (later epochs, other read tasks on the node) open the local copy.

Layout under the cache directory (shared by every process on the node):
    objects/<hash of URI>.<hash of size+ETag>.parquet   complete copies; a changed object gets a new
    name tmp/                                                downloads in progress (renamed into
    objects/ when done) tmp/<hash of URI>.lock                              held while that object
    downloads (one download per node) stats.json                                          hits /
    misses / bytes, for tests and `orchestrator` users
Least recently used copies (by mtime, refreshed on every hit) are evicted past the size cap.
Processes coordinate with an flock; a download happens outside the lock and lands by atomic rename,
so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa

from pipelines.storage import ObjectInfo, Storage, open_lock, private_dir, storage_error

DEFAULT_MAX_GB = 50.0
_CHUNK = 8 << 20


@dataclass
class CacheStats:
    """Counters summed over every process that used the cache directory."""

    hits: int = 0
    misses: int = 0
    bytes_downloaded: int = 0
    bytes_from_cache: int = 0
    evictions: int = 0
    bypassed: int = 0  # objects larger than the cap, read straight from the store


class DiskCache:
    """Picklable handle on a node-local cache directory (created on first use on each node)."""

    def __init__(self, directory: str, max_gb: float | None = None) -> None:
        self.directory = os.path.abspath(os.path.expanduser(directory))
        self.max_bytes = int((max_gb or DEFAULT_MAX_GB) * 1e9)

    def check(self) -> None:
        """The directory made (0700) if missing, refused (DataError) unless it is this user's own
        and closed to others: whoever made it decides what is in it, and cached names follow from
        the bucket listing, so planted Parquet would be trained on as a hit."""
        private_dir(self.directory, "set data.cache to a directory of your "
                                    "own (e.g. ~/.cache/orchestrator/shards)")

    def _objects(self) -> Path:
        self.check()  # on every use, on every node: each node has its own directory
        path = Path(self.directory, "objects")
        path.mkdir(parents=True, exist_ok=True)
        Path(self.directory, "tmp").mkdir(exist_ok=True)
        return path

    @contextlib.contextmanager
    def _locked(self, name: str = ".lock") -> Iterator[None]:
        self._objects()
        lock = open_lock(os.path.join(self.directory, name))
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield
        finally:
            os.close(lock)  # closing releases the flock

    def _count(self, **deltas: int) -> None:
        """Add to the shared counters (caller holds the lock)."""
        path = Path(self.directory, "stats.json")
        stats = CacheStats(**json.loads(path.read_text())) if path.exists() else CacheStats()
        for key, delta in deltas.items():
            setattr(stats, key, getattr(stats, key) + delta)
        # A fresh name (mkstemp: O_EXCL, never a planted link), renamed over the counters in one
        # step.
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".stats.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as out:
                out.write(json.dumps(asdict(stats)))
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @staticmethod
    def _names(storage: Storage, obj: ObjectInfo) -> tuple[str, str]:
        key = hashlib.sha256(f"{storage.endpoint}|{obj.path}".encode()).hexdigest()[:32]
        version = hashlib.sha256(f"{obj.size}|{obj.version}".encode()).hexdigest()[:16]
        return key, f"{key}.{version}.parquet"

    def open(self, storage: Storage, obj: ObjectInfo) -> pa.NativeFile:
        """A readable file for `obj`: the local copy if its size and ETag match, else downloaded
        first."""
        objects = self._objects()
        key, name = self._names(storage, obj)
        path = objects / name
        if (handle := self._hit(obj, path)) is not None:
            return handle
        if obj.size > self.max_bytes:
            with self._locked():
                self._count(bypassed=1)
            return storage.filesystem().open_input_file(obj.path)
        # One download per object per node: readers that miss at once (the ranks of a node reading
        # the validation shards together) queue on the object's own lock, and all but the first find
        # its copy there.
        with self._locked(f"tmp/{key}.lock"):
            if (handle := self._hit(obj, path)) is not None:
                return handle
            self._download(storage, obj, path)
        with self._locked():
            self._count(misses=1, bytes_downloaded=obj.size)
            # Older versions of this object are dead weight: drop them now rather than wait for LRU.
            for stale in objects.glob(f"{key}.*.parquet"):
                if stale.name != name:
                    stale.unlink(missing_ok=True)
            self._evict(keep=path)
        return pa.memory_map(str(path))

    def _hit(self, obj: ObjectInfo, path: Path) -> pa.NativeFile | None:
        """The local copy, counted as a hit (None if there is none)."""
        try:
            handle = pa.memory_map(str(path))  # stays readable even if evicted while open
        except FileNotFoundError:
            return None
        with self._locked():
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)  # LRU: the mtime is the last use
            self._count(hits=1, bytes_from_cache=obj.size)
        return handle

    def _download(self, storage: Storage, obj: ObjectInfo, path: Path) -> None:
        fd, tmp = tempfile.mkstemp(dir=Path(self.directory, "tmp"), suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out:
                try:
                    with storage.filesystem().open_input_stream(obj.path) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                except OSError as exc:
                    raise storage_error(exc, storage, "downloading", obj.path) from None
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _evict(self, keep: Path) -> None:
        """Delete least recently used copies until the cache fits its cap (caller holds the
        lock)."""
        entries = []
        for entry in self._objects().iterdir():
            with contextlib.suppress(FileNotFoundError):
                stat = entry.stat()
                entries.append((stat.st_mtime, stat.st_size, entry))
        total = sum(size for _, size, _ in entries)
        evicted = 0
        for _, size, entry in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            if entry == keep:
                continue
            entry.unlink(missing_ok=True)
            total -= size
            evicted += 1
        if evicted:
            self._count(evictions=evicted)

    def stats(self) -> CacheStats:
        return cache_stats(self.directory)


def cache_stats(directory: str) -> CacheStats:
    """The counters of a cache directory (zeros if it was never used)."""
    path = Path(os.path.expanduser(directory), "stats.json")
    return CacheStats(**json.loads(path.read_text())) if path.exists() else CacheStats()
