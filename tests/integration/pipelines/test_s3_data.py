"""Parquet in S3 over real HTTP (moto_server): prepare writes there, inspection and reads find it, and every bad
input is one DataError naming the object and the fix. No Ray runtime here."""

from __future__ import annotations

import io
import time
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from s3_server import FaultyProxy, MotoServer

from orchestrator.cli import main
from pipelines.cache import DiskCache
from pipelines.config import DataConfig, S3Config
from pipelines.errors import DataError
from pipelines.prepare import prepare_synthetic
from pipelines.reader import ShardDatasource
from pipelines.sources import inspect_parquet
from pipelines.storage import open_storage

pytestmark = pytest.mark.slow


def put_table(client: Any, bucket: str, key: str, table: pa.Table) -> None:
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    client.put_object(Bucket=bucket, Key=key, Body=buffer.getvalue())


def test_prepare_to_s3_then_inspect(moto: MotoServer, bucket: str, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    # The endpoint comes from the standard variable, as boto3 itself would take it.
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto.url)
    assert main(["prepare", "digits", "--out", f"s3://{bucket}/digits", "--shards", "3"]) == 0
    assert "1438 train rows" in capsys.readouterr().out
    info = inspect_parquet(f"s3://{bucket}/digits/train", ["pixels"], "label")
    assert (info.num_rows, info.feature_dim, info.num_classes, len(info.files)) == (1438, 64, 10, 3)
    assert info.files[0] == f"{bucket}/digits/train/part-00000.parquet"  # no s3:// with a filesystem
    assert all(len(o.version) >= 32 for o in info.objects)  # ETags, for the cache
    # Each shard went up as one complete object: no temporary keys left behind.
    assert not any(".tmp" in path for path in moto.requests("PUT", f"/{bucket}/"))


def test_credentials_stay_out_of_config_and_reprs(moto: MotoServer, bucket: str) -> None:
    cfg = DataConfig(train=f"s3://{bucket}/x", val=None, s3={"endpoint": moto.url})
    storage = open_storage(cfg.train, cfg.s3)
    assert "testing-secret" not in repr(storage) and "testing-secret" not in str(cfg.model_dump())
    assert "testing-secret" not in str(vars(storage))  # no key kept: each process resolves its own chain
    with pytest.raises(Exception, match="extra"):
        DataConfig(train=f"s3://{bucket}/x", s3={"access_key": "AKIA..."})


def test_missing_bucket(moto: MotoServer, aws_env: None) -> None:
    with pytest.raises(DataError, match=r"bucket 'no-such-bucket-x' does not exist .*create it"):
        inspect_parquet("s3://no-such-bucket-x/data", ["x"], "label", S3Config(endpoint=moto.url))


def test_missing_and_empty_prefix(moto: MotoServer, bucket: str, s3_client: Any) -> None:
    s3 = S3Config(endpoint=moto.url)
    with pytest.raises(DataError, match=r"no objects under 's3://.*/nothing' \(missing or empty prefix\): write"):
        inspect_parquet(f"s3://{bucket}/nothing", ["x"], "label", s3)
    s3_client.put_object(Bucket=bucket, Key="notes/readme.txt", Body=b"hi")
    with pytest.raises(DataError, match="holds no .parquet files"):
        inspect_parquet(f"s3://{bucket}/notes", ["x"], "label", s3)


def test_corrupt_file_schema_mismatch_and_missing_column_are_named(moto: MotoServer, bucket: str,
                                                                   s3_client: Any) -> None:
    s3 = S3Config(endpoint=moto.url)
    good = pa.table({"x": pa.array([1.0, 2.0]), "label": pa.array([0, 1])})
    put_table(s3_client, bucket, "d/a.parquet", good)
    with pytest.raises(DataError, match=r"column\(s\) \['y'\] not found in s3://.*/d/a.parquet"):
        inspect_parquet(f"s3://{bucket}/d", ["y"], "label", s3)
    put_table(s3_client, bucket, "d/b.parquet", pa.table({"x": pa.array(["s"]), "label": pa.array([1])}))
    with pytest.raises(DataError, match=r"schema mismatch in s3://.*/d/b.parquet: column 'x' is string"):
        inspect_parquet(f"s3://{bucket}/d", ["x"], "label", s3)
    s3_client.put_object(Bucket=bucket, Key="d/b.parquet", Body=b"PAR1 not parquet at all")
    with pytest.raises(DataError, match=r"corrupt Parquet file s3://.*/d/b.parquet"):
        inspect_parquet(f"s3://{bucket}/d", ["x"], "label", s3)


def test_access_denied_is_not_retried(tmp_path: Any, aws_env: None) -> None:
    # moto with authentication on: the fake key is unknown, so every request is refused with 403.
    server = MotoServer(tmp_path, {"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    proxy = FaultyProxy(server.url, mode="never")
    try:
        with pytest.raises(DataError, match=r"access denied listing s3://locked/data .*AWS chain.*not retried"):
            inspect_parquet("s3://locked/data", ["x"], "label", S3Config(endpoint=proxy.url, max_attempts=5))
        assert proxy.seen == 1
    finally:
        proxy.stop()
        server.stop()


def test_slow_down_is_retried_then_succeeds(moto: MotoServer, bucket: str) -> None:
    prepare_synthetic(f"s3://{bucket}/syn", rows=60, shards=2, features=3, classes=2,
                      s3=S3Config(endpoint=moto.url))
    proxy = FaultyProxy(moto.url, mode="first")  # every distinct request fails once with 503 SlowDown
    try:
        info = inspect_parquet(f"s3://{bucket}/syn/train", ["features"], "label", S3Config(endpoint=proxy.url))
        assert info.num_rows == 60
        assert proxy.failed >= 3 and proxy.seen >= 2 * proxy.failed  # list + footers, each retried once
    finally:
        proxy.stop()


def test_slow_down_forever_gives_up_with_a_clear_error(aws_env: None) -> None:
    proxy = FaultyProxy(None, mode="always")
    try:
        started = time.monotonic()
        with pytest.raises(DataError, match=r"S3 kept failing \(SlowDown\) listing s3://busy/data after 3 attempts"):
            inspect_parquet("s3://busy/data", ["x"], "label", S3Config(endpoint=proxy.url, max_attempts=3))
        assert proxy.seen == 3 and time.monotonic() - started < 30
    finally:
        proxy.stop()


def test_unreachable_endpoint_gives_up_in_bounded_time(aws_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    from s3_server import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: connections are refused
    started = time.monotonic()
    with pytest.raises(DataError, match=rf"S3 endpoint {url} unreachable listing s3://b1/data after 2 attempts"):
        inspect_parquet("s3://b1/data", ["x"], "label", S3Config(endpoint=url, max_attempts=2, connect_timeout_s=1))
    assert time.monotonic() - started < 20
    # The CLI: non-zero exit and one clear line.
    code = main(["train", "--set", "data.train=s3://b1/data", "--set", f"data.s3.endpoint={url}",
                 "--set", "data.s3.max_attempts=1", "--set", "data.val=null", "--set", "tracking.enabled=false"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: S3 endpoint") and err.count("\n") == 1


def test_cache_refetches_a_changed_object(moto: MotoServer, bucket: str, s3_client: Any, tmp_path: Any) -> None:
    s3 = S3Config(endpoint=moto.url)
    put_table(s3_client, bucket, "c/a.parquet", pa.table({"x": pa.array([1.0, 2.0]), "label": pa.array([0, 1])}))
    put_table(s3_client, bucket, "c/b.parquet", pa.table({"x": pa.array([3.0]), "label": pa.array([1])}))
    info = inspect_parquet(f"s3://{bucket}/c", ["x"], "label", s3)
    cache = DiskCache(str(tmp_path / "cache"))
    source = ShardDatasource(info.storage, info.objects, info.file_rows, ["x", "label"], cache=cache)  # type: ignore[arg-type]

    def epoch() -> list[float]:
        tables = [t for task in source.get_read_tasks(1) for t in task()]
        return sorted(pa.concat_tables(tables).column("x").to_pylist())

    assert epoch() == [1.0, 2.0, 3.0]
    gets = len(moto.requests("GET", f"/{bucket}/c/"))
    assert epoch() == [1.0, 2.0, 3.0]
    assert len(moto.requests("GET", f"/{bucket}/c/")) == gets  # second epoch: no GETs of shards
    stats = cache.stats()
    assert (stats.misses, stats.hits) == (2, 2)
    # Rewrite one object: the epoch's listing sees a new ETag, so that shard (only) is fetched again.
    put_table(s3_client, bucket, "c/b.parquet", pa.table({"x": pa.array([4.0, 5.0]), "label": pa.array([1, 0])}))
    assert epoch() == [1.0, 2.0, 4.0, 5.0]
    stats = cache.stats()
    assert (stats.misses, stats.hits) == (3, 3)
    assert len(list((tmp_path / "cache" / "objects").iterdir())) == 2  # the stale copy was dropped
