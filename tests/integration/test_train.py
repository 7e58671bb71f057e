"""End to end on a real local Ray cluster: DDP on digits and its MLflow record (read back through MlflowClient),
local SGD against it, accumulation across workers, a spent failure budget. A worker crash resumed from its
checkpoint: test_reliability.py (to the uninterrupted run's weights) and pipelines/test_data_order.py (to its exact
micro-batches)."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from orchestrator import load_config, train
from orchestrator.run.result import TrainResult, run_summary
from orchestrator.tracking.context import git_commit
from orchestrator.tracking.read import read_summary
from orchestrator.tracking.view import mlflow_key
from orchestrator.training.checkpoint import load_state

pytestmark = pytest.mark.slow


def sets(tmp_path: Path, digits_dir: str, *overrides: str) -> list[str]:
    return [f"data.train={digits_dir}/train", f"data.val={digits_dir}/val", f"storage.path={tmp_path}/runs",
            f"tracking.uri=sqlite:///{tmp_path}/mlruns.db", "tracking.experiment=tests", *overrides]


def run(tmp_path: Path, digits_dir: str, *overrides: str) -> TrainResult:
    return train(load_config(None, sets(tmp_path, digits_dir, *overrides)), verbose=False)


def final_weights(result: TrainResult) -> dict[str, torch.Tensor]:
    assert result.checkpoint_path is not None
    return load_state(result.checkpoint_path)["model"]


DIGITS_DDP = ("scaling.num_workers=2", "train.max_steps=150", "train.log_every=25", "train.eval_every=75",
              "checkpoint.every=75")


@pytest.fixture(scope="module")
def digits_ddp(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory, digits_dir: str) -> TrainResult:
    """2-worker DDP on digits, tracked: the run whose MLflow record is read back, and local SGD's reference. Run as
    `orchestrator train --set ...` runs it, with the same flags: the command is the MLflow run's Source."""
    tmp_path = tmp_path_factory.mktemp("ddp")
    flags = [part for value in sets(tmp_path, digits_dir, *DIGITS_DDP) for part in ("--set", value)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["/venv/bin/orchestrator", "train", *flags])
        return run(tmp_path, digits_dir, *DIGITS_DDP)


def test_two_workers_learn_digits_and_mlflow_has_the_run(digits_ddp: TrainResult, digits_dir: str) -> None:
    from mlflow.tracking import MlflowClient

    result = digits_ddp
    assert result.metrics["val_accuracy"] >= 0.90
    assert result.metrics["world_size"] == 2 and result.metrics["step"] == 150
    assert [r["step"] for r in result.history] == [25, 50, 75, 100, 125, 150]
    # Every checkpoint it reported lies inside storage_path/name, where Ray Train (from a later release) requires it.
    saved = sorted(Path(result.run_dir).glob("checkpoint_*"))
    assert saved and result.checkpoint_path is not None and Path(result.checkpoint_path) in saved
    assert all(path.parent == Path(result.config.storage.path) / result.run_name for path in saved), saved

    client = MlflowClient(tracking_uri=result.tracking_uri)
    mlrun = client.get_run(result.run_id)
    assert mlrun.info.status == "FINISHED"
    params = mlrun.data.params
    assert params["optim.lr"] == "0.003" and params["scaling.num_workers"] == "2"
    assert params["model.num_classes"] == "10"  # resolved from the data, logged as resolved
    assert params["model.hidden"] == "[256, 256]"  # not in the config: the builder's default, logged all the same
    assert not [k for k, v in params.items() if v == "None"] and not [k for k in params if k.startswith("tune.")]
    # Metrics in sections, the headline three first; only series that change; no run-level figure is charted.
    metrics = mlrun.data.metrics
    for key in ("headline/train_loss", "headline/val_accuracy", "headline/train_samples_per_s", "train/lr",
                "train/grad_norm", "perf/data_wait_frac", "val/loss", "time/compute_frac"):
        assert key in metrics, key
    assert all("/" in k for k in metrics) and len(metrics) <= 30, sorted(metrics)
    constants = ("step", "worker_pid", "world_rank", "flops_per_sample", "grad_accum_steps", "global_batch",
                 "micro_batch_size", "elapsed_s")
    assert not {*constants, *map(mlflow_key, constants)} & set(metrics)
    assert not {"data_wait_frac", "time/data_wait_frac"} & set(metrics)  # one name: perf/data_wait_frac
    assert not [k for k in metrics if k.startswith(("startup/", "device/", "summary/", "at/", "train/step", "final/",
                                                    "cost/"))]
    for key in metrics:  # no constant is charted: every chart has two different values
        assert len({m.value for m in client.get_metric_history(result.run_id, key)}) > 1, key
    assert any(k.startswith("system/") and k.endswith("/memory_used_gb") for k in metrics)
    losses = client.get_metric_history(result.run_id, "headline/train_loss")
    assert [m.step for m in losses] == [25, 50, 75, 100, 125, 150]
    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"config.yaml", "plan.yaml", "learning_curves.png", "summary.json"} <= artifacts
    # The run's plan, as show-config --plan prints it: the step count the data decided, the rows the run read.
    plan = yaml.safe_load(Path(client.download_artifacts(result.run_id, "plan.yaml")).read_text())
    assert plan["training"]["steps"] == result.config.train.max_steps == 150
    assert plan["data"]["train"]["rows"] == pq.ParquetDataset(f"{digits_dir}/train").read().num_rows
    assert plan["run"]["place"] == result.run_dir and plan["model"]["outputs"] == 10
    # The run-level figures: one summary table (start-up, cost, whole-run shares, the facts the first report brought).
    table = read_summary(client, result.run_id)
    assert table["train/step"] == 150 and table["train/precision"] in ("bf16", "fp32")
    assert table["perf/flops_per_sample"] > 0 and table["train/global_batch"] == 128
    assert table["startup/total_s"] > 0 and table["cost/wall_s"] > table["startup/total_s"]
    assert table["final/val/accuracy"] == pytest.approx(result.metrics["val_accuracy"], rel=1e-3)  # 4 digits
    assert table["final/perf/samples_per_s"] == pytest.approx(
        run_summary(result.history)["summary/samples_per_s"], rel=1e-3)
    shares = [v for k, v in table.items() if k.startswith("final/time/") or k == "final/perf/data_wait_frac"]
    assert len(shares) >= 6 and sum(shares) == pytest.approx(1.0, abs=0.01)
    assert f"val_accuracy {table['final/val/accuracy']:.4g}" in mlrun.data.tags["mlflow.note.content"]
    datasets = {i.dataset.name for i in mlrun.inputs.dataset_inputs}
    assert datasets == {f"{Path(digits_dir).name}/train", f"{Path(digits_dir).name}/val"}
    # One name: the run's folder, its MLflow run, the summary's `finished` line (what --set changed, when it began).
    assert mlrun.info.run_name == Path(result.run_dir).name == result.run_name
    assert re.fullmatch(r"workers2-steps150-digits-mlp-\d{8}-\d{6}", result.run_name), result.run_name
    # Where it came from (the command, exact: a JOB's source is shown whole in the runs table's Source column, a
    # LOCAL one's text after its last slash), and the experiment the UI opens on its training-runs table.
    tags = mlrun.data.tags
    command = shlex.join(["orchestrator", "train", *(p for s in sets(Path(result.run_dir).parents[1], digits_dir,
                                                                       *DIGITS_DDP) for p in ("--set", s))])
    assert tags["orchestrator.command"] == command and tags["mlflow.source.name"] == command
    assert tags["mlflow.source.type"] == "JOB" and tags["mlflow.user"]
    assert tags.get("mlflow.source.git.commit") == git_commit(os.getcwd())  # absent outside a checkout
    experiment = client.get_experiment(mlrun.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    # The final weights as an MLflow Model of this run (MLflow 3 keeps its files with the logged model).
    logged = client.search_logged_models([mlrun.info.experiment_id])
    assert [m.name for m in logged if m.source_run_id == result.run_id and m.model_type != "checkpoint"] == ["model"]
    assert mlrun.data.tags["orchestrator.precision"] in ("bf16", "fp32")
    assert Path(result.run_dir, "config.yaml").is_file()  # the resolved config is saved with the run


def test_accumulation_across_two_workers_matches_one_worker(ray_cluster: None, tmp_path: Path) -> None:
    from pipelines.prepare import prepare_synthetic

    # 32 rows = one global batch: every step sees every row, however the rows are split across ranks.
    data = tmp_path / "data"
    prepare_synthetic(str(data), rows=32, shards=4, features=8, classes=3)
    common = [f"data.train={data}/train", "data.val=null", "data.features=[features]", "train.max_steps=4",
              "train.global_batch_size=32", "train.micro_batch_size=8", "train.precision=fp32",
              "train.log_every=2", "optim.warmup_steps=1", "optim.lr=0.05", "model.hidden=[16]",
              f"storage.path={tmp_path}/runs", "tracking.enabled=false"]
    two = train(load_config(None, [*common, "scaling.num_workers=2"]), verbose=False)
    one = train(load_config(None, [*common, "scaling.num_workers=1"]), verbose=False)
    assert two.config.train.grad_accum_steps == 2 and one.config.train.grad_accum_steps == 4
    a, b = final_weights(two), final_weights(one)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-5)
    assert not torch.equal(a["0.weight"], load_state_initial(tmp_path))


def load_state_initial(tmp_path: Path) -> torch.Tensor:
    from orchestrator.models.zoo import mlp

    torch.manual_seed(0)
    return mlp(8, 3, hidden=[16])[0].weight.detach()


def test_local_sgd_h8_matches_ddp_accuracy_with_fewer_bytes(digits_ddp: TrainResult, tmp_path: Path,
                                                            digits_dir: str) -> None:
    """The same run with its workers averaging every 8 steps instead of every step: DDP's validation accuracy
    (within 2 points) at the same number of samples, with ~8x fewer bytes all-reduced."""
    local = run(tmp_path, digits_dir, *DIGITS_DDP, "train.sync=local_sgd", "train.sync_every=8",
                "tracking.enabled=false")
    ddp = digits_ddp
    assert ddp.history[-1]["samples_seen"] == local.history[-1]["samples_seen"]
    assert local.metrics["val_accuracy"] >= ddp.metrics["val_accuracy"] - 0.02, (local.metrics, ddp.metrics)
    ratio = ddp.history[-1]["comm_bytes"] / local.history[-1]["comm_bytes"]
    # DDP: one gradient all-reduce of the parameters per step (150); local SGD: one parameter average per 8 steps
    # (18), the average evaluation and the checkpoint at step 75 see, and the last step's (the MLP has no buffers).
    assert ratio == pytest.approx(150 / 20), ratio


def test_streamed_validation_scores_every_row_once_at_an_odd_worker_count(ray_cluster: None, tmp_path: Path) -> None:
    """Validation that Ray Data streams (a shuffle buffer on the data, and data read from storage every epoch) scores
    each of its 301 rows once at 3 workers (an equal split would leave 301 mod 3 out; an odd world, the harder case
    of the ranks' strided split): the reported figures are the run's own final model's over every row, computed
    here with plain torch."""
    import numpy as np

    from orchestrator.models.zoo import mlp
    from pipelines.prepare import prepare_synthetic

    workers, data = 3, tmp_path / "data"
    prepare_synthetic(str(data), rows=240, shards=4, features=8, classes=3, val_rows=301)
    val = pq.read_table(data / "val")
    for old in (data / "val").iterdir():  # three files, so that the rows come in several blocks
        old.unlink()
    for i, (start, count) in enumerate([(0, 100), (100, 120), (220, 81)]):
        pq.write_table(val.slice(start, count), data / "val" / f"part-{i:05d}.parquet")
    result = train(load_config(None, [
        f"data.train={data}/train", f"data.val={data}/val", "data.features=[features]", "data.shuffle_buffer=64",
        "data.cache=none", f"scaling.num_workers={workers}", "train.global_batch_size=48", "train.micro_batch_size=8",
        "train.max_steps=6", "train.log_every=3", "train.eval_every=6", "checkpoint.every=6",
        "train.precision=fp32", "optim.warmup_steps=1", "optim.lr=0.05", "model.hidden=[16]",
        f"storage.path={tmp_path}/runs", "tracking.enabled=false"]), verbose=False)
    assert result.metrics["world_size"] == workers and result.metrics["step"] == 6
    model = mlp(8, 3, hidden=[16])
    model.load_state_dict(final_weights(result))
    x = torch.tensor(np.array(val.column("features").to_pylist(), dtype=np.float32))
    y = torch.tensor(val.column("label").to_numpy())
    assert len(y) == 301
    with torch.no_grad():
        logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits, y, reduction="sum").item() / 301
    correct = int((logits.argmax(dim=1) == y).sum())
    assert result.metrics["val_loss"] == pytest.approx(loss, rel=1e-5), (result.metrics["val_loss"], loss)
    assert result.metrics["val_accuracy"] == pytest.approx(correct / 301, abs=1e-12), (
        result.metrics["val_accuracy"] * 301, correct)


def test_failure_budget_spent_is_one_clear_error(ray_cluster: None, tmp_path: Path, digits_dir: str) -> None:
    from mlflow.tracking import MlflowClient

    from orchestrator.run.trainer import RunFailedError

    marker = tmp_path / "crashed"
    with pytest.raises(RunFailedError, match="training failed") as info:
        run(tmp_path, digits_dir, "scaling.num_workers=1", "train.max_steps=20", "optim.warmup_steps=5",
            "failure.max_failures=0", "model.entrypoint=faulty_model:build", f"model.marker={marker}",
            "model.after_calls=3")
    assert "run directory" in str(info.value)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns.db")
    runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
