"""Shared integration fixtures: one local Ray per module, one real S3 endpoint (moto_server over HTTP) per session,
fake AWS credentials per test."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # s3_server.py, the test model modules
sys.path.insert(1, str(ROOT))  # examples/models.py, as `orchestrator` run from the checkout finds it

from s3_server import FAKE_ENV, MotoServer  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """One real local Ray instance per test module (ray.init costs ~5 s), always shut down."""

    here = str(Path(__file__).parent)
    # Workers inherit the environment: they can import the test's own model modules and the examples', like a
    # user's run from the checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [here, str(ROOT), os.environ.get("PYTHONPATH")] if p)
    from orchestrator.cluster.local import init_local

    # Ray's processes resolve S3 credentials from their own standard chain, like a user's nodes: they inherit
    # the fake ones from the environment Ray starts in; the test process itself gets them per test (aws_env).
    with pytest.MonkeyPatch.context() as env:
        for key, value in FAKE_ENV.items():
            env.setenv(key, value)
        init_local(num_cpus=4, dashboard_host="127.0.0.1")  # see pin_state_api: other Ray instances here
    try:
        yield
    finally:
        from orchestrator.cluster.local import shutdown_local_ray

        shutdown_local_ray()


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
