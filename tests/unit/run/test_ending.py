"""The end's warm-up (run/ending.py): from the worker group's start only where a core is spare beyond the workers'
and the driver's, and what it loads is what the end then uses."""

from __future__ import annotations

import sys

import pytest

from orchestrator import load_config
from orchestrator.run.ending import EndWarmUp


@pytest.mark.parametrize(("cores", "workers", "cpus", "early"), [
    (2, 2, 1.0, False),  # this kind of machine: the workers and the driver take every core
    (4, 2, 1.0, True),  # a laptop: two spare
    (4, 2, 1.5, False),  # 3 CPUs of workers and the driver: none spare
    (8, 4, 1.5, True),
    (16, 8, 2.0, False),
])
def test_the_warm_up_starts_with_the_worker_group_only_with_a_core_to_spare(cores: int, workers: int, cpus: float,
                                                                           early: bool) -> None:
    config = load_config(None, [f"scaling.num_workers={workers}", f"scaling.cpus_per_worker={cpus}"])
    assert EndWarmUp(config, cores=cores).early is early


def test_an_elastic_group_counts_its_largest_size() -> None:
    config = load_config(None, ["scaling.num_workers=[1,4]", "train.global_batch_size=96"])
    assert EndWarmUp(config, cores=5).early is False and EndWarmUp(config, cores=6).early is True


def test_the_warm_up_loads_pyplot_and_a_second_start_is_the_first() -> None:
    warm_up = EndWarmUp(load_config(None, ["tracking.enabled=false"]))
    warm_up.start()
    thread = warm_up.thread
    warm_up.start()  # the first progress line after an early start: the same thread
    assert warm_up.thread is thread
    warm_up.wait()
    assert thread is not None and not thread.is_alive()
    assert "matplotlib.pyplot" in sys.modules


def test_the_warm_up_loads_only_after_what_it_is_started_after() -> None:
    """Started early, it waits for the driver's own first imports (the launch passes MLflow's opening)."""
    import threading
    import time

    gate = threading.Event()
    warm_up = EndWarmUp(load_config(None, ["tracking.enabled=false"]))
    warm_up.start(after=gate.wait)
    time.sleep(0.3)
    assert warm_up.thread is not None and warm_up.thread.is_alive()  # held until the gate opens
    gate.set()
    warm_up.wait()
    assert not warm_up.thread.is_alive()
