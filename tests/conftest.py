"""Shared test set-up. Ray-facing settings go in the environment before any Ray process starts."""

from __future__ import annotations

import os

import pytest

# Each ray.train.report after the second waits one health-check interval (2 s by default).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "30")
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
os.environ.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
# One auth mode for every Ray process the tests start (see README: token auth is off for local clusters).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pipelines.prepare import prepare_digits

    out = tmp_path_factory.mktemp("digits")
    prepare_digits(str(out))
    return str(out)
