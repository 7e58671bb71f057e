from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """One real local Ray instance per test module (ray.init costs ~5 s), always shut down."""
    import ray

    here = str(Path(__file__).parent)
    # Workers inherit the environment: they can import the test's own model module, like a user's.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [here, os.environ.get("PYTHONPATH")] if p)
    from orchestrator.launch import pin_state_api

    ray.init(address="local", num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1",
             dashboard_port=pin_state_api())  # see pin_state_api: other Ray instances on this machine
    try:
        yield
    finally:
        from orchestrator.launch import shutdown_local_ray

        shutdown_local_ray()
