"""Shared test set-up. Ray-facing settings go in the environment before any Ray process starts."""

from __future__ import annotations

import os

import pytest

# No Ray Train setting here: tests run what users run (the product sets its own, cluster.TRAIN_DEFAULTS).
# Nodes the tests start with `ray start --block` stop at once when the test ends (no 30 s drain).
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
