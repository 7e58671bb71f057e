"""S3 failures are classified by the error code and HTTP status the store returned, never by digits elsewhere in
the message (a key named part-00500.parquet is not a 500), with real botocore exceptions and pyarrow's texts."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from pipelines.config import S3Config
from pipelines.storage import Storage, storage_error

STORE = Storage(uri="s3://b/train", root="b/train", s3=S3Config(max_attempts=3), region="us-east-1")


def client_error(code: str, status: int, message: str, operation: str = "GetObject") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       operation)


def arrow_error(key: str, kind: str, message: str, operation: str = "GetObject") -> OSError:
    """pyarrow's S3 error text (arrow/filesystem/s3_internal.h ErrorToStatus)."""
    return OSError(f"When reading from key '{key}' in bucket 'b': AWS Error {kind} during {operation} operation: "
                   f"{message}")


def classify(exc: BaseException, key: str = "b/train/part-00500.parquet") -> str:
    return str(storage_error(exc, STORE, "reading", key))


@pytest.mark.parametrize("key", ["part-00500.parquet", "part-00503.parquet", "part-00403.parquet"])
def test_a_missing_key_whose_name_has_status_digits_is_not_throttling(key: str) -> None:
    path = f"b/train/{key}"
    missing = [
        client_error("NoSuchKey", 404, f"The specified key does not exist: train/{key}"),
        client_error("404", 404, "Not Found", "HeadObject"),  # HEAD errors carry no body: the status is the code
        arrow_error(f"train/{key}", "NO_SUCH_KEY", "The specified key does not exist."),
        FileNotFoundError(f"Path does not exist '{path}'. Detail: [errno 2] No such file or directory"),
    ]
    for exc in missing:
        message = classify(exc, path)
        assert message.startswith(f"S3 error reading s3://{path}: "), message
        assert "kept failing" not in message and "access denied" not in message


@pytest.mark.parametrize("exc", [
    client_error("SlowDown", 503, "Please reduce your request rate."),
    client_error("ServiceUnavailable", 503, "Service is unable to handle request."),
    client_error("InternalError", 500, "We encountered an internal error. Please try again."),
    client_error("503", 503, "Service Unavailable", "HeadObject"),
    arrow_error("train/part-00001.parquet", "SLOW_DOWN", "Please reduce your request rate."),
    arrow_error("train/part-00001.parquet", "UNKNOWN (HTTP status 503)", "No response body.", "HeadObject"),
    arrow_error("train/part-00001.parquet", "INTERNAL_FAILURE", "Internal error."),
])
def test_throttling_and_server_errors_kept_failing(exc: BaseException) -> None:
    message = classify(exc)
    assert message.startswith("S3 kept failing (") and "after 3 attempts" in message, message


@pytest.mark.parametrize("exc", [
    client_error("AccessDenied", 403, "Access Denied"),
    client_error("403", 403, "Forbidden", "HeadObject"),
    arrow_error("train/part-00001.parquet", "ACCESS_DENIED", "Access Denied"),
    arrow_error("train/part-00001.parquet", "UNKNOWN (HTTP status 403)", "No response body.", "HeadObject"),
])
def test_access_errors_are_denied(exc: BaseException) -> None:
    assert classify(exc).startswith("access denied reading s3://b/train/part-00500.parquet")


@pytest.mark.parametrize("exc", [
    EndpointConnectionError(endpoint_url="http://127.0.0.1:1/b"),
    arrow_error("train/part-00001.parquet", "NETWORK_CONNECTION", "curlCode: 7, Couldn't connect to server"),
])
def test_connection_failures_are_unreachable(exc: BaseException) -> None:
    assert classify(exc).startswith("S3 endpoint AWS unreachable reading")


def test_a_missing_bucket_is_named_by_its_code_only() -> None:
    assert classify(client_error("NoSuchBucket", 404, "The specified bucket does not exist")).startswith(
        "bucket 'b' does not exist")
    assert classify(arrow_error("train/x.parquet", "NO_SUCH_BUCKET", "")).startswith("bucket 'b' does not exist")
    # A key that merely spells a code is classified by what the store answered.
    odd = "b/train/NoSuchBucket-SlowDown-AccessDenied.parquet"
    assert classify(client_error("NoSuchKey", 404, f"no such key {odd}"), odd).startswith("S3 error reading")
