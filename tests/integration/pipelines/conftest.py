"""Buckets and clients on the shared S3 endpoint (the `moto` and `aws_env` fixtures of ../conftest.py)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from s3_server import MotoServer


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
