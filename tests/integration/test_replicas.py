"""failure.mode=replicas on a real local Ray cluster (Ray Train's TorchftConfig, torchft's lighthouse, no mocks): a
training worker SIGKILLed by PID mid-run is replaced alone while the other keeps stepping on the whole global batch;
the run finishes, its report stream never goes back, and its loss ends close to the same run without the kill."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator import load_config
from orchestrator.run.launch import train
from orchestrator.run.result import TrainResult

pytest.importorskip("torchft")  # the `replicas` extra
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 300


def replica_run(tmp: Path, digits: str, *extra: str) -> Any:
    # 16 rows per replica per step (32 alone); 50 ms per forward: a survivor alone still trains when Ray has replaced
    # the killed worker (about 10 s here).
    return load_config(None, [
        f"data.train={digits}/train", "data.val=null", f"storage.path={tmp}/runs", "tracking.enabled=false",
        "scaling.num_workers=2", "failure.mode=replicas", "failure.max_failures=2", "train.global_batch_size=32",
        "train.micro_batch_size=16", "train.precision=fp32", f"train.max_steps={STEPS}", "train.log_every=5",
        "model.entrypoint=fault_model:build", "model.step_s=0.05", *extra])


def reports(runs: Path) -> list[dict[str, Any]]:
    """The reports that reached the driver so far, from the run's attempt record in storage (runs.py)."""
    found: list[dict[str, Any]] = []
    for record in runs.glob("*/attempts/*.json"):
        try:
            found += json.loads(record.read_text())["reports"]
        except (OSError, ValueError, KeyError):  # being rewritten
            pass
    return found


def wait_for(check: Any, what: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.1)
    raise TimeoutError(f"{what} not seen within {timeout:.0f} s")


def tail_loss(result: TrainResult) -> float:
    last = [r["train_loss"] for r in result.history][-6:]
    return sum(last) / len(last)


@pytest.fixture(scope="module")
def clean_loss(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory, digits_dir: str) -> float:
    result = train(replica_run(tmp_path_factory.mktemp("clean"), digits_dir), verbose=False)
    assert result.metrics["step"] == STEPS
    assert {r["replicas/live"] for r in result.history} == {2} and result.history[-1]["replicas/dropped_steps"] == 0
    # Each report counts the global batch of its 5 steps, both replicas' rows (not rank 0's share alone).
    assert all(r["samples_per_s"] * r["interval_s"] == pytest.approx(32 * 5, rel=0.01) for r in result.history[1:])
    return tail_loss(result)


def test_a_killed_replica_is_replaced_while_the_other_keeps_stepping(clean_loss: float, tmp_path: Path,
                                                                      digits_dir: str) -> None:
    from ray.util.state import list_actors

    # The replacement builds its model 8 s late (the driver's check and the two workers built it first): the
    # survivor steps alone meanwhile, however soon Ray replaces the killed worker on a loaded machine.
    marker = tmp_path / "builds"
    marker.mkdir()
    cfg = replica_run(tmp_path, digits_dir, f"model.marker={marker}", "model.late_build_s=8")
    outcome: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: outcome.update(result=train(cfg, verbose=False)))
    thread.start()
    try:
        # Rank 0 reports (its first report names its pid): kill the other one, mid-run.
        wait_for(lambda: [r for r in reports(tmp_path / "runs") if r["step"] >= 50], "step 50", 240)
        rank0 = next(r["worker_pid"] for r in reports(tmp_path / "runs") if "worker_pid" in r)
        other = [a.pid for a in list_actors(filters=[("state", "=", "ALIVE")])
                 if a.class_name == "RayTrainWorker" and a.pid and a.pid != rank0]
        assert len(other) == 1
        os.kill(other[0], signal.SIGKILL)
    finally:
        thread.join(timeout=400)
    assert "result" in outcome, "the run did not finish"
    result: TrainResult = outcome["result"]
    history = result.history
    assert result.metrics["step"] == STEPS
    assert len(list(marker.glob("built-*"))) == 4  # the driver's check, two workers, one replacement (held late)
    steps = [r["step"] for r in history]
    assert steps == sorted(set(steps)), steps  # never goes back: nothing redone, nothing reported twice
    assert not [r for r in history[1:] if "worker_pid" in r]  # rank 0 never restarted
    # The survivor stepped alone (the whole global batch) after the kill, then the replaced replica rejoined.
    alone = [r for r in history if r["replicas/live"] == 1]
    assert len(alone) >= 2 and all(r["samples_per_s"] * r["interval_s"] == pytest.approx(32 * 5, rel=0.01)
                                   for r in alone[1:]), [(r["step"], r["replicas/live"]) for r in history]
    assert history[-1]["replicas/live"] == 2 and history.index(alone[-1]) < len(history) - 1
    assert history[-1]["replicas/dropped_steps"] <= 1  # at most the step in flight at the kill
    # Same global batch every step: the loss ends where the run without the kill ends.
    assert tail_loss(result) == pytest.approx(clean_loss, rel=0.3, abs=0.05), (tail_loss(result), clean_loss)
