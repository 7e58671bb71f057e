"""S3 credentials never travel: what crosses into Ray tasks, trials and storage (the `Storage`, the pyarrow
filesystem handed to Ray's RunConfig, a dataset's read tasks) carries no key, and every process resolves and
refreshes its own credentials from the standard AWS chain, so a long run survives a key rotation. Against
moto_server over HTTP; no Ray runtime here."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import cloudpickle
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from s3_server import MotoServer

from orchestrator.run.trainer import storage_args
from pipelines.config import S3Config
from pipelines.errors import DataError
from pipelines.reader import ShardDatasource
from pipelines.sources import inspect_parquet
from pipelines.storage import open_storage

pytestmark = pytest.mark.slow

KEY_ID = "AKIACANARYKEYID12345"
SECRET = "SECRET-canary-1234567890-do-not-ship"
TOKEN = "TOKEN-canary-0987654321-do-not-ship"


def put_parquet(client: Any, bucket: str, key: str, xs: list[float]) -> None:
    buffer = io.BytesIO()
    pq.write_table(pa.table({"x": pa.array(xs), "label": pa.array([0] * len(xs))}), buffer)
    client.put_object(Bucket=bucket, Key=key, Body=buffer.getvalue())


def read_all(source: ShardDatasource) -> list[float]:
    """One epoch through the read tasks, as Ray Data would run them."""
    tables = [t for task in source.get_read_tasks(1) for t in task()]
    return sorted(pa.concat_tables(tables).column("x").to_pylist())


def test_nothing_that_travels_to_workers_carries_a_key(moto: MotoServer, bucket: str, s3_client: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    put_parquet(s3_client, bucket, "d/part-0.parquet", [1.0, 2.0])
    for name, value in (("AWS_ACCESS_KEY_ID", KEY_ID), ("AWS_SECRET_ACCESS_KEY", SECRET),
                        ("AWS_SESSION_TOKEN", TOKEN)):
        monkeypatch.setenv(name, value)  # distinctive values, so finding them means they were shipped
    s3 = S3Config(endpoint=moto.url)
    storage = open_storage(f"s3://{bucket}/runs", s3)
    info = inspect_parquet(f"s3://{bucket}/d", ["x"], "label", s3)
    source = ShardDatasource(info.storage, info.objects, info.file_rows, ["x", "label"])  # type: ignore[arg-type]
    assert read_all(source) == [1.0, 2.0]  # the filesystem was built and used before pickling
    shipped = {
        "storage": pickle.dumps(storage),
        "RunConfig storage (Train, Tune, tuner.pkl)": cloudpickle.dumps(storage_args(storage)),
        "filesystem": pickle.dumps(storage.filesystem()),
        "read tasks": cloudpickle.dumps(source.get_read_tasks(1)),
        "datasource": cloudpickle.dumps(source),
    }
    for what, blob in shipped.items():
        for value in (SECRET, KEY_ID, TOKEN):
            assert value.encode() not in blob, f"{what} carries {value}"
    # What arrives still reads: the copy resolves credentials from its own process's chain.
    tasks = cloudpickle.loads(shipped["read tasks"])
    assert sorted(pa.concat_tables([t for task in tasks for t in task()]).column("x").to_pylist()) == [1.0, 2.0]


def test_open_storage_still_refuses_when_no_credentials_are_found(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path, aws_env: None) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(DataError, match=r"no AWS credentials found for s3://b1/x: set AWS_ACCESS_KEY_ID"):
        open_storage("s3://b1/x", S3Config(endpoint="http://127.0.0.1:9"))
    assert open_storage("s3://b1/x", S3Config(anonymous=True)).remote  # public buckets need none


def _user(iam: Any, name: str, action: str) -> dict[str, str]:
    iam.create_user(UserName=name)
    iam.put_user_policy(UserName=name, PolicyName="p", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": action, "Resource": "*"}]}))
    key = iam.create_access_key(UserName=name)["AccessKey"]
    return {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}


def _use(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, source: str, key: dict[str, str]) -> None:
    """Make `key` this process's credentials, in the environment or in the shared credentials file."""
    if source == "env":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["aws_access_key_id"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["aws_secret_access_key"])
        return
    # As `aws configure`, an SSO login or a credential_process refresher rewrites it.
    (tmp_path / "credentials").write_text(f"[default]\naws_access_key_id = {key['aws_access_key_id']}\n"
                                          f"aws_secret_access_key = {key['aws_secret_access_key']}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("source", ["env", "file"])
def test_a_run_keeps_reading_after_its_credentials_are_rotated(source: str, tmp_path: Path, aws_env: None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3
    from botocore.exceptions import ClientError

    server = MotoServer(tmp_path)  # its own: authentication is switched on below
    try:
        iam = boto3.client("iam", endpoint_url=server.url, region_name="us-east-1")
        admin = _user(iam, "admin", "*")
        key_a = _user(iam, "reader", "s3:*")
        bucket = "rotation"
        setup = boto3.client("s3", endpoint_url=server.url, region_name="us-east-1")
        setup.create_bucket(Bucket=bucket)
        put_parquet(setup, bucket, "d/part-0.parquet", [1.0, 2.0])
        put_parquet(setup, bucket, "d/part-1.parquet", [3.0])
        server.require_auth()  # from here on, only IAM users' keys are accepted

        _use(monkeypatch, tmp_path, source, key_a)
        s3 = S3Config(endpoint=server.url, max_attempts=1)
        info = inspect_parquet(f"s3://{bucket}/d", ["x"], "label", s3)
        storage = info.storage
        assert storage is not None
        datasource = ShardDatasource(storage, info.objects, info.file_rows, ["x", "label"])
        assert read_all(datasource) == [1.0, 2.0, 3.0]
        shipped = cloudpickle.dumps(datasource)  # as it travels to a read task or a restarted worker

        # Rotation, as an STS/SSO/instance-role refresh or an operator does it: a new key, the old one revoked.
        admin_iam = boto3.client("iam", endpoint_url=server.url, region_name="us-east-1", **admin)
        new = admin_iam.create_access_key(UserName="reader")["AccessKey"]
        _use(monkeypatch, tmp_path, source,
             {"aws_access_key_id": new["AccessKeyId"], "aws_secret_access_key": new["SecretAccessKey"]})
        admin_iam.delete_access_key(UserName="reader", AccessKeyId=key_a["aws_access_key_id"])
        with pytest.raises(ClientError, match="InvalidAccessKeyId"):  # the old key is really dead
            boto3.client("s3", endpoint_url=server.url, region_name="us-east-1", **key_a).list_objects_v2(
                Bucket=bucket)

        # The same objects the run already holds: listing (boto3) and reads (pyarrow) use the new key.
        assert [o.path for o in storage.list_objects()] == [f"{bucket}/d/part-0.parquet", f"{bucket}/d/part-1.parquet"]
        assert read_all(datasource) == [1.0, 2.0, 3.0]
        # And a fresh copy, as a worker or a read task receives it.
        assert read_all(cloudpickle.loads(shipped)) == [1.0, 2.0, 3.0]
        assert read_all(ShardDatasource(pickle.loads(pickle.dumps(storage)), info.objects, info.file_rows,
                                        ["x", "label"])) == [1.0, 2.0, 3.0]
    finally:
        server.stop()
