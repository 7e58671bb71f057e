"""A real study on local Ray: 4 trials on digits with ASHA, each a 1-worker Ray Train run; the MLflow record read
back through MlflowClient; best.yaml trained as written; re-running continues the study instead of redoing it."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from orchestrator import load_config, train, tune
from orchestrator.config import Config
from orchestrator.errors import ConfigError
from orchestrator.study import TuneResult

pytestmark = pytest.mark.slow


def study_config(tmp_path: Path, digits_dir: str, *overrides: str) -> Config:
    return load_config(None, [
        f"data.train={digits_dir}/train", f"data.val={digits_dir}/val", f"storage.path={tmp_path}/runs",
        f"tracking.uri=sqlite:///{tmp_path}/mlruns.db", "tracking.experiment=tune-tests", "experiment=digits-t",
        "scaling.num_workers=1", "model.hidden=[64]", "train.max_steps=40", "train.log_every=10",
        "train.eval_every=10", "checkpoint.every=40",
        "tune.space.optim.lr.loguniform=[1e-4, 1e-1]", "tune.space.optim.warmup_steps.choice=[0, 10]",
        "tune.num_samples=4", "tune.grace_period=10", "tune.reduction_factor=2", "tune.seed=3",
        "tune.max_concurrent_trials=2", "cost.price_per_hour=2.0", *overrides])


@pytest.fixture(scope="module")
def study(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory, digits_dir: str) -> tuple[TuneResult, Path]:
    tmp_path = tmp_path_factory.mktemp("tune")
    return tune(study_config(tmp_path, digits_dir), verbose=False), tmp_path


def test_best_trial_is_the_best_completed_one(study: tuple[TuneResult, Path]) -> None:
    result, _ = study
    assert len(result.trials) == 4
    assert {t.status for t in result.trials} <= {"completed", "stopped"}
    completed = [t for t in result.trials if t.status == "completed"]
    assert completed and all(t.steps == 40 for t in completed)
    assert all(t.steps < 40 for t in result.trials if t.status == "stopped")
    assert result.mode == "max" and result.best.status == "completed"
    assert result.best.metric == max(t.metric for t in completed)  # type: ignore[type-var]
    assert result.best.metric is not None and result.best.metric > 0.5
    # Every trial has the searched values and its learning curve.
    for t in result.trials:
        assert 1e-4 <= t.params["optim.lr"] <= 1e-1 and t.params["optim.warmup_steps"] in (0, 10)
        assert [r["step"] for r in t.history] == list(range(10, t.steps + 1, 10))


def test_mlflow_parent_and_child_runs_all_end(study: tuple[TuneResult, Path]) -> None:
    from mlflow.tracking import MlflowClient

    result, _ = study
    client = MlflowClient(result.tracking_uri)
    parent = client.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["orchestrator.best_trial"] == result.best.trial_id
    assert parent.data.params["tune.space.optim.lr.loguniform"] == "[0.0001, 0.1]"
    assert parent.data.metrics["best_val_accuracy"] == pytest.approx(result.best.metric)
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"best.yaml", "plots", "study.yaml"}
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "plots")} == {
        "plots/metric_vs_lr.png", "plots/learning_curves.png"}

    experiment = client.get_experiment_by_name("tune-tests").experiment_id
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{result.parent_run_id}'")
    by_trial = {r.data.tags["orchestrator.trial_id"]: r for r in children}
    assert set(by_trial) == {t.trial_id for t in result.trials}
    for t in result.trials:
        run = by_trial[t.trial_id]
        assert run.info.status == "FINISHED"  # never left RUNNING, even when ASHA killed the trial's actor
        assert run.data.tags["orchestrator.stop_reason"] == ("max_steps" if t.status == "completed" else "asha")
        assert float(run.data.params["optim.lr"]) == pytest.approx(t.params["optim.lr"])
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy")]
        assert steps == list(range(10, t.steps + 1, 10))


def test_every_trial_and_the_study_have_a_cost(study: tuple[TuneResult, Path]) -> None:
    from mlflow.tracking import MlflowClient

    result, _ = study
    usds = [t.usd for t in result.trials]
    assert all(u is not None and u > 0 for u in usds)
    client = MlflowClient(result.tracking_uri)
    parent = client.get_run(result.parent_run_id).data.metrics
    assert parent["cost/usd"] == pytest.approx(sum(usds))  # type: ignore[arg-type]
    assert 0 < parent["cost/productive_frac"] < 1
    experiment = client.get_experiment_by_name("tune-tests").experiment_id
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{result.parent_run_id}'")
    assert all(r.data.metrics.get("cost/usd", 0) > 0 for r in children)


def test_best_yaml_validates_and_trains(study: tuple[TuneResult, Path]) -> None:
    result, tmp_path = study
    config = load_config(result.best_config_path)
    assert config.optim.lr == pytest.approx(result.best.params["optim.lr"])
    assert config.optim.warmup_steps == result.best.params["optim.warmup_steps"]
    trained = train(config, verbose=False)
    assert trained.metrics["step"] == 40
    # Same config, same seed, one worker with the same thread count, the same data order on the same CPU: the
    # retrained run is the trial again, step for step. Its metric is the trial's exactly (both come from the same
    # float; a correct-count ratio); the learning curve too, up to the last digit of Tune's CSV round trip.
    assert trained.metrics["val_accuracy"] == result.best.metric
    keys = ("step", "train_loss", "val_loss", "val_accuracy")
    assert len(trained.history) == len(result.best.history) == 4
    for ours, trial in zip(trained.history, result.best.history, strict=True):
        assert {k: ours[k] for k in keys} == pytest.approx({k: trial[k] for k in keys}, rel=1e-12, abs=0)


def test_rerunning_continues_the_study_and_a_changed_one_is_refused(study: tuple[TuneResult, Path],
                                                                    digits_dir: str) -> None:
    result, tmp_path = study
    again = tune(study_config(tmp_path, digits_dir), verbose=False)
    assert again.resumed and again.parent_run_id == result.parent_run_id
    assert {t.trial_id for t in again.trials} == {t.trial_id for t in result.trials}
    assert again.best.trial_id == result.best.trial_id
    with pytest.raises(ConfigError, match=r"different config \(tune.num_samples differ\).*--fresh"):
        tune(study_config(tmp_path, digits_dir, "tune.num_samples=5"), verbose=False)


def test_a_study_on_s3_keeps_its_state_and_trials_there_and_resumes(
        ray_cluster: None, tmp_path: Path, digits_dir: str, moto: Any, aws_env: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3
    import ray

    # Each process resolves its own credentials from the standard chain: the Ray cluster's processes got theirs
    # when it started (conftest), the driver has distinctive ones, which must not end up anywhere it writes.
    canary = {"AWS_ACCESS_KEY_ID": "AKIASTUDYCANARY12345", "AWS_SECRET_ACCESS_KEY": "SECRET-canary-study-31415926",
              "AWS_SESSION_TOKEN": "TOKEN-canary-study-27182818"}
    for name, value in canary.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)  # best.yaml of a study on S3 is written to ./<study>/
    bucket = f"studies-{uuid.uuid4().hex[:10]}"
    s3 = boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    config = study_config(tmp_path, digits_dir, "experiment=digits-s3", f"storage.path=s3://{bucket}/runs",
                          f"data.s3.endpoint={moto.url}", "tune.num_samples=2",
                          "train.max_steps=20", "checkpoint.every=10", "optim.warmup_steps=0")
    result = tune(config, verbose=False)
    assert result.study_path == f"s3://{bucket}/runs/digits-s3-tune"
    assert {t.status for t in result.trials} <= {"completed", "stopped"}
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", [])]
    assert "runs/digits-s3-tune/orchestrator-study.json" in keys
    for t in result.trials:  # each trial's Train run checkpointed into the bucket, beside the study
        assert any(k.startswith(f"runs/digits-s3-tune-trials/{t.trial_id}/checkpoint_000000") for k in keys), t
    assert not (tmp_path / "runs").exists()
    assert load_config(result.best_config_path).optim.lr == pytest.approx(result.best.params["optim.lr"])

    again = tune(config, verbose=False)  # Tune restores the study from the bucket
    assert again.resumed and again.parent_run_id == result.parent_run_id
    assert {t.trial_id for t in again.trials} == {t.trial_id for t in result.trials}

    # No credential in anything the study wrote: the bucket (tuner.pkl, trial state, checkpoints), the local
    # directory (best.yaml, the MLflow database) and the Ray session's logs.
    blobs = {f"s3://{bucket}/{o['Key']}": s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
             for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket) for o in page.get("Contents", [])}
    assert f"s3://{bucket}/runs/digits-s3-tune/tuner.pkl" in blobs and len(blobs) > 10
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    files = [p for root in (tmp_path, session / "logs") for p in root.rglob("*") if p.is_file()]
    assert any(p.name == "mlruns.db" for p in files)
    blobs.update({str(p): p.read_bytes() for p in files})
    for value in (*canary.values(), "testing-secret"):
        assert not [name for name, blob in blobs.items() if value.encode() in blob], value


def test_trials_wider_than_the_cluster_are_refused(ray_cluster: None, tmp_path: Path, digits_dir: str) -> None:
    config = study_config(tmp_path, digits_dir, "scaling.num_workers=8", "train.global_batch_size=128")
    with pytest.raises(ConfigError, match="a trial needs 8 CPUs .* the Ray cluster has 4"):
        tune(config, verbose=False)
    assert not (tmp_path / "runs").exists()  # refused before any trial (or study state) was created


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
