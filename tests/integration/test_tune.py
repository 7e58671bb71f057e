"""A real study on local Ray: 4 trials on digits with ASHA, each a 1-worker Ray Train run, started as a user starts
it (`python -m orchestrator tune` on its own local cluster) and read back through `tune()`; the MLflow record read
back through MlflowClient; best.yaml trained as written; re-running continues the study instead of redoing it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from orchestrator import load_config, train, tune
from orchestrator.config import Config
from orchestrator.errors import ConfigError
from orchestrator.report.console import LOG_FILE
from orchestrator.tracking.read import read_summary
from orchestrator.tuning.results import TuneResult
from orchestrator.tuning.search import TrialNamer, peak_concurrency

pytestmark = pytest.mark.slow


def study_overrides(tmp_path: Path, digits_dir: str, *overrides: str) -> list[str]:
    return [
        f"data.train={digits_dir}/train", f"data.val={digits_dir}/val", f"storage.path={tmp_path}/runs",
        f"tracking.uri=sqlite:///{tmp_path}/mlruns.db", "tracking.experiment=tune-tests", "experiment=digits-t",
        "scaling.num_workers=1", "model.hidden=[64]", "train.max_steps=40", "train.log_every=10",
        "train.eval_every=10", "checkpoint.every=40",
        "tune.space.optim.lr.loguniform=[1e-4, 1e-1]", "tune.space.optim.warmup_steps.choice=[0, 10]",
        "tune.num_samples=4", "tune.grace_period=10", "tune.reduction_factor=2", "tune.seed=3",
        "tune.max_concurrent_trials=2", "cost.price_per_hour=2.0", "train.micro_batch_size=auto", *overrides]


def study_config(tmp_path: Path, digits_dir: str, *overrides: str) -> Config:
    return load_config(None, study_overrides(tmp_path, digits_dir, *overrides))


@pytest.fixture(scope="module")
def study_cli(tmp_path_factory: pytest.TempPathFactory, digits_dir: str) -> tuple[Path, str, str]:
    """The study as the command runs it, on the private local cluster it starts (before this module's own
    cluster, so two never run at once): (tmp_path, stdout, stderr)."""
    tmp_path = tmp_path_factory.mktemp("tune")
    args = [a for o in study_overrides(tmp_path, digits_dir) for a in ("--set", o)]
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "orchestrator", "tune", *args], capture_output=True, text=True,
                         cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (tmp_path / "stopwatch_s").write_text(str(time.monotonic() - started))  # around the command, as a user's
    print(f"orchestrator tune: {time.monotonic() - started:.0f} s, {len(out.stdout.splitlines())} stdout lines, "
          f"{len(out.stderr.splitlines())} stderr lines")
    return tmp_path, out.stdout, out.stderr


@pytest.fixture(scope="module")
def study(study_cli: tuple[Path, str, str], digits_dir: str, request: pytest.FixtureRequest
          ) -> tuple[TuneResult, Path]:
    """The command's study read back in this process: `tune()` again continues it, and with every trial ended
    only returns its result."""
    tmp_path = study_cli[0]
    request.getfixturevalue("ray_cluster")
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


def test_no_more_trials_ran_at_once_than_the_study_allows(study: tuple[TuneResult, Path],
                                                          study_cli: tuple[Path, str, str]) -> None:
    """tune.max_concurrent_trials=2, measured on Ray Tune's own record of when each trial started and when its last
    result came in (the study ran 4 at once when Ray ignored the setting). The cap is the guarantee: whether two
    trials did overlap depends on the machine's speed, so the study is checked to have been allowed 2 at once."""
    result, _ = study
    spans = [(t.started_at, t.ended_at) for t in result.trials]
    assert all(start is not None and end is not None and start < end for start, end in spans), spans
    peak = peak_concurrency(spans)  # type: ignore[arg-type]
    assert 1 <= peak <= 2, spans
    # Its own cluster (at least 3 CPUs: 1 kept for Ray Data, 1 per trial) holds 2 trials: the setting is the bound.
    assert "up to 2 trials at once (bound by tune.max_concurrent_trials=2)" in study_cli[1]
    assert f"4 trials (at most {peak} at once)" in study_cli[1]  # the summary reports what was measured
    assert "max_concurrent_trials" not in study_cli[2]  # Ray's warning that it ignores the setting


def test_one_worker_trials_train_in_their_own_tune_process(study: tuple[TuneResult, Path]) -> None:
    """No worker group per 1-worker trial: the loop runs in the Tune trial's own process (the worker pid of its first
    report is the pid Tune records for the trial) and checkpoints through Tune into the trial's directory."""
    import pyarrow.fs

    from orchestrator.training.checkpoint import check_complete, manifest_step

    result, tmp_path = study
    runs = tmp_path / "runs"
    assert not (runs / "digits-t-tune-trials").exists()  # no Ray Train run was started for any trial
    local = pyarrow.fs.LocalFileSystem()
    for t in result.trials:
        trial_dir = runs / "digits-t-tune" / f"{t.trial_id}_{t.name}"
        first = json.loads((trial_dir / "result.json").read_text().splitlines()[0])
        assert first["worker_pid"] == first["pid"] and first["world_size"] == 1
        steps = sorted(manifest_step(local, str(c)) for c in trial_dir.glob("checkpoint_*")
                       if check_complete(local, str(c)) is None)
        assert steps == ([40] if t.status == "completed" else []), (t.status, steps)  # checkpoint.every=40


def test_a_one_worker_trial_killed_mid_checkpoint_resumes_through_tune_to_the_clean_trials_figures(
        ray_cluster: None, tmp_path: Path, digits_dir: str) -> None:
    """The same resume and exactness in the trial's own process: a trial whose process is SIGKILLed halfway through
    writing its second checkpoint is restarted by Tune from its first (failure.max_failures) and reports, step for
    step, what a trial that never failed reports (same config otherwise, same seed)."""
    marker = tmp_path / "killed"
    config = study_config(tmp_path, digits_dir, "experiment=digits-kill", "tracking.enabled=false",
                          "model.entrypoint=fault_model:build", "model.hidden=null", f"model.marker={marker}",
                          "train.max_steps=30", "checkpoint.every=10", "failure.max_failures=1",
                          "tune.space={model.die_in_checkpoint: {grid: [0, 2]}}", "tune.num_samples=1",
                          "tune.scheduler=fifo", "tune.grace_period=null", "tune.reduction_factor=null")
    result = tune(config, verbose=False)
    assert marker.exists()  # the kill happened (once: the marker stops a second)
    killed, clean = sorted(result.trials, key=lambda t: -t.params["model.die_in_checkpoint"])
    assert killed.status == clean.status == "completed" and killed.steps == 30
    keys = ("step", "train_loss", "val_loss", "val_accuracy")
    assert [r["step"] for r in clean.history] == [10, 20, 30]
    # Step for step the clean trial's figures from the resume on. Tune's record of the report before the kill
    # (step 10) goes with the killed process when Tune had not collected it yet (seen on a loaded machine).
    killed_rows = [{k: r[k] for k in keys} for r in killed.history]
    assert [r["step"] for r in killed_rows][-2:] == [20, 30]
    assert killed_rows == [{k: r[k] for k in keys} for r in clean.history][-len(killed_rows):]
    # Resumed from its step-10 checkpoint, not started over: the new process reported from step 20 on.
    (results,) = (tmp_path / "runs" / "digits-kill-tune").glob(f"{killed.trial_id}_*/result.json")
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["step"] for r in lines][-2:] == [20, 30] and lines[-2]["pid"] == lines[-1]["pid"]
    assert all(r["pid"] != lines[-1]["pid"] for r in lines[:-2])
    # Its cost counts the time the kill lost (Tune rewinds time_total_s to the checkpoint it restarts from; that
    # cost 4.7 s of 17.8 s here): each trial's ledger covers the span Tune's driver saw it run, from its start to its
    # last result. When Tune had collected the report before the kill, the gap to the restarted process's first
    # report is recovery.
    for t in (clean, killed):
        assert t.started_at is not None and t.ended_at is not None and t.cost is not None
        assert t.cost.wall_s == pytest.approx(t.ended_at - t.started_at, abs=0.5), (t.label, t.cost.seconds)
        assert sum(t.cost.seconds.values()) == pytest.approx(t.cost.wall_s)
    assert clean.cost.seconds["recovery"] == 0
    assert (killed.cost.seconds["recovery"] > 0) == (killed_rows[0]["step"] == 10), killed.cost.seconds


def test_a_second_trial_in_the_same_actor_starts_as_a_fresh_process_would(ray_cluster: None, tmp_path: Path,
                                                                          digits_dir: str) -> None:
    """Two one-worker trials, one at a time, so the second runs in the first one's reused actor (reuse_actors), with
    the other train.flush_denormal. The model records at its build what the trial inherited (trial_state_model.py)
    and then changes it: the second trial must find what the first found in its fresh process (its own setting
    aside), and no epoch clock but its own (streamed data: each run's reader has one)."""
    log = tmp_path / "state.jsonl"
    config = study_config(tmp_path, digits_dir, "experiment=digits-reuse", "tracking.enabled=false",
                          "model.entrypoint=trial_state_model:build", "model.hidden=null", f"model.log={log}",
                          "data.cache=none", "train.max_steps=20", "checkpoint.every=20", "optim.warmup_steps=0",
                          "tune.space={train.flush_denormal: {grid: [true, false]}}", "tune.num_samples=1",
                          "tune.max_concurrent_trials=1", "tune.scheduler=fifo", "tune.grace_period=null",
                          "tune.reduction_factor=null")
    result = tune(config, verbose=False)
    assert {t.status for t in result.trials} == {"completed"}
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 2, records
    first, second = records
    assert first["pid"] == second["pid"], "the actor was not reused: the test proves nothing"
    flush = {t.trial_id: t.params["train.flush_denormal"] for t in result.trials}
    assert flush[first["trial"]] is True and flush[second["trial"]] is False
    # The first trial's own clock only: the first trial's was released when it ended.
    assert first["clocks"] == [c for c in first["clocks"] if first["trial"] in c] and len(first["clocks"]) == 1
    assert len(second["clocks"]) == 1 and second["trial"] in second["clocks"][0], second["clocks"]
    # What a fresh process has (the first trial's record, in the actor's fresh process), but its own flush setting.
    fresh = {k: first[k] for k in ("dtype", "threads", "compiles")}
    assert {k: second[k] for k in fresh} == fresh == {"dtype": "torch.float32", "threads": first["threads"],
                                                      "compiles": True}
    assert (first["flushed"], second["flushed"]) == (1.0, 0.0)


def test_a_study_with_the_autopilot_searches_once_and_every_trial_trains_with_its_choice(
        ray_cluster: None, tmp_path: Path, digits_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Three trials, two at a time, from a poor micro-batch (8 of 64): the first trial to start runs the autopilot's
    search on its own steps while the other waits; every other trial trains with the choice from its first step and
    searches nothing. The study's MLflow run holds the choice as params; a continued study keeps it."""
    from mlflow.tracking import MlflowClient

    from orchestrator.tuning.study import STATE_FILE

    overrides = ["experiment=digits-ap", "autopilot.enabled=true", "autopilot.budget=0.5", "train.max_steps=30",
                 "train.log_every=5", "train.eval_every=10", "checkpoint.every=30", "train.global_batch_size=64",
                 "train.micro_batch_size=8", "tune.space={optim.lr: {grid: [0.01, 0.02, 0.05]}}", "tune.num_samples=1",
                 "tune.scheduler=fifo", "tune.grace_period=null", "tune.reduction_factor=null"]
    result = tune(study_config(tmp_path, digits_dir, *overrides), verbose=True)
    out = capsys.readouterr().out
    assert {t.status for t in result.trials} == {"completed"} and len(result.trials) == 3
    assert "autopilot: one search for the study, in the first trial to start" in out
    state = json.loads((tmp_path / "runs" / "digits-ap-tune" / STATE_FILE).read_text())
    report = state["autopilot"]
    searcher, chosen = report["trial_id"], report["chosen"]
    assert f"autopilot: searched in trial {searcher}" in out and "autopilot: candidates measured" in out
    assert len(report["rows"]) >= 2 and report["start"]["micro_batch_size"] == 8
    for t in result.trials:
        trial_dir = tmp_path / "runs" / "digits-ap-tune" / f"{t.trial_id}_{t.name}"
        rows = [json.loads(line) for line in (trial_dir / "result.json").read_text().splitlines()]
        searched = [row["autopilot"] for row in rows if "autopilot" in row]
        if t.trial_id == searcher:
            assert len(searched) == 1 and searched[0]["chosen"] == chosen
            assert rows[-1]["micro_batch_size"] == chosen["micro_batch_size"]
        else:  # the choice from the first step, nothing searched
            assert searched == [] and {row["micro_batch_size"] for row in rows} == {chosen["micro_batch_size"]}
            assert rows[0]["grad_accum_steps"] == chosen["grad_accum_steps"]
    params = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns.db").get_run(result.parent_run_id).data.params
    assert {k: params[f"autopilot.{k}"] for k in chosen} == {k: str(v) for k, v in chosen.items()}
    # Continued: nothing trains again, and the kept choice is not recorded twice.
    again = tune(study_config(tmp_path, digits_dir, *overrides), verbose=True)
    assert again.resumed and "autopilot: searched in trial" not in capsys.readouterr().out


def test_trials_are_named_by_their_values_in_tune_the_summary_and_the_plots(
        study: tuple[TuneResult, Path], study_cli: tuple[Path, str, str]) -> None:
    result, tmp_path = study
    namer = TrialNamer.for_config(study_config(tmp_path, "d"))
    study_dir = tmp_path / "runs" / "digits-t-tune"
    for t in result.trials:
        assert t.name == namer(t.params) and re.fullmatch(r"lr=\d\.\de-0\d,warmup=(0|10)", t.name), t.name
        assert (study_dir / f"{t.trial_id}_{t.name}").is_dir()  # Tune's trial directory
    lines = study_cli[1].splitlines()
    # The final table: the trials best first (completed ones by their metric, then the early-stopped ones), their
    # searched values, and the best one marked.
    head = [i for i, line in enumerate(lines) if line.split()[:3] == ["trial", "status", "lr"]]
    assert len(head) == 1 and lines[head[0]].split() == ["trial", "status", "lr", "warmup", "step", "val_accuracy",
                                                         "$", "id"]
    table = [line.removesuffix("  <- best").split() for line in lines[head[0] + 1:head[0] + 1 + len(result.trials)]]
    assert {row[0]: row[-1] for row in table} == {t.name: t.trial_id for t in result.trials}
    by_id = {t.trial_id: t for t in result.trials}
    ranked = sorted(result.trials, key=lambda t: (t.status != "completed", -(t.metric or 0.0)))
    assert [row[-1] for row in table] == [t.trial_id for t in ranked]
    assert [(float(row[2]), int(row[3])) for row in table] == [
        (pytest.approx(by_id[row[-1]].params["optim.lr"], rel=1e-2), by_id[row[-1]].params["optim.warmup_steps"])
        for row in table]
    marked = [line for line in lines if line.endswith("  <- best")]
    assert len(marked) == 1 and marked[0].split()[-3] == result.best.trial_id == table[0][-1]
    assert (study_dir / "learning_curves.png").is_file() and (study_dir / "metric_vs_lr.png").is_file()


def test_the_terminal_shows_the_product_lines_and_ray_goes_to_the_log(study: tuple[TuneResult, Path],
                                                                      study_cli: tuple[Path, str, str]) -> None:
    """A user's `orchestrator tune`: the product's own lines, at most a handful of Ray's; the rest of Ray's, Tune's
    and the workers' output in the study's log file, whose path is printed once."""
    result, tmp_path = study
    _, stdout, stderr = study_cli
    log = tmp_path / "runs" / "digits-t-tune" / LOG_FILE
    names = tuple(f"{n} " for t in result.trials for n in (t.trial_id, t.name))
    product = re.compile(r"^(starting study |Ray and MLflow logs: |\[\d+:\d\d\] digits-t-tune: |trial |study |"
                         r"best trial |best config: |train it: |MLflow parent run id: |open the MLflow UI: |"
                         r"the study.s runs in the MLflow UI: |this study in the MLflow UI: |warning: |"
                         r"auto micro-batch: )")  # each trial's micro-batch and the budget it planned for
    lines = (stdout + stderr).splitlines()
    foreign = [line for line in lines if line.strip() and not product.match(line) and not line.startswith(names)]
    assert len(foreign) <= 3, "\n".join(foreign)
    assert stdout.count(str(log)) == 1 and log.stat().st_size > 0
    assert "Configuration for experiment" not in stdout + stderr and "tensorboard" not in stdout + stderr
    assert len(log.read_text().splitlines()) > 5  # what Ray and the workers printed went there instead


def test_auto_micro_batch_plans_for_every_trial_the_study_runs_at_once(study_cli: tuple[Path, str, str]) -> None:
    """Two one-worker trials at once on one node: each sizes its micro-batch for a quarter of the node's memory (half
    of it, shared by the two), not half (the trial's process has no LOCAL_WORLD_SIZE), and says so."""
    import psutil

    log = (study_cli[0] / "runs" / "digits-t-tune" / LOG_FILE).read_text()
    lines = [line for line in log.splitlines() if "auto micro-batch: " in line]
    assert lines, log[-3000:]  # one per trial; Ray's log collapses repeated lines
    node = psutil.virtual_memory().total
    share = node / 2 / (2 * 1)  # 2 trials at once x 1 worker
    for line in lines:
        assert (f"(budget {share / 2**30:.2f} GiB: half of this node's {node / 2**30:.2f} GiB over 2 ranks of the "
                "study's trials at once)") in line, line


def test_mlflow_parent_and_child_runs_all_end(study: tuple[TuneResult, Path]) -> None:
    from mlflow.tracking import MlflowClient

    result, _ = study
    client = MlflowClient(result.tracking_uri)
    parent = client.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["orchestrator.best_trial"] == result.best.trial_id
    assert parent.data.params["tune.space.optim.lr.loguniform"] == "[0.0001, 0.1]"
    table = read_summary(client, parent.info.run_id)
    assert table["study/best_val_accuracy"] == pytest.approx(result.best.metric, rel=1e-3)  # 4 digits
    # The best trial's headline figures as the parent's metrics (the runs table compares studies), as its own run
    # has them at its last report; everything else of the study in its summary table and description.
    best_run = client.search_runs(
        [parent.info.experiment_id], f"tags.`orchestrator.trial_id` = '{result.best.trial_id}'")[0]
    headline = {k: v for k, v in best_run.data.metrics.items() if k.startswith("headline/")}
    assert set(headline) == {"headline/train_loss", "headline/val_accuracy", "headline/train_samples_per_s"}
    assert parent.data.metrics == pytest.approx(headline, rel=1e-6)  # a float through Tune's CSV
    assert parent.data.metrics["headline/val_accuracy"] == result.best.metric
    assert result.best.label in parent.data.tags["mlflow.note.content"]
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {
        "best.yaml", "study.yaml", "metric_vs_lr.png", "learning_curves.png", "summary.json"}

    experiment = client.get_experiment_by_name("tune-tests").experiment_id
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{result.parent_run_id}'")
    by_trial = {r.data.tags["orchestrator.trial_id"]: r for r in children}
    assert set(by_trial) == {t.trial_id for t in result.trials}
    for t in result.trials:
        run = by_trial[t.trial_id]
        assert run.info.status == "FINISHED"  # never left RUNNING, even when ASHA killed the trial's actor
        assert run.data.tags["orchestrator.stop_reason"] == ("max_steps" if t.status == "completed" else "asha")
        assert float(run.data.params["optim.lr"]) == pytest.approx(t.params["optim.lr"])
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "headline/val_accuracy")]
        assert steps == list(range(10, t.steps + 1, 10))
        assert run.info.run_name == t.name and "model.hidden" in run.data.params  # named by its values; defaults
        assert not {"step", "train/step"} & set(run.data.metrics)  # no constants charted
    # The UI opens the experiment on its training-runs table, trials nested under the study.
    assert client.get_experiment(experiment).tags["mlflow.experimentKind"] == "custom_model_development"
    assert parent.data.tags["mlflow.source.name"].startswith(("orchestrator tune", "/"))


def test_every_trial_and_the_study_have_a_cost(study: tuple[TuneResult, Path],
                                               study_cli: tuple[Path, str, str]) -> None:
    from mlflow.tracking import MlflowClient

    result, _ = study
    usds = [t.usd for t in result.trials]
    assert all(u is not None and u > 0 for u in usds)
    client = MlflowClient(result.tracking_uri)
    parent = read_summary(client, result.parent_run_id)  # run-level figures: rows of its summary table
    assert parent["cost/usd"] == pytest.approx(sum(usds), rel=1e-3)  # type: ignore[arg-type]  # 4 digits
    assert 0 < parent["cost/productive_frac"] < 1
    # The summary's cost line names the productive share and what took the rest, largest first.
    line = next(x for x in study_cli[1].splitlines() if x.startswith("study cost: "))
    assert re.search(r"over 4 trials, [\d.]+ node-hours \| productive [\d.]+% \| ", line), line
    productive, *rest = [(name, float(share)) for name, share in re.findall(r"\| ([a-z-]+) ([\d.]+)%", line)]
    shares = [share for _, share in rest]
    assert "start-up" in dict(rest) and shares == sorted(shares, reverse=True), line  # which is largest varies
    assert productive[1] + sum(shares) == pytest.approx(100, abs=2), line  # each share rounded
    experiment = client.get_experiment_by_name("tune-tests").experiment_id
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{result.parent_run_id}'")
    assert all(read_summary(client, r.info.run_id).get("cost/usd", 0) > 0 for r in children)
    # The study's goodput: the trials' productive seconds (as each child run's ledger has them) over the trial
    # slots the command's wall clock held (at most tune.max_concurrent_trials=2 at once).
    line = next(x for x in study_cli[1].splitlines() if x.startswith("study goodput "))
    found = re.match(r"study goodput ([\d.e-]+)%: productive trial time over (\d+) s(?: x (\d) trial slots)?", line)
    assert found, line
    wall, slots = float(found[2]), int(found[3] or 1)
    stopwatch = float((study_cli[0] / "stopwatch_s").read_text())
    assert 0.5 * stopwatch < wall <= stopwatch + 0.5 and slots <= 2, (wall, stopwatch, slots)
    tables = [read_summary(client, r.info.run_id) for r in children]
    productive = sum(t["cost/productive_frac"] * t["cost/wall_s"] for t in tables)
    # Two significant digits; tiny here (trials of 40 steps of about 2 ms): the trials' own ledgers against their
    # child runs' 4-digit figures.
    assert float(found[1]) == pytest.approx(100 * productive / (wall * slots), rel=0.06), (line, productive)


def test_best_yaml_validates_and_trains(study: tuple[TuneResult, Path]) -> None:
    result, tmp_path = study
    config = load_config(result.best_config_path)
    assert config.optim.lr == pytest.approx(result.best.params["optim.lr"])
    assert config.optim.warmup_steps == result.best.params["optim.warmup_steps"]
    # At an ordinary run's cadence, not the study's (log_every=eval_every=10, for ASHA's milestones).
    assert (config.train.log_every, config.train.eval_every) == (25, 100)
    trained = train(config, verbose=False)
    assert trained.metrics["step"] == 40
    # Same config, same seed, one worker with the same thread count, the same data order on the same CPU: the
    # retrained run is the trial again. Its metric is the trial's exactly (both come from the same float; a
    # correct-count ratio), its validation loss too, up to the last digit of Tune's CSV round trip; it reported at
    # steps 25 and 40 and evaluated once, at the end.
    assert trained.metrics["val_accuracy"] == result.best.metric
    assert [r["step"] for r in trained.history] == [25, 40] and len(result.best.history) == 4
    keys = ("step", "val_loss", "val_accuracy")
    assert {k: trained.history[-1][k] for k in keys} == pytest.approx(
        {k: result.best.history[-1][k] for k in keys}, rel=1e-12, abs=0)


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
    for t in result.trials:  # each 1-worker trial checkpointed through Tune into its directory in the bucket
        assert any(k.startswith(f"runs/digits-s3-tune/{t.trial_id}_") and "/checkpoint_" in k for k in keys), t
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


class _CtrlC:
    """A param value whose str() is where Ctrl+C lands: in the middle of writing the study's params."""

    def __str__(self) -> str:
        raise KeyboardInterrupt


def test_ctrl_c_while_the_study_run_is_set_up_ends_it_killed(ray_cluster: None, tmp_path: Path, digits_dir: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    import orchestrator.tuning.study

    params = orchestrator.tuning.study.config_params
    monkeypatch.setattr(orchestrator.tuning.study, "config_params",
                        lambda c, **kw: {**params(c, **kw), "zz.interrupted": _CtrlC()})
    config = study_config(tmp_path, digits_dir, "tracking.experiment=tune-setup")
    with pytest.raises(KeyboardInterrupt):
        tune(config, verbose=False)
    client = MlflowClient(config.tracking.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tune-setup").experiment_id])
    assert run.info.status == "KILLED"
