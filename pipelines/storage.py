"""Where shards live: one pyarrow filesystem + root path for a local path or an s3:// URI.

Every reader and writer (inspection, Ray Data read tasks, `prepare`, the disk cache) goes through
`Storage`, so S3 and local data take the same code path. S3 credentials come only from the standard
AWS chain, and never travel: `Storage` (pickled into read tasks, trials and Train's RunConfig, and
so into Tune's state in the bucket) holds no key. Each process resolves them from its own chain
(environment, profile, SSO, web identity, instance role) and the AWS SDKs refresh temporary ones, so
a run outlives the lifetime of any one token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlparse

import pyarrow.fs as pafs

from pipelines.config import S3Config, is_remote
from pipelines.errors import DataError


@dataclass(frozen=True)
class ObjectInfo:
    """One shard: its path inside the filesystem, size, and a version that changes when it is
    rewritten (the ETag on S3, the modification time in ns on local disk)."""

    path: str
    size: int
    version: str


@dataclass
class Storage:
    """A resolved location. Picklable (crosses into Ray tasks) and credential-free: the filesystem
    is rebuilt lazily per process, with that process's own credential chain."""

    uri: str
    root: str  # path inside the filesystem: absolute local path, or bucket/prefix without s3://
    s3: S3Config | None = None
    endpoint: str | None = None
    region: str | None = None
    _fs: pafs.FileSystem | None = field(default=None, repr=False, compare=False)

    @property
    def remote(self) -> bool:
        return self.s3 is not None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None}

    def filesystem(self) -> pafs.FileSystem:
        if self._fs is None:
            self._fs = self._build_fs()
        return self._fs

    def _build_fs(self) -> pafs.FileSystem:
        if self.s3 is None:
            return pafs.LocalFileSystem()
        kwargs: dict[str, Any] = {
            "region": self.region,
            "connect_timeout": self.s3.connect_timeout_s,
            "request_timeout": self.s3.request_timeout_s,
            # Transient errors (5xx, SlowDown, dropped connections) are retried with exponential
            # backoff; access errors are not retryable in the AWS SDK, so they fail at once.
            "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=self.s3.max_attempts),
        }
        if self.endpoint:
            url = urlparse(self.endpoint)
            kwargs["endpoint_override"] = url.netloc or url.path
            kwargs["scheme"] = url.scheme or "https"
        if self.s3.anonymous:
            kwargs["anonymous"] = True
        # Otherwise no keys: pyarrow then uses the AWS SDK's default chain in this process,
        # re-resolved and refreshed as it goes, and its pickle (Ray ships this object to trials and
        # writes it into tuner.pkl) carries no credential.
        return pafs.S3FileSystem(**kwargs)

    def client(self) -> Any:
        """A boto3 S3 client with the same endpoint, region and retry budget, and this process's
        credentials as the standard chain gives them now (used for listing, which needs ETags that
        pyarrow does not expose)."""
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config

        assert self.s3 is not None
        config = Config(retries={"total_max_attempts": self.s3.max_attempts, "mode": "standard"},
                        connect_timeout=self.s3.connect_timeout_s,
                        read_timeout=self.s3.request_timeout_s,
                        signature_version=UNSIGNED if self.s3.anonymous else None)
        # A fresh Session: botocore caches credentials per session, so rotated ones in the
        # environment or the shared files are seen; refreshable ones (SSO, role, web identity)
        # refresh inside it.
        return boto3.Session().client("s3", endpoint_url=self.endpoint, region_name=self.region,
                                      config=config)

    def uri_of(self, path: str) -> str:
        """The user-facing name of a path inside this storage (s3://bucket/key or the local
        path)."""
        return f"s3://{path}" if self.remote else path

    def join(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def below(self, name: str) -> Storage:
        """The same store and endpoint, rooted at `name` under this root."""
        root = self.join(name)
        return replace(self, uri=self.uri_of(root), root=root, _fs=None)

    def list_objects(self, suffix: str = ".parquet") -> list[ObjectInfo]:
        """The objects under the root whose names end in `suffix`, sorted by path; DataError if
        none."""
        objects = self._list_s3() if self.remote else self._list_local()
        if objects is None and self.remote:
            raise DataError(f"no objects under '{self.uri}' (missing or empty prefix): "
                            "write shards there with `orchestrator prepare synthetic "
                            f"--out {self.uri} --rows N`, or fix data.train / data.val")
        if objects is None:
            raise DataError(f"data path '{self.uri}' does not exist: create it with "
                            "`orchestrator prepare digits --out DIR` (or s3://bucket/prefix) "
                            "or point data.train / data.val at your Parquet shards")
        picked = [o for o in objects if o.path.endswith(suffix)
                  and not os.path.basename(o.path).startswith((".", "_"))]
        if not picked:
            raise DataError(f"data path '{self.uri}' holds no {suffix} "
                            "files: write shards there first")
        return sorted(picked, key=lambda o: o.path)

    def _list_local(self) -> list[ObjectInfo] | None:
        """Files under the root; None when the root does not exist."""
        fs = self.filesystem()
        info = fs.get_file_info(self.root)
        if info.type == pafs.FileType.NotFound:
            return None
        entries = [info] if info.type == pafs.FileType.File else fs.get_file_info(
            pafs.FileSelector(self.root, recursive=True))
        return [ObjectInfo(e.path, e.size or 0, str(e.mtime_ns)) for e in entries
                if e.type == pafs.FileType.File]

    def _list_s3(self) -> list[ObjectInfo] | None:
        """Objects under the prefix; None when there are none (S3 has no empty directories)."""
        bucket, _, prefix = self.root.partition("/")
        client = self.client()
        found = []
        try:
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for page in pages:
                for obj in page.get("Contents", []):
                    key = obj["Key"]
                    # "s3://b/p" means the object p or the "folder" p/, not p-other.parquet.
                    if prefix and key != prefix and not key.startswith(prefix.rstrip("/") + "/"):
                        continue
                    found.append(ObjectInfo(f"{bucket}/{key}", int(obj["Size"]),
                                            obj["ETag"].strip('"')))
        except Exception as exc:
            raise storage_error(exc, self, "listing") from None
        return found or None


def resolve_endpoint(s3: S3Config) -> str | None:
    """The endpoint URL, honouring the variables boto3 itself honours (service-specific one
    first)."""
    return (s3.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL") or None)


def open_storage(uri: str, s3: S3Config | None = None) -> Storage:
    """Resolve a local path or s3://bucket/prefix; for S3, resolve endpoint and region now, and
    check that the standard chain has credentials (not kept: every process that touches the data
    resolves its own)."""
    if not is_remote(uri):
        if "://" in uri:
            raise DataError(f"'{uri}': only local paths and s3://bucket/prefix are supported")
        return Storage(uri=uri, root=os.path.abspath(uri))
    s3 = s3 or S3Config()
    root = uri.removeprefix("s3://").strip("/")
    if not root or root.startswith("/"):
        raise DataError(f"'{uri}' names no bucket: write s3://bucket/prefix")
    import boto3

    session = boto3.Session()
    if not s3.anonymous and session.get_credentials() is None:
        raise DataError(f"no AWS credentials found for {uri}: set AWS_ACCESS_KEY_ID / "
                        "AWS_SECRET_ACCESS_KEY or AWS_PROFILE, log in with SSO, or run on a node "
                        "with an instance role; for a public bucket set data.s3.anonymous: true")
    region = s3.region or session.region_name or "us-east-1"
    return Storage(uri=uri, root=root, s3=s3, endpoint=resolve_endpoint(s3), region=region)


def resolve_filesystem(uri: str, s3: S3Config | None = None) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, root path inside it) for a local path or s3:// URI. The root has no
    s3:// prefix, which is what pyarrow and `ray.data.read_parquet(paths, filesystem=fs)` expect."""
    storage = open_storage(uri, s3)
    return storage.filesystem(), storage.root


# What the store answered, matched exactly: botocore's error code (also the HTTP status as a string
# for HEAD requests, which have no body) and pyarrow's S3 error type. Never substrings of the
# message: it may name a key such as part-00500.parquet.
_NO_BUCKET = {"NoSuchBucket", "NO_SUCH_BUCKET"}
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
           "AllAccessDisabled", "ACCESS_DENIED", "INVALID_ACCESS_KEY_ID",
           "SIGNATURE_DOES_NOT_MATCH", "INVALID_CLIENT_TOKEN_ID", "INVALID_SIGNATURE",
           "MISSING_AUTHENTICATION_TOKEN", "UNRECOGNIZED_CLIENT"}
_TRANSIENT = {"SlowDown", "ServiceUnavailable", "InternalError", "Throttling", "RequestTimeout",
              "SLOW_DOWN", "SERVICE_UNAVAILABLE", "INTERNAL_FAILURE", "THROTTLING",
              "REQUEST_TIMEOUT"}
_UNREACHABLE = {"NETWORK_CONNECTION"}
# Connection failures raise no code: botocore's and Python's connection and timeout errors, by
# class.
_UNREACHABLE_TYPES = {"EndpointConnectionError", "ConnectionError", "HTTPClientError",
                      "TimeoutError"}
# pyarrow: "... AWS Error SLOW_DOWN during GetObject operation: ...", and for a code the SDK does
# not know, "AWS Error UNKNOWN (HTTP status 503) during ..." (arrow/filesystem/s3_internal.h).
_ARROW_ERROR = r"AWS Error (\[code \d+\]|\w+)(?: \(HTTP status (\d{3})\))? during "


def _error_code(exc: BaseException) -> tuple[str, int | None]:
    """(error code, HTTP status) of a boto3 or pyarrow S3 failure; ('', None) when it carries
    neither."""
    import re

    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = str(response.get("Error", {}).get("Code", ""))
        return code, status if isinstance(status, int) else None
    found = re.search(_ARROW_ERROR, str(exc))
    if found:
        return found[1], int(found[2]) if found[2] else None
    return "", None


def storage_error(exc: BaseException, storage: Storage, action: str,
                  path: str | None = None) -> DataError:
    """Turn a boto3/pyarrow failure into one DataError that names the object and the fix."""
    what = storage.uri_of(path) if path else storage.uri
    code, status = _error_code(exc)
    if code.isdigit() and status is None:
        status = int(code)
    detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    attempts = storage.s3.max_attempts if storage.s3 else 1
    bucket = storage.root.partition("/")[0]
    if code in _NO_BUCKET:
        return DataError(f"bucket '{bucket}' does not exist ({what}): create "
                         "it, or fix the bucket name or data.s3.endpoint")
    if code in _DENIED or status == 403:
        return DataError(f"access denied {action} {what} ({detail}): grant the credentials from "
                         "the standard AWS chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                         "AWS_PROFILE, SSO, instance role) read access, or set "
                         "data.s3.anonymous: true for a public bucket (not retried)")
    if code in _UNREACHABLE or _UNREACHABLE_TYPES & {c.__name__ for c in type(exc).__mro__}:
        return DataError(f"S3 endpoint {storage.endpoint or 'AWS'} unreachable "
                         f"{action} {what} after {attempts} attempts with backoff "
                         f"({detail}): check data.s3.endpoint / $AWS_ENDPOINT_URL "
                         "and the network, or raise data.s3.max_attempts")
    if code in _TRANSIENT or (status is not None and (status >= 500 or status == 429)):
        return DataError(f"S3 kept failing ({code or status}) {action} {what} after "
                         f"{attempts} attempts with backoff: the store is throttling "
                         "or unavailable; retry later or raise data.s3.max_attempts")
    return DataError(f"S3 error {action} {what}: {detail}")


def user_cache_dir() -> str:
    """This user's own cache directory for the product, `$XDG_CACHE_HOME/orchestrator` or
    `~/.cache/orchestrator` (a per-uid directory under the temp dir where the home is not writable),
    mode 0700. Never a shared, predictable path: on a node others can write to, whoever creates such
    a path first decides what is in it."""
    import tempfile

    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    try:
        return private_dir(os.path.join(home, "orchestrator"))
    # a read-only or missing home (some containers): a per-uid directory is still private
    except OSError:
        return private_dir(os.path.join(tempfile.gettempdir(), f"orchestrator-{os.getuid()}"))


def owner_only(path: str, flags: int) -> int:
    """An `open(..., opener=owner_only)`: a file it creates is this user's alone (0600), from its
    first byte."""
    return os.open(path, flags, 0o600)


def private_dir(path: str, instead: str = "set XDG_CACHE_HOME to a directory of your own") -> str:
    """`path` as a real directory owned by this user that no one else can write to (created 0700,
    tightened if others may only read it); DataError if it is a symlink, someone else's, or writable
    by others (whoever could write there may have planted files this user would then trust).
    `instead` is the fix the error offers."""
    import stat

    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # a file or a link to one: refused below
    st = os.lstat(path)
    what = ("a symlink" if stat.S_ISLNK(st.st_mode)
            else "not a directory" if not stat.S_ISDIR(st.st_mode)
            else f"owned by uid {st.st_uid}, not this user ({os.getuid()})"
            if st.st_uid != os.getuid()
            else f"writable by others (mode {stat.S_IMODE(st.st_mode):o})"
            if st.st_mode & 0o022 else "")
    if what:
        raise DataError(f"cache directory {path} is {what}: refused; remove it, or {instead}")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def local_name(rest: str, key: str) -> str:
    """The relative local path for an object whose key is `key` and whose part below the fetched
    prefix is `rest`; DataError naming the key if it could land anywhere but below the download
    directory. The bucket's owner names the keys, so anything but plain name segments is refused: an
    absolute path, `..` (and `.` and empty segments, which the SDK normalises away on the request,
    so they would fetch a different object), backslashes (a separator on Windows), NUL."""
    parts = rest.split("/")
    if (not rest or rest.startswith("/") or "\\" in rest or "\0" in rest
            or any(p in ("", ".", "..") for p in parts)):
        raise DataError(f"object key '{key}' refused: it is absolute or holds '..', "
                        "'.', an empty segment, a backslash or NUL, so it could be "
                        "written outside the download directory; rename or remove "
                        "that object, or fetch from a prefix whose keys you trust")
    return os.path.join(*parts)


def _inside(directory: str, relative: str, key: str) -> str:
    """`directory`/`relative` (a `local_name`, already checked by name), checked once more after
    resolving links: the result must lie strictly below `directory`."""
    base = os.path.realpath(directory)
    path = os.path.realpath(os.path.join(base, relative))
    if os.path.commonpath([base, path]) != base or path == base:
        raise DataError(f"object key '{key}' refused: it resolves to "
                        f"{path}, outside the download directory {base}")
    return path


def open_lock(path: str) -> int:
    """A lock file's descriptor, never through a symlink (O_NOFOLLOW): a planted link would make
    this process create or lock a file of the link's choosing."""
    import errno

    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DataError(f"lock file {path} is a symlink: refused; remove it") from None
        raise


def fetch_prefix(uri: str, s3: S3Config | None = None, root: str | None = None) -> str:
    """Every object under an s3:// prefix copied once to a local directory below `root` (default:
    this user's cache directory, see `user_cache_dir`), per node: the first process holds a file
    lock and downloads, the others wait and reuse the copy, keyed by the prefix and the objects'
    versions. A key that could land outside that directory is refused before anything is downloaded.
    Returns the directory; DataError naming the prefix or the key on failure."""
    import fcntl
    import hashlib
    import shutil
    import tempfile

    storage = open_storage(uri, s3)
    objects = storage.list_objects("")
    listing = "\n".join(f"{o.path} {o.version}" for o in objects)
    key = hashlib.sha256(listing.encode()).hexdigest()[:16]
    prefix = storage.root.rstrip("/") + "/"
    # (object, path below the copy, whether it only names a directory: "folder" markers such as
    # "sub/", made by consoles, hold no bytes), every key checked before anything is written.
    plan = []
    for obj in objects:
        rest = obj.path[len(prefix):] if obj.path.startswith(prefix) else os.path.basename(obj.path)
        folder = obj.path.endswith("/")
        if folder and not rest.removesuffix("/"):
            continue  # the prefix's own marker
        plan.append((obj, local_name(rest.removesuffix("/") if folder else rest, obj.path), folder))
    base = os.path.join(root or user_cache_dir(), "pretrained")
    os.makedirs(base, mode=0o700, exist_ok=True)
    target = os.path.join(base, key)
    lock = open_lock(os.path.join(base, f".{key}.lock"))
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(target):
            staging = tempfile.mkdtemp(prefix=f".{key}-", dir=base)
            try:
                for obj, relative, folder in plan:
                    local = _inside(staging, relative, obj.path)
                    if folder:
                        os.makedirs(local, exist_ok=True)
                        continue
                    os.makedirs(os.path.dirname(local), exist_ok=True)
                    pafs.copy_files(obj.path, local, source_filesystem=storage.filesystem())
            except Exception as exc:
                shutil.rmtree(staging, ignore_errors=True)
                if isinstance(exc, DataError):
                    raise
                raise storage_error(exc, storage, "downloading") from None
            # whole or not at all: a crash leaves only a staging directory
            os.rename(staging, target)
    finally:
        os.close(lock)  # releases the flock
    return target
