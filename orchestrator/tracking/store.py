"""Whether the tracking store can be used: an http(s) server that nothing listens at is found before
Ray starts (check_server_listens), a store the command cannot use at its start is one UserError
(unavailable), and a failed call mid-run is told apart as an outage (the store cannot be reached
now) or a refusal of that call (is_outage)."""

from __future__ import annotations

import socket
import sys

from orchestrator.config import TrackingConfig
from orchestrator.errors import UserError
from orchestrator.tracking.uri import mask_password, resolve_uri


def check_server_listens(cfg: TrackingConfig, timeout_s: float = 3.0) -> None:
    """An http(s) tracking server that nothing listens at fails here, before Ray starts (the MLflow
    run is otherwise opened while Ray Train starts the worker group, and would be found unreachable
    only then). A TCP connect only: whether the store works is MlflowTracker's to find out."""
    uri = resolve_uri(cfg.uri)
    if not cfg.enabled or not uri.startswith(("http://", "https://")):
        return
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname or "localhost", port), timeout=timeout_s).close()
    except OSError as exc:
        raise unavailable(uri, exc) from None


def unavailable(uri: str, exc: Exception) -> UserError:
    """The one error for a tracking store the command cannot use at its start."""
    detail = mask_password(str(exc).splitlines()[0]) if str(exc) else ""
    return UserError(f"MLflow tracking at '{mask_password(uri)}' is "
                     f"unavailable ({type(exc).__name__}: {detail}): start the "
                     "server, fix tracking.uri, or set tracking.enabled=false")


def is_outage(exc: BaseException) -> bool:
    """Whether a failed tracking call means the store cannot be reached now (a connection refused,
    reset or timed out, a database locked or that cannot be opened), not that it answered and
    refused this call (a changed param, a bad key, a deleted run, a missing file): MLflow raises
    MlflowException for both, the cause tells them apart."""
    import http.client

    import requests
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import ErrorCode

    # An answer cut off midway (a server killed while it answered: requests' ChunkedEncodingError
    # around urllib3's ProtocolError, http.client's IncompleteRead) is the store going away too, not
    # a refusal.
    unreachable: tuple[type[BaseException], ...] = (
        ConnectionError, TimeoutError, requests.ConnectionError, requests.Timeout,
        requests.exceptions.RetryError, requests.exceptions.ChunkedEncodingError,
        http.client.HTTPException)
    botocore = sys.modules.get("botocore.exceptions")  # S3 artifacts; raised only once loaded
    if botocore is not None:
        unreachable += (botocore.ConnectionError, botocore.HTTPClientError)
    # SQLAlchemy's OperationalError, wrapped
    unavailable = ErrorCode.Name(ErrorCode.TEMPORARILY_UNAVAILABLE)
    seen: set[int] = set()
    cause: BaseException | None = exc
    # MLflow wraps the requests or SQLAlchemy error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if (isinstance(cause, unreachable)
                or (isinstance(cause, MlflowException) and cause.error_code == unavailable)):
            return True
        cause = cause.__cause__ or cause.__context__
    return False
