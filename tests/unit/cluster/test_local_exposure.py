"""A launch that checks its own exposure: one warning line when the tracking store's credentials would cross the
network unencrypted (plain http:// to another machine), and when the Ray cluster a command joins takes work from its
network without token auth (Ray's security statement: whoever reaches its ports runs code). Quiet where nothing is
exposed: https, loopback, a cluster that asks for a token."""

from __future__ import annotations

import pytest

from orchestrator.cluster.local import open_cluster
from orchestrator.tracking.uri import credentials_in_clear


@pytest.mark.parametrize("uri, environ, host", [
    ("http://me:secret@mlflow.internal:5000", {}, "mlflow.internal"),
    ("http://10.1.2.3:5000", {"MLFLOW_TRACKING_PASSWORD": "secret"}, "10.1.2.3"),  # MLflow's basic auth
    ("http://mlflow.internal", {"MLFLOW_TRACKING_TOKEN": "t"}, "mlflow.internal"),
])
def test_credentials_sent_in_clear_to_another_machine_are_warned_about(uri: str, environ: dict[str, str],
                                                                        host: str) -> None:
    warning = credentials_in_clear(uri, environ)
    assert warning is not None and warning.startswith(f"warning: the MLflow credentials go unencrypted (http://) to "
                                                      f"{host}:") and "https://" in warning and "secret" not in warning


@pytest.mark.parametrize("uri, environ", [
    ("https://me:secret@mlflow.internal", {}),  # encrypted
    ("http://me:secret@127.0.0.1:5000", {}), ("http://me:secret@localhost:5000", {}),  # never leaves the machine
    ("http://me:secret@[::1]:5000", {}),
    ("http://mlflow.internal:5000", {}),  # nothing secret to send
    ("sqlite:////tmp/mlruns.db", {"MLFLOW_TRACKING_PASSWORD": "secret"}), ("postgresql://me:pw@db/m", {}),
])
def test_nothing_exposed_nothing_said(uri: str, environ: dict[str, str]) -> None:
    assert credentials_in_clear(uri, environ) is None


def test_joining_a_cluster_without_token_auth_off_loopback_is_warned_about() -> None:
    warning = open_cluster("10.0.0.5:6379", {})
    assert warning is not None and warning.startswith("warning: the Ray cluster at 10.0.0.5:6379 runs without token "
                                                      "auth") and "RAY_AUTH_MODE=token" in warning
    assert open_cluster("10.0.0.5:6379", {"RAY_AUTH_MODE": "token"}) is None  # it asked for (and got) a token
    assert open_cluster("127.0.0.1:6379", {}) is None  # on loopback: only this machine's users reach it


def test_the_state_api_port_is_never_one_ray_gives_another_component(monkeypatch: pytest.MonkeyPatch) -> None:
    """A free port the OS hands out may be Ray's dashboard agent's default (52365, inside Linux's ephemeral range, and
    freed by a cluster that just ended): Ray then refuses to start. The OS is asked again."""
    import socket

    from orchestrator.cluster import local

    handed = iter([52365, 6379, 41234])  # what the OS says it bound, in turn
    monkeypatch.setattr(socket.socket, "getsockname", lambda sock: ("127.0.0.1", next(handed)))
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    assert local.pin_state_api() == 41234
    assert local.os.environ["RAY_API_SERVER_ADDRESS"] == "http://127.0.0.1:41234"


def test_a_join_refused_for_its_token_says_so_in_one_line_naming_the_fix() -> None:
    """Ray's own refusals: at once where RAY_AUTH_MODE=token finds no token (AuthenticationError), after its retries
    where the mode is unset (a ConnectionError whose cause's text holds the GCS's InvalidAuthToken). Both read the same
    line; any other refusal keeps Ray's first line and, with the mode unset, the hint to export it."""
    from ray.exceptions import AuthenticationError

    from orchestrator.cluster.local import join_refused

    no_token = AuthenticationError("Token authentication is enabled but no authentication token was found")
    try:
        try:
            raise RuntimeError("Failed to connect to GCS. Last connection error: Traceback (most recent call last):\n"
                               "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: Authentication token "
                               "is missing or incorrect")
        except RuntimeError as cause:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.5:6379") from cause
    except ConnectionError as exc:
        retried = exc
    for exc, environ in ((no_token, {"RAY_AUTH_MODE": "token"}), (retried, {})):
        line = join_refused("10.0.0.5:6379", exc, environ)
        assert line.startswith("could not join the Ray cluster at 10.0.0.5:6379: it runs with token auth and refused "
                               "this command's token") and "\n" not in line, line
        assert "set RAY_AUTH_TOKEN" in line and "~/.ray/auth_token" in line and "RAY_AUTH_TOKEN_PATH" in line
        assert ("export RAY_AUTH_MODE=token" in line) == (environ.get("RAY_AUTH_MODE") != "token")
    other = join_refused("10.0.0.5:6379", ConnectionError("Failed to connect to Ray cluster at 10.0.0.5:6379"), {})
    assert other.startswith("could not join the Ray cluster at 10.0.0.5:6379: Failed to connect") and \
        "export RAY_AUTH_MODE=token here too" in other
