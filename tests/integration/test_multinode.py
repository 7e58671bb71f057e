"""A real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: one raylet per node): an elastic
[1, 2] group grows when a node joins and shrinks when one is lost, keeping the global batch; each resize and the
failure are MLflow tags."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator import load_config
from orchestrator.run.launch import train
from orchestrator.run.result import TrainResult
from orchestrator.training.checkpoint import load_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NODE = {"num_cpus": 2}  # one 1.5-CPU training worker fits per node; the head (1 CPU) takes none


def train_in_background(config: Any, address: str) -> tuple[threading.Thread, dict[str, Any]]:
    """Start `train` on a thread, so the test can change the cluster under it; the outcome holds result or error."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = train(config, address=address, verbose=False)
        except BaseException as exc:  # re-raised by the test's assertions
            outcome["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread, outcome


def elastic_config(tmp_path: Path, digits_dir: str, experiment: str, checkpoint_every: int,
                   model: tuple[str, ...] = ("model.entrypoint=fault_model:build", "model.step_s=0.04")) -> Any:
    """A [1, 2] group with one 1.5-CPU worker per node, 300 steps at global batch 64 of `model` (by default slowed
    by model.step_s, so the test can change the cluster under it)."""
    return load_config(None, [
        f"data.train={digits_dir}/train", "data.val=null", f"storage.path={tmp_path}/runs",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"tracking.experiment={experiment}",
        "scaling.num_workers=[1,2]", "scaling.cpus_per_worker=1.5", "scaling.resize_check_s=1",
        "train.global_batch_size=64", "train.max_steps=300", "train.log_every=5", "train.precision=fp32",
        f"checkpoint.every={checkpoint_every}", "failure.max_failures=4", *model,
        "failure.worker_start_timeout_s=15",  # a lost node can leave a stale resource view
        "checkpoint.preemption_poll_s=0.5",  # Ray Train's drain watcher (default 5 s)
    ])


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    here = str(Path(__file__).parent)
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH",)}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [here, saved["PYTHONPATH"]] if p)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": True,
                                                            "dashboard_host": "127.0.0.1"})
    try:
        cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def alive_workers() -> list[Any]:
    from ray.util.state import list_actors

    return [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if a.class_name == "RayTrainWorker"]


def wait_for(check: Any, what: str, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = check()
        except Exception:  # the state API can fail while a node goes away
            found = None
        if found:
            return found
        time.sleep(0.2)
    raise TimeoutError(f"{what} not seen within {timeout:.0f} s")


def test_elastic_group_grows_and_shrinks_across_nodes_with_a_constant_global_batch(
        cluster: Any, tmp_path: Path, digits_dir: str) -> None:
    from mlflow.tracking import MlflowClient

    config = elastic_config(tmp_path, digits_dir, "elastic", checkpoint_every=5)
    assert (config.train.micro_batch_size, config.train.grad_accum_steps) == (32, 1)
    thread, outcome = train_in_background(config, cluster.address)
    wait_for(lambda: len(alive_workers()) == 1 and list((tmp_path / "runs").glob("*/checkpoint_*")),
             "one worker and a checkpoint")
    joined = cluster.add_node(**NODE)  # room for a second worker: the group restarts at 2 from the checkpoint
    # Trained at 2 workers across the two nodes: a checkpoint written by the grown group (one RNG state per rank).
    wait_for(lambda: any(len(load_state(p)["rng"]) == 2 for p in (tmp_path / "runs").glob("*/checkpoint_0*")),
             "a checkpoint of the 2-worker group")
    cluster.remove_node(joined, allow_graceful=False)  # the node is lost: the group shrinks to 1 and continues
    thread.join(timeout=480)
    assert not thread.is_alive(), "training did not finish"
    assert "error" not in outcome, outcome.get("error")
    result: TrainResult = outcome["result"]
    assert result.metrics["step"] == 300

    sizes = [r["world_size"] for r in result.history]
    changes = [b for a, b in zip(sizes, sizes[1:], strict=False) if a != b]
    assert sizes[0] == 1 and changes[:2] == [2, 1], sizes
    # 64 rows a step at every size, from what the workers ran, report by report: the micro-batch they actually
    # cut (rows in the last step's micro-batches), their process group's size, and the accumulation each (re)start
    # announced with its first report (the loop draws that many micro-batches per step): 32 x 2 x 1, 32 x 1 x 2.
    accum = None
    for r in result.history:
        accum = r.get("grad_accum_steps", accum)
        assert accum is not None and r["micro_batch_size"] * accum * r["world_size"] == 64, r
    starts = [r for r in result.history if "grad_accum_steps" in r]
    assert {(r["world_size"], r["grad_accum_steps"]) for r in starts} == {(1, 2), (2, 1)}

    tags = MlflowClient(result.tracking_uri).get_run(result.run_id).data.tags
    resizes = sorted(v for k, v in tags.items() if k.startswith("orchestrator.resize."))
    assert any("1 -> 2 workers, global batch 64" in v for v in resizes), resizes
    assert any("2 -> 1 workers, global batch 64" in v for v in resizes), resizes
    assert any(k.startswith("orchestrator.failure.") for k in tags)


def test_the_runs_reports_reach_the_driver_without_an_actor(cluster: Any, tmp_path: Path, digits_dir: str) -> None:
    """Rank 0 and Ray Train's controller send the run's reports straight to the driver (training/channel.py): no
    actor of the product's holds them, so no node takes them away when it goes (a queue actor on a drained worker
    node once ended runs in a ControllerError, bench/chaos.py), and nothing of the product's runs between reports.
    Every report of the run, from whichever node its rank 0 was on, is in the driver's history."""
    import ray
    from ray.util.state import list_actors

    cluster.add_node(**NODE)  # three nodes: rank 0 may be on any of them
    cluster.wait_for_nodes()
    thread, outcome = train_in_background(elastic_config(tmp_path, digits_dir, "reports", 100), cluster.address)
    try:
        workers = wait_for(lambda: [a for a in list_actors(filters=[("state", "=", "ALIVE")])
                                    if a.class_name == "RayTrainWorker"], "the run's workers")
        alive = {a.class_name for a in list_actors(filters=[("state", "=", "ALIVE")])}
        assert "_QueueActor" not in alive, alive
    finally:
        thread.join(timeout=480)
        # Back to one worker node: one the driver is not attached to (all share one IP: Ray may pick any of them).
        driver = ray.get_runtime_context().get_node_id()
        cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id != driver))
    assert "error" not in outcome, outcome.get("error")
    result: TrainResult = outcome["result"]
    steps = {r["step"] for r in result.history if "train_loss" in r}
    assert set(range(5, 301, 5)) <= steps, sorted(set(range(5, 301, 5)) - steps)
    # The controller's events too: each checkpoint it committed is a checkpoint model of the run.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(result.tracking_uri)
    experiment = client.get_run(result.run_id).info.experiment_id
    models = [m for m in client.search_logged_models([experiment]) if m.source_run_id == result.run_id]
    assert any(m.model_type == "checkpoint" for m in models), [(m.name, m.model_type) for m in models]
    print("rank 0's node was the driver's:", any(w.node_id == driver for w in workers))


def test_a_drained_node_triggers_a_checkpoint_before_it_goes(cluster: Any, tmp_path: Path, digits_dir: str) -> None:
    """A spot reclaim notice, as the autoscaler sends it: `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`."""
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    # Both workers hold in step 20 (held_model) until Ray Train has the drain notice: the run cannot end, or pass
    # step 20, before the notice reaches it, however slow or fast the machine is.
    hold = tmp_path / "hold"
    hold.mkdir()
    config = elastic_config(tmp_path, digits_dir, "drain", checkpoint_every=1000, model=(
        "model.entrypoint=held_model:build", "model.hold_call=21", f"model.marker={hold}", "model.release=drain"))
    config.checkpoint.keep = 1000  # every checkpoint stays, for the test to see each
    spot = cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    thread, outcome = train_in_background(config, cluster.address)
    # Both workers of the 2-worker group at step 20 (a group that started at 1 and grew left a file of its own).
    wait_for(lambda: len(pids := {f"held-{a.pid}" for a in alive_workers()}) == 2
             and pids <= {p.name for p in hold.glob("held-*")}, "2 workers on 2 nodes, held at step 20", timeout=240)
    drain = subprocess.run(
        [str(Path(sys.executable).with_name("ray")), "drain-node", "--address", cluster.address, "--node-id",
         spot.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim (test)",
         "--deadline-remaining-seconds", "60"], capture_output=True, text=True, timeout=60)
    assert drain.returncode == 0, drain.stderr
    # No periodic checkpoint before step 300: only the drain notice can write one.
    wait_for(lambda: list((tmp_path / "runs").glob("*/checkpoint_0*")), "the drain checkpoint")
    # The reclaim itself (the node's loss, then resuming on the rest) is what the elastic test above covers;
    # here the run ends on both nodes before the drain's deadline.
    thread.join(timeout=480)
    assert "error" not in outcome, outcome.get("error")
    result: TrainResult = outcome["result"]
    assert result.metrics["step"] == 300
    drained = [r["step"] for r in result.history if r.get("drain_checkpoint")]
    # One drain checkpoint, at the first report step after the hold (20; 25 if the loop's FLOPs-counting forward
    # were no longer counted): the notice came while the run held there.
    assert len(drained) == 1 and drained[0] in (20, 25), drained
    # From then to the deadline (here: the run's end) every report saved, 5 steps apart: a node lost at any moment
    # loses at most one report interval. (training/worker.py's notice_holds ends it at the deadline.)
    saved = sorted(load_state(str(p))["progress"]["step"] for p in (tmp_path / "runs").glob("*/checkpoint_0*"))
    assert saved == list(range(drained[0], 301, 5)), saved
    tags = MlflowClient(result.tracking_uri).get_run(result.run_id).data.tags
    assert any(k.startswith("orchestrator.drain.") and "checkpoint saved" in v for k, v in tags.items())
    cluster.remove_node(spot)


def test_an_elastic_fsdp_group_grows_and_reshards_its_checkpoint(cluster: Any, tmp_path: Path,
                                                                 digits_dir: str) -> None:
    """train.parallel=fsdp, [1, 2]: the 1-worker group's checkpoint (one shard file) is loaded by the grown group at
    2 workers, which cuts the shards anew and writes two per checkpoint; the global batch holds."""
    from mlflow.tracking import MlflowClient

    config = elastic_config(tmp_path, digits_dir, "elastic-fsdp", checkpoint_every=5)
    config.train.parallel = "fsdp"
    thread, outcome = train_in_background(config, cluster.address)
    runs = tmp_path / "runs"
    wait_for(lambda: len(alive_workers()) == 1 and list(runs.glob("*/checkpoint_0*/__0_0.distcp")),
             "one worker and its sharded checkpoint")
    joined = cluster.add_node(**NODE)
    try:
        thread.join(timeout=480)
    finally:
        cluster.remove_node(joined)
    assert not thread.is_alive(), "training did not finish"
    assert "error" not in outcome, outcome.get("error")
    result: TrainResult = outcome["result"]
    assert result.metrics["step"] == 300
    sizes = [r["world_size"] for r in result.history]
    assert sizes[0] == 1 and sizes[-1] == 2 and sorted(set(sizes)) == [1, 2], sizes
    grown = next(r for r in result.history if r["world_size"] == 2 and "grad_accum_steps" in r)
    assert grown["parallel"] == "fsdp" and grown["micro_batch_size"] * grown["grad_accum_steps"] * 2 == 64
    # Each grown-group rank holds half of the model (one row of padding at most per parameter).
    held = {r["world_size"]: r["param_bytes_per_rank"] for r in result.history if "param_bytes_per_rank" in r}
    assert held[2] < 0.55 * held[1], held
    (final,) = [p for p in runs.glob("*/checkpoint_0*") if p.name.startswith("checkpoint_00000300")]
    assert sorted(p.name for p in final.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    losses = [r["train_loss"] for r in result.history]
    assert losses[-1] < losses[0]  # it kept learning across the reshard
    tags = MlflowClient(result.tracking_uri).get_run(result.run_id).data.tags
    assert any("1 -> 2 workers, global batch 64" in v for k, v in tags.items() if k.startswith("orchestrator.resize."))
