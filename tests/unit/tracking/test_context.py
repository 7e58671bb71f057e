"""What an MLflow run holds, without Ray: the loop's names under namespaced keys (the headline three in their own
section), constants and run-level figures in the summary table instead of charted, the resolved config with the
model's defaults as params, where the run came from as tags, the experiment's kind, and the run's page in the UI. One
real SQLite store, written and read back through MlflowClient."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from orchestrator.config import TrackingConfig, load_config
from orchestrator.tracking.client import MlflowTracker
from orchestrator.tracking.context import changed_keys, config_params, git_commit, source_name, source_type
from orchestrator.tracking.links import run_url
from orchestrator.tracking.read import read_metrics, read_summary
from orchestrator.tracking.view import logged_as, mlflow_key

# What rank 0's reports hold (training/loop.py, worker.py: the first report of a start carries its facts), as the
# driver hands them to the tracker (launch.py: `at/*` already taken for the start-up breakdown, `elapsed_s` added).
FIRST_REPORT = {
    "step": 25, "epoch": 0, "samples_seen": 3200, "train_loss": 1.7, "lr": 3e-3, "grad_norm": 0.9,
    "skipped_steps": 0, "nonfinite_skipped": 0, "oom_retries": 0, "micro_batch_size": 64, "world_size": 2,
    "comm_bytes": 1e6, "comm_bytes_per_sample": 400.0, "interval_s": 0.5, "samples_per_s": 6400.0,
    "train_samples_per_s": 6500.0,
    "time/compute_frac": 0.6, "time/sync_frac": 0.1, "time/data_wait_frac": 0.1, "time/eval_frac": 0.0,
    "time/checkpoint_frac": 0.0, "time/report_frac": 0.0, "time/other_frac": 0.2, "data_wait_frac": 0.1,
    "flops_per_sample": 1.2e5, "system/vm/cpu_percent": 50.0, "system/vm/memory_used_gb": 3.0,
    "precision": "bf16", "grad_accum_steps": 1, "global_batch": 128, "worker_pid": 4242, "world_rank": 0,
    "device/cuda": 0.0, "elapsed_s": 12.0,
}
CONSTANTS = ("worker_pid", "world_rank", "flops_per_sample", "precision", "grad_accum_steps", "global_batch",
             "device/cuda", "micro_batch_size", "elapsed_s", "step")


def test_the_loops_names_map_to_namespaced_keys_and_mapping_a_key_again_keeps_it() -> None:
    assert {name: mlflow_key(name) for name in ("train_loss", "lr", "grad_norm", "val_loss", "val_accuracy",
                                                  "samples_per_s", "tokens_per_s", "mfu", "time/compute_frac")} == {
        "train_loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "val_loss": "val/loss",
        "val_accuracy": "val/accuracy", "samples_per_s": "perf/samples_per_s", "tokens_per_s": "perf/tokens_per_s",
        "mfu": "perf/mfu", "time/compute_frac": "time/compute_frac"}
    # The data-wait share had four names: one per interval, one for the whole run.
    assert {mlflow_key(n) for n in ("data_wait_frac", "time/data_wait_frac")} == {"perf/data_wait_frac"}
    assert {mlflow_key(n) for n in ("summary/data_wait_frac", "summary/time/data_wait_frac")} == {
        "final/perf/data_wait_frac"}
    names = [*FIRST_REPORT, "summary/samples_per_s", "summary/val_accuracy", "cost/usd", "startup/total_s",
             "best_val_accuracy", "memory/peak_allocated_gb", "system/vm/cpu_percent"]
    assert all(mlflow_key(mlflow_key(name)) == mlflow_key(name) for name in names)  # tests may map twice


def test_constants_are_not_charted() -> None:
    for name in CONSTANTS:
        assert logged_as(mlflow_key(name)) != "metric", name
    # Run-level figures (once per run) are rows of the summary table, never one-point charts.
    for name in ("startup/total_s", "cost/wall_s", "cost/startup_frac", "summary/time/compute_frac", "at/loop",
                 "summary/samples_per_s", "summary/val_accuracy", "cost/usd", "cost/productive_frac",
                 "study/best_val_accuracy", "study/trials_completed"):
        assert logged_as(mlflow_key(name)) != "metric", name
    for name in ("train_loss", "val_accuracy", "samples_per_s", "time/data_wait_frac", "system/vm/cpu_percent",
                 "memory/allocated_gb"):
        assert logged_as(mlflow_key(name)) == "metric", name


def test_a_run_holds_short_metrics_a_summary_table_params_and_tags(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # not a git checkout: no commit tag, and no error
    uri = f"sqlite:///{tmp_path}/mlruns.db"
    config = load_config(None, [f"tracking.uri={uri}", "tracking.experiment=keys"])
    tracker = MlflowTracker(config.tracking, "keys-run", headline=config.tune.metric)
    tracker.log_params(config_params(config))
    tracker.log_metrics({"startup/total_s": 9.5, "startup/command_s": 1.0}, step=25)
    tracker.log_metrics(FIRST_REPORT, step=25)
    # The series change from report to report (the facts do not); validation comes at steps 50 and 75.
    later = {"lr": 2e-3, "grad_norm": 0.7, "samples_per_s": 6500.0, "time/compute_frac": 0.65,
             "time/data_wait_frac": 0.05, "data_wait_frac": 0.05, "system/vm/cpu_percent": 55.0}
    tracker.log_metrics({**FIRST_REPORT, **later, "step": 50, "train_loss": 1.2, "val_loss": 0.5,
                         "val_accuracy": 0.9, "worker_pid": 4343}, step=50)
    tracker.log_metrics({**FIRST_REPORT, **later, "step": 75, "train_loss": 1.1, "val_loss": 0.4,
                         "val_accuracy": 0.92, "lr": 1e-3, "worker_pid": 4343}, step=75)
    tracker.log_metrics({"summary/samples_per_s": 6000.0, "summary/time/data_wait_frac": 0.1,
                         "summary/val_accuracy": 0.9, "cost/wall_s": 20.0, "cost/productive_frac": 0.4,
                         "cost/startup_frac": 0.45, "train_loss": float("nan")}, step=75)
    tracker.finish("FINISHED")

    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    metrics = run.data.metrics
    assert {"headline/train_loss", "train/lr", "train/grad_norm", "val/loss", "headline/val_accuracy",
            "headline/train_samples_per_s", "perf/samples_per_s", "perf/data_wait_frac", "time/compute_frac",
            "system/vm/cpu_percent"} <= set(metrics)
    assert not [k for k in metrics if "/" not in k], metrics  # every key in a section
    charted_constants = {mlflow_key(name) for name in CONSTANTS} | set(CONSTANTS) | {"time/data_wait_frac"}
    assert not charted_constants & set(metrics)
    # Run-level figures and series that never changed (comm bytes per sample, an idle phase) are not charted.
    assert not [k for k in metrics if k.startswith(("startup/", "device/", "summary/", "at/", "final/", "cost/"))]
    assert not {"perf/comm_bytes_per_sample", "time/eval_frac", "system/vm/memory_used_gb"} & set(metrics)
    assert [m.step for m in client.get_metric_history(tracker.run_id, "headline/train_loss")] == [25, 50, 75]

    summary = read_summary(client, tracker.run_id)
    assert summary["train/worker_pid"] == 4343 and summary["train/precision"] == "bf16"  # the last value
    assert summary["perf/flops_per_sample"] == 1.2e5 and summary["startup/total_s"] == 9.5
    assert summary["final/perf/samples_per_s"] == 6000.0 and summary["cost/productive_frac"] == 0.4
    assert summary["perf/comm_bytes_per_sample"] == 400.0 and summary["time/eval_frac"] == 0.0
    assert summary["train/step"] == 75 and "world_rank" not in summary and "elapsed_s" not in summary
    logged = json.loads(run.data.tags["mlflow.loggedArtifacts"])
    assert {"path": "summary.json", "type": "table"} in logged  # the UI lists it as a table
    table = json.loads(Path(client.download_artifacts(tracker.run_id, "summary.json", str(tmp_path))).read_text())
    assert table["columns"] == ["section", "figure", "value"] and len(table["data"]) == len(summary)
    # What doctor reads: histories of metrics (under their own keys), and the table's numbers as one-value ones.
    histories = read_metrics(client, tracker.run_id)
    assert histories[mlflow_key("train_loss")] == [1.7, 1.2, 1.1]
    assert histories[mlflow_key("flops_per_sample")] == [1.2e5]
    assert histories[mlflow_key("summary/time/data_wait_frac")] == [0.1] and histories[mlflow_key("step")] == [75]

    params = run.data.params
    assert params["model.hidden"] == "[256, 256]" and params["model.dropout"] == "0.0"  # the builder's defaults
    assert params["optim.lr"] == "0.003" and params["tracking.experiment"] == "keys"

    tags = run.data.tags
    assert tags["mlflow.source.type"] == "LOCAL" and tags["mlflow.source.name"] and tags["mlflow.user"]
    assert "mlflow.source.git.commit" not in tags
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    assert run_url(uri, tracker.run_id) == (f"http://127.0.0.1:5055/#/experiments/{run.info.experiment_id}/runs/"
                                            f"{tracker.run_id}/model-metrics?workflowType=machine_learning")

    # Reopened (a resume): the table is replaced, not appended to; an experiment made elsewhere gets its kind.
    again = MlflowTracker(config.tracking, "keys-run", run_id=tracker.run_id, headline=config.tune.metric)
    again.log_metrics({"startup/total_s": 7.0, "train_loss": 1.0, "step": 90}, step=90)
    again.flush()  # the writer's thread writes a second later: now, to read the run mid-way
    assert read_metrics(client, tracker.run_id)[mlflow_key("step")] == [75]  # until the run ends: the last table's
    assert read_metrics(client, tracker.run_id)["train/loss"][-1] == 1.0  # charted before: charted at once
    again.finish("FINISHED")
    assert read_summary(client, tracker.run_id) == {"startup/total_s": 7.0, "train/step": 90}
    going = MlflowTracker(config.tracking, "still-going")
    going.log_metrics({"train_loss": 1.0, "step": 30, "flops_per_sample": 1.0}, step=30)
    going.log_metrics({"train_loss": 0.9, "step": 40}, step=40)
    going.flush()
    assert read_metrics(client, going.run_id) == {"train/loss": [1.0, 0.9], "train/step": [40.0]}  # no table yet
    other = client.create_experiment("made-elsewhere")
    MlflowTracker(TrackingConfig(uri=uri, experiment="made-elsewhere"), "x").finish("FINISHED")
    assert client.get_experiment(other).tags["mlflow.experimentKind"] == "custom_model_development"


def test_model_options_default_to_the_builders_and_the_config_wins() -> None:
    assert config_params(load_config(None, ["model.hidden=[16]"]))["model.hidden"] == [16]
    assert config_params(load_config(None, ["model.hidden=null"]))["model.hidden"] == [256, 256]
    cnn = config_params(load_config(None, ["model.name=cnn"]))
    assert cnn["model.channels"] == [16, 32] and cnn["model.hidden"] == 128 and "model.in_features" not in cnn
    unknown = config_params(load_config(None, ["model.entrypoint=no_such_module:build"]))
    assert unknown["model.entrypoint"] == "no_such_module:build"  # nothing to add, and no error


def test_source_tags_and_the_run_url() -> None:
    assert source_name(["/x/.venv/bin/orchestrator", "train", "--config", "examples/digits.yaml"]) == (
        "orchestrator train --config examples/digits.yaml")
    assert source_name(["/x/orchestrator/__main__.py", "tune"]) == "orchestrator tune"
    assert source_name(["/home/me/train_script.py", "--fast"]) == "/home/me/train_script.py"
    # What the command changed, for the run's name: its --set keys (any spelling argparse takes) and --autopilot.
    argv = ["/x/.venv/bin/orchestrator", "train", "--config", "a.yaml", "--set", "optim.lr=1e-3", "-s", "train.seed=2",
            "--set=model.hidden=[8]", "-sscaling.num_workers=1", "--autopilot"]
    assert changed_keys(argv) == ["optim.lr", "train.seed", "model.hidden", "scaling.num_workers", "autopilot.enabled"]
    assert changed_keys(["/home/me/train_script.py", "--set", "optim.lr=1"]) == []  # not the orchestrator's flags
    # A JOB (an orchestrator command: a Ray Train job; or any Ray job), whose Source the UI shows whole; a script
    # run by hand is LOCAL, which the UI shows by its file name.
    assert source_type(["/x/.venv/bin/orchestrator", "train"], {}) == "JOB"
    assert source_type(["/home/me/train_script.py"], {}) == "LOCAL"
    assert source_type(["/home/me/train_script.py"], {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}) == "JOB"  # a dict
    assert run_url("http://mlflow.internal:5000/", "abc", "7", tab="overview") == (
        "http://mlflow.internal:5000/#/experiments/7/runs/abc?workflowType=machine_learning")
    assert run_url("sqlite:////tmp/m.db", "abc", "7") == (
        "http://127.0.0.1:5055/#/experiments/7/runs/abc/model-metrics?workflowType=machine_learning")
    assert run_url("sqlite:////tmp/m.db", "never-tracked-here") is None


def test_the_commit_is_the_checkouts_head() -> None:
    root = Path(__file__).resolve().parents[3]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    expected = head.stdout.strip() if head.returncode == 0 else None
    assert git_commit(str(root)) == expected


def test_the_runs_source_is_what_the_command_saw_before_ray_started(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ray job's entrypoint runs in the job's unpacked working_dir, and `ray.init` there can remove it while the
    MLflow run opens alongside (tests/integration/test_cluster_jobs.py): the command's context is taken before Ray
    starts and the run gets that one, not what the working directory holds when it opens."""
    from mlflow.tracking import MlflowClient

    from orchestrator.tracking.context import context_tags

    checkout = tmp_path / "checkout"
    checkout.mkdir()
    git = ["git", "-c", "user.email=u@example.com", "-c", "user.name=u"]
    subprocess.run([*git, "init", "-q"], cwd=checkout, check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "c"], cwd=checkout, check=True)
    monkeypatch.chdir(checkout)
    context = context_tags()  # what the command saw
    assert len(context["mlflow.source.git.commit"]) == 40
    monkeypatch.chdir(tmp_path)  # no checkout here: read at opening, the run would have no commit
    uri = f"sqlite:///{tmp_path}/mlruns.db"
    tracker = MlflowTracker(TrackingConfig(uri=uri, experiment="jobs"), "job-run", context=context)
    tracker.finish("FINISHED")
    tags = MlflowClient(uri).get_run(tracker.run_id).data.tags
    assert {k: tags.get(k) for k in context} == context
