"""The Ray Train settings the product gives its runs: in the environment of the process that fits (Ray passes them
on to the controller and workers), the user's own exports first, and gone again after the run."""

from __future__ import annotations

import os

import pytest

from orchestrator.cluster.local import TRAIN_DEFAULTS, train_environment
from orchestrator.config import load_config

NAMES = [*TRAIN_DEFAULTS, "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S",
         "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)


def test_defaults_hold_during_the_run_only() -> None:
    with train_environment(load_config(None, []), private_cluster=False):
        assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.2"
        assert os.environ["RAY_TRAIN_ENABLE_PRINT_PATCH"] == "0"
        assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in os.environ  # a cluster that may drain nodes
        assert "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S" not in os.environ  # Ray's own default
    assert not any(name in os.environ for name in NAMES)


def test_the_users_export_wins_and_survives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "1.5")
    with train_environment(load_config(None, []), private_cluster=False):
        assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "1.5"
    assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "1.5"


def test_config_keys_and_a_private_cluster() -> None:
    cfg = load_config(None, ["failure.worker_start_timeout_s=15", "checkpoint.preemption_poll_s=0.5"])
    with train_environment(cfg, private_cluster=True):
        assert os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "15.0"
        assert os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] == "0.5"
        assert os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"  # nothing drains a private local cluster
    with train_environment(load_config(None, ["checkpoint.on_preemption=false"]), private_cluster=False):
        assert os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"
    assert not any(name in os.environ for name in NAMES)
