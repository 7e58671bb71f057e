"""Shared test set-up. Ray-facing settings go in the environment before any Ray process starts."""

from __future__ import annotations

import os

import pytest

# No Ray Train setting here: tests run what users run (the product sets its own, cluster.TRAIN_DEFAULTS).
# Nodes the tests start with `ray start --block` stop at once when the test ends (no 30 s drain).
os.environ.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
# One auth mode for every Ray process the tests start (cluster/README.md), but for the job-submission cluster of
# test_cluster_jobs.py: it runs with token auth, its nodes and clients in a HOME of their own.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


# Serial seconds per module as measured on a 2-core machine (rounded, from a full run's --junitxml). `make test` runs
# the modules on two pytest-xdist workers, one module per worker at a time (`--dist loadfile`, so a module's Ray
# cluster stays one); the longest go first so that the two workers finish together, with the short unit modules
# filling in at the end.
SLOW_MODULES = {
    "tests/integration/test_reliability.py": 720,
    "tests/integration/pipelines/test_data_order.py": 535,
    "tests/integration/test_warm_cluster.py": 510,
    "tests/integration/test_multinode.py": 470,
    "tests/integration/test_tasks.py": 360,
    "tests/integration/test_fsdp_runs.py": 300,
    "tests/integration/test_train.py": 285,
    "tests/integration/test_cluster_jobs.py": 280,
    "tests/integration/test_tune.py": 215,
    "tests/integration/test_mlflow_ui.py": 175,
    "tests/integration/test_replicas.py": 165,
    "tests/integration/test_one_writer.py": 145,
    "tests/integration/test_doctor.py": 145,
    "tests/integration/test_tracking.py": 140,
    "tests/integration/test_console.py": 105,
    "tests/integration/pipelines/test_s3_train.py": 75,
    "tests/integration/pipelines/test_streaming.py": 70,
    # Unit modules with real processes (gloo ranks, a Ray start, subprocesses): ahead of the second-long ones.
    "tests/unit/training/test_replica_groups.py": 63,
    "tests/unit/training/test_fsdp_checkpoint.py": 55,
    "tests/unit/test_cli.py": 51,
    "tests/unit/training/test_autopilot.py": 48,
    "tests/unit/training/test_fsdp.py": 43,
    "tests/unit/training/test_efficiency.py": 43,
    "tests/unit/training/test_step_waits.py": 32,
    "tests/unit/training/test_rank_agreement.py": 31,
    "tests/unit/test_benches.py": 29,
    "tests/unit/training/test_held_validation.py": 28,
    "tests/unit/test_gpu_check.py": 23,
    "tests/unit/training/test_checkpoint_loads.py": 20,
    "tests/unit/test_architecture.py": 20,
    "tests/unit/training/test_sharded_devices.py": 19,
    "tests/unit/training/test_rank_figures.py": 16,
    "tests/unit/training/test_knobs.py": 14,
    "tests/integration/pipelines/test_s3_data.py": 14,
    "tests/unit/training/test_rank_guarantees.py": 13,
    "tests/unit/training/test_devices.py": 12,
    "tests/unit/tracking/test_writer.py": 12,
    "tests/unit/training/test_local_sgd.py": 11,
    "tests/unit/test_errors.py": 10,
    "tests/unit/training/test_fsdp_training.py": 9,
}


def module_seconds(item: pytest.Item) -> int:
    path = item.path.relative_to(item.config.rootpath).as_posix()
    return SLOW_MODULES.get(path, 20 if path.startswith("tests/integration/") else 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: -module_seconds(item))  # stable: a module's tests stay together and in order
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
