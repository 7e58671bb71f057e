"""The node-local disk cache (`data.cache: DIR`) only trusts a directory of this user's own: one another user made
(first, on a shared node) could hold planted Parquet under the names a bucket listing predicts, served as cache
hits; and its lock and stats files are never written through a planted symlink. Root runs these tests, so
"another user" is a chown to uid 65534 and a planted link an os.symlink."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.cache import DiskCache
from pipelines.errors import DataError
from pipelines.storage import ObjectInfo, Storage, open_storage

OTHER_UID = 65534  # nobody


def source(tmp_path: Path) -> tuple[Storage, ObjectInfo]:
    (tmp_path / "src").mkdir()
    path = tmp_path / "src" / "0.parquet"
    pq.write_table(pa.table({"x": pa.array(np.arange(100, dtype=np.float64))}), path)
    st = path.stat()
    return open_storage(str(tmp_path / "src")), ObjectInfo(str(path), st.st_size, str(st.st_mtime_ns))


def plant(cache_dir: Path, storage: Storage, obj: ObjectInfo) -> None:
    """What an attacker who made the directory first would do: a copy under the name the listing predicts."""
    (cache_dir / "objects").mkdir(parents=True, exist_ok=True)
    (cache_dir / "tmp").mkdir(exist_ok=True)
    pq.write_table(pa.table({"x": pa.array([-1.0] * 100)}), cache_dir / "objects" / DiskCache._names(storage, obj)[1])


@pytest.mark.parametrize("owner, mode, why", [
    (OTHER_UID, 0o755, f"owned by uid {OTHER_UID}, not this user"),
    (OTHER_UID, 0o700, f"owned by uid {OTHER_UID}, not this user"),
    (None, 0o777, "writable by others"),
    (None, 0o770, "writable by others"),
])
def test_a_cache_directory_someone_else_could_fill_is_refused(tmp_path: Path, owner: int | None, mode: int,
                                                              why: str) -> None:
    storage, obj = source(tmp_path)
    cache_dir = tmp_path / "shared-cache"
    cache_dir.mkdir()
    plant(cache_dir, storage, obj)
    cache_dir.chmod(mode)
    if owner is not None:
        os.chown(cache_dir, owner, owner)
    with pytest.raises(DataError) as refused:
        DiskCache(str(cache_dir)).open(storage, obj)
    message = str(refused.value)
    assert message.startswith(f"cache directory {cache_dir} is {why}"), message
    assert "set data.cache to a directory of your own" in message and "\n" not in message
    assert not (cache_dir / "stats.json").exists()  # refused before anything was read or counted


def test_a_private_cache_directory_is_used_and_a_readable_one_tightened(tmp_path: Path) -> None:
    storage, obj = source(tmp_path)
    cache_dir = tmp_path / "mine"
    cache_dir.mkdir(mode=0o755)
    cache_dir.chmod(0o755)  # readable by others, writable by no one else: nothing could have been planted
    assert pq.read_table(DiskCache(str(cache_dir)).open(storage, obj)).column("x").to_pylist() == list(range(100))
    st = os.lstat(cache_dir)
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    fresh = tmp_path / "new" / "cache"
    DiskCache(str(fresh)).open(storage, obj)
    assert stat.S_IMODE(os.lstat(fresh).st_mode) == 0o700


def test_a_symlinked_cache_directory_is_refused(tmp_path: Path) -> None:
    storage, obj = source(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "cache").symlink_to(elsewhere)
    with pytest.raises(DataError, match=f"cache directory {tmp_path / 'cache'} is a symlink: refused"):
        DiskCache(str(tmp_path / "cache")).open(storage, obj)
    assert list(elsewhere.iterdir()) == []


def test_the_lock_and_the_stats_file_are_never_written_through_a_planted_link(tmp_path: Path) -> None:
    storage, obj = source(tmp_path)
    cache_dir = tmp_path / "cache"
    cache = DiskCache(str(cache_dir))
    cache.open(storage, obj)  # a miss: creates the directory, the lock and stats.json
    victim_lock, victim_stats = tmp_path / "victim-lock", tmp_path / "victim-stats"
    victim_stats.write_text("precious")
    # The links are planted as root could (or an earlier, looser cache directory would have let anyone).
    (cache_dir / ".stats.json.tmp").symlink_to(victim_stats)
    cache.open(storage, obj)  # a hit: counts through a fresh temporary file, never the planted name
    assert victim_stats.read_text() == "precious"
    assert cache.stats().hits == 1 and cache.stats().misses == 1
    (cache_dir / ".lock").unlink()
    (cache_dir / ".lock").symlink_to(victim_lock)
    with pytest.raises(DataError) as refused:
        cache.open(storage, obj)
    assert str(refused.value) == f"lock file {cache_dir / '.lock'} is a symlink: refused; remove it"
    assert not victim_lock.exists()
    assert victim_stats.read_text() == "precious"


def test_the_docs_suggest_only_per_user_cache_directories() -> None:
    import re

    root = Path(__file__).resolve().parents[3]
    text = "\n".join((root / name).read_text() for name in ("README.md", "docs/data.md", "examples/cluster-gpu.yaml"))
    suggested = re.findall(r"(?:data\.cache=|cache: |e\.g\. )(\S*/\S*)", text)
    assert "~/.cache/orchestrator/shards" in suggested
    assert not [path for path in suggested if path.startswith(("/tmp", "/var/tmp", "/dev/shm"))], suggested


def test_the_driver_refuses_a_cache_directory_before_ray_starts(tmp_path: Path) -> None:
    # The driver's own node is checked with the data, before anything starts (every node checks again on use).
    from pipelines.config import DataConfig
    from pipelines.datasets import inspect_datasets

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, OTHER_UID, OTHER_UID)
    cfg = DataConfig(train="s3://bucket/train", val=None, cache=str(shared))
    with pytest.raises(DataError, match=f"cache directory {shared} is owned by uid {OTHER_UID}"):
        inspect_datasets(cfg)  # refused before the bucket is listed (there is no S3 here)


class SlowSource:
    """The shard's filesystem, with each download slowed enough that concurrent first reads overlap."""

    def __init__(self, storage: Storage) -> None:
        self.fs, self.downloads = storage.filesystem(), 0

    def open_input_stream(self, path: str) -> pa.NativeFile:
        import time

        self.downloads += 1
        time.sleep(0.3)
        return self.fs.open_input_stream(path)


def test_concurrent_first_reads_of_one_shard_download_it_once(tmp_path: Path) -> None:
    # Two ranks on a node read the same validation shard at the same moment: one downloads, the other waits for that
    # copy and reads it as a hit (the module's promise: once per node), rather than both downloading it.
    import threading

    storage, obj = source(tmp_path)
    slow = SlowSource(storage)
    storage._fs = slow  # type: ignore[assignment]
    cache = DiskCache(str(tmp_path / "cache"))
    start, tables = threading.Barrier(4), []

    def read() -> None:
        start.wait()
        tables.append(pq.read_table(cache.open(storage, obj)).column("x").to_pylist())

    threads = [threading.Thread(target=read) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert tables == [list(range(100))] * 4
    assert slow.downloads == 1
    assert (cache.stats().misses, cache.stats().hits) == (1, 3)
