"""Fixtures for data tests against a real S3 endpoint (moto_server over HTTP), with fake credentials."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # s3_server.py, the test model modules

from s3_server import FAKE_ENV, MotoServer  # noqa: E402


@pytest.fixture(scope="session")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    server = MotoServer(tmp_path_factory.mktemp("moto"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture()
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials in the standard chain for this test only (and no stray endpoint/profile)."""
    for key, value in FAKE_ENV.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture()
def bucket(moto: MotoServer, aws_env: None) -> str:
    """A fresh bucket on the moto server."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture()
def s3_client(moto: MotoServer, aws_env: None) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1")
