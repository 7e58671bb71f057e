"""Where `fetch_prefix` (the pretrained-weights copy on each node) writes: only below its own staging directory
(keys are the bucket owner's words), in this user's private cache directory rather than a shared /tmp path, and
never through a lock file someone replaced with a symlink. A local directory stands in as the source: the same
code path as S3 after listing (the S3 side is tests/integration/pipelines/test_s3_pretrained.py)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from pipelines.errors import DataError
from pipelines.storage import fetch_prefix, local_name, user_cache_dir


def weights(tmp_path: Path) -> Path:
    source = tmp_path / "weights"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text('{"a": 1}')
    (source / "sub" / "model.safetensors").write_bytes(b"weights")
    return source


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def private(path: Path) -> bool:
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077 == 0


@pytest.mark.parametrize("rest", ["/etc/passwd", "/", "..", "../x", "a/../../b", "a/..", "x/../../../../etc/cron.d/x",
                                  "./x", "a/./b", ".", "a//b", "", "a/", "..\\..\\x", "a\\b", "a\x00b"])
def test_keys_that_could_leave_the_download_directory_are_refused(rest: str) -> None:
    key = f"bucket/w/{rest}"
    with pytest.raises(DataError) as refused:
        local_name(rest, key)
    assert str(refused.value).startswith(f"object key '{key}' refused")


@pytest.mark.parametrize("rest", ["config.json", "sub/model.safetensors", "a..b", "...", "..x", "x..", ".hidden",
                                  "with space/ü.bin"])
def test_plain_keys_stay_below_the_download_directory(rest: str, tmp_path: Path) -> None:
    local = local_name(rest, f"bucket/w/{rest}")
    resolved = Path(os.path.realpath(tmp_path / local))
    assert resolved.is_relative_to(tmp_path.resolve()) and resolved != tmp_path.resolve()
    assert local == rest  # a plain key keeps its name


def test_the_default_cache_is_this_users_private_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    target = Path(fetch_prefix(str(weights(tmp_path))))
    assert target.is_relative_to(tmp_path / "xdg" / "orchestrator")
    assert files_under(target) == {"config.json": b'{"a": 1}', "sub/model.safetensors": b"weights"}
    assert private(tmp_path / "xdg" / "orchestrator") and private(target.parent)  # 0700, ours


def test_user_cache_dir_without_xdg_is_under_home_and_tightened(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    loose = tmp_path / "home" / ".cache" / "orchestrator"
    loose.mkdir(parents=True)
    loose.chmod(0o755)  # made by hand, readable by others
    assert user_cache_dir() == str(loose)
    assert private(loose)
    loose.chmod(0o777)  # writable by others: anyone may have planted a file in it
    with pytest.raises(DataError, match=f"cache directory {loose} is writable by others"):
        user_cache_dir()


def test_user_cache_dir_falls_back_to_a_per_user_temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-dir"))  # unusable, as a read-only home would be
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert user_cache_dir() == str(tmp_path / "tmp" / f"orchestrator-{os.getuid()}")
    assert private(tmp_path / "tmp" / f"orchestrator-{os.getuid()}")


def test_a_symlinked_cache_dir_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "xdg").mkdir()
    (tmp_path / "xdg" / "orchestrator").symlink_to(elsewhere)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.raises(DataError, match="is a symlink: refused"):
        user_cache_dir()
    assert list(elsewhere.iterdir()) == []


def test_a_symlinked_lock_file_is_not_followed(tmp_path: Path) -> None:
    source, root = weights(tmp_path), tmp_path / "cache"
    first = Path(fetch_prefix(str(source), root=str(root)))
    (lock,) = root.rglob(".*.lock")
    # Someone swaps the lock for a link to a file of theirs, and the copy is gone (same objects: same key).
    victim = tmp_path / "victim"
    lock.unlink()
    lock.symlink_to(victim)
    for p in sorted(first.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    first.rmdir()
    with pytest.raises(DataError) as refused:
        fetch_prefix(str(source), root=str(root))
    assert str(refused.value) == f"lock file {lock} is a symlink: refused; remove it"
    assert not victim.exists()
