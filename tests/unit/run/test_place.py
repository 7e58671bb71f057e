"""Run places in storage: a run's one name (its folder, its MLflow run, its terminal lines), fresh names never reuse
a run's name, --resume finds the newest run of its experiment, records round-trip."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from orchestrator.config import Config, load_config
from orchestrator.run.place import RAY_CHECKPOINTS, RunPlace, latest_run, new_run, open_run_storage, place_run, run_name
from pipelines.storage import Storage

STARTED = time.mktime((2026, 12, 6, 5, 12, 38, 0, 0, -1))  # 2026-12-06 05:12:38, local time


def test_a_runs_name_tells_it_apart_at_a_glance() -> None:
    """What the command's --set flags changed in what is trained (short) first, where the runs table shows it
    (MLflow cuts a name at about 24 characters, and the experiment is the page's title), then the experiment, the
    model unless the experiment names it, and when it started: two runs of one config differ by their start."""
    sets = ["experiment=digits-mlp", "optim.lr=1e-3", "storage.path=/tmp/x", "tracking.uri=http://u:pw@h:5000",
            "train.log_every=5"]
    config = load_config(None, sets)
    keys = [s.split("=")[0] for s in sets]
    assert run_name(config, keys, STARTED) == "lr1e-3-digits-mlp-20261206-051238"  # not where it lives, or the URI
    assert run_name(config, [], STARTED) == "digits-mlp-20261206-051238"
    assert run_name(config, [], STARTED + 1) == "digits-mlp-20261206-051239"  # the next second: another name
    assert run_name(load_config(None, ["experiment=digits"]), [], STARTED) == "digits-mlp-20261206-051238"
    cnn = load_config(None, ["experiment=digits-mlp", "model.name=cnn", "model.channels=[8, 16]"])
    assert run_name(cnn, ["model.name", "model.channels"], STARTED) == "channels8x16-digits-mlp-cnn-20261206-051238"
    many = load_config(None, ["train.seed=1", "scaling.num_workers=4", "train.precision=fp32",
                              "optim.warmup_steps=50", "autopilot.enabled=true", "train.compile=false"])
    name = run_name(many, ["train.seed", "scaling.num_workers", "train.precision", "optim.warmup_steps",
                           "autopilot.enabled", "train.compile"], STARTED)
    assert name == "seed1-workers4-fp32-digits-mlp-20261206-051238"  # the first changes, as many as fit at a glance
    name = run_name(many, ["autopilot.enabled", "train.compile"], STARTED)
    assert name == "autopilot-no-compile-digits-mlp-20261206-051238" and re.fullmatch(r"[A-Za-z0-9._-]+", name)
    # A model built by `model.entrypoint` is named by its function, or by its module when that says more.
    own = load_config(None, ["experiment=tabular", "model.entrypoint=my_models:build"])
    assert run_name(own, ["model.entrypoint"], STARTED) == "tabular-my_models-20261206-051238"
    two = load_config(None, ["experiment=diabetes-two-input", "model.entrypoint=examples.models:two_input"])
    assert run_name(two, [], STARTED) == "diabetes-two-input-20261206-051238"


@pytest.mark.parametrize("setting", [
    "storage.path=/tmp/elsewhere", "tracking.uri=sqlite:////tmp/other.db", "cluster.keep_warm_minutes=5",
    "checkpoint.every=50", "failure.max_failures=1", "cost.cloud=gcp", "tune.num_samples=3",
    "data.prefetch_batches=4", "train.log_every=7", "train.eval_every=30"])
def test_a_runs_name_leaves_out_where_it_lives_and_how_it_is_watched(setting: str) -> None:
    """One case per kind of key a name leaves out: a --set of it names the run as the run without it."""
    key = setting.split("=")[0]
    assert run_name(load_config(None, [setting]), [key], STARTED) == run_name(load_config(None, []), [], STARTED)
    # ...while a key that changes what is trained is named
    assert run_name(load_config(None, [setting, "train.seed=3"]), [key, "train.seed"], STARTED) != \
        run_name(load_config(None, []), [], STARTED)


def test_resume_finds_the_newest_run_of_the_experiment_only(tmp_path: Path) -> None:
    config = load_config(None, [f"storage.path={tmp_path}", "experiment=exp"])
    storage = open_run_storage(config)
    assert latest_run(storage, "exp") is None  # nothing yet: --resume starts a new run
    for name in ("exp-20260101-000000", "exp-20260102-000000", "exp-20260102-000000-2", "exp-other-20270101-000000",
                 "expo-20270101-000000"):
        (tmp_path / name).mkdir()
    (tmp_path / "exp-20290101-000000.txt").write_text("a file, not a run")
    place = latest_run(storage, "exp")
    assert place is not None and place.name == "exp-20260102-000000-2"
    place.write_record({"mlflow_run_id": "abc"})
    assert latest_run(storage, "exp").read_record() == {"mlflow_run_id": "abc"}  # type: ignore[union-attr]
    # Named by what it trains: its saved config says whose run it is (`exp-other` may be an experiment of its own).
    mine = new_run(storage, run_name(load_config(None, ["experiment=exp", "optim.lr=0.1"]), ["optim.lr"], STARTED))
    mine.write_config(load_config(None, ["experiment=exp", "optim.lr=0.1"]))
    assert re.fullmatch(r"lr0\.1-exp-mlp-\d{8}-\d{6}", mine.name) and latest_run(storage, "exp") == mine
    theirs = new_run(storage, run_name(load_config(None, ["experiment=exp-mlp"]), [], STARTED + 60))
    theirs.write_config(load_config(None, ["experiment=exp-mlp"]))
    assert latest_run(storage, "exp") == mine and latest_run(storage, "exp-mlp") == theirs


def test_a_new_run_never_takes_an_existing_name(tmp_path: Path) -> None:
    storage = open_run_storage(load_config(None, [f"storage.path={tmp_path}"]))
    first = new_run(storage, "exp-20260101-000000")
    Path(first.path).mkdir()
    second = new_run(storage, "exp-20260101-000000")  # started in the same second
    assert first.name == "exp-20260101-000000" and second.name == "exp-20260101-000000-2"


def test_train_takes_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`train --resume` reaches train(resume=True), which continues the newest run with its record and refuses a
    config that trains something else; without it (or with no earlier run) a new run starts. No Ray: the run's
    place is decided before any cluster is touched."""
    from orchestrator import cli
    from orchestrator.errors import ConfigError
    from orchestrator.run import launch
    from orchestrator.run.place import place_run

    calls: list[bool | str] = []

    class Stop(Exception):
        pass

    def fake_train(config: object, address: str | None = None, verbose: bool = True, resume: bool | str = False,
                   started_at: float | None = None, show_logs: bool = False) -> None:
        calls.append(resume)
        raise Stop  # nothing past the flag's hand-over is under test here

    monkeypatch.setattr(launch, "train", fake_train)
    monkeypatch.setattr(sys, "path", list(sys.path))  # cli.main puts the working directory on it
    for argv in (["train", "--resume"], ["train"], ["train", "--resume", "exp-20260101-000000"],
                 ["train", "--resume", "s3://bucket/runs/exp-20260101-000000"]):
        with pytest.raises(Stop):
            cli.main([*argv, "--set", f"storage.path={tmp_path}"])
    assert calls == [True, False, "exp-20260101-000000", "s3://bucket/runs/exp-20260101-000000"]

    sets = [f"storage.path={tmp_path}", "experiment=exp", "train.max_steps=40"]
    config = load_config(None, sets)
    place, record = place_run(config, resume=True, verbose=False)  # no earlier run: a new one, no record
    assert record is None and latest_run(open_run_storage(config), "exp") is None
    place.write_config(config)  # what train() writes before it fits
    place.write_record({"run_name": place.name, "mlflow_run_id": "abc"})
    resumed, record = place_run(load_config(None, [*sets, "train.log_every=5"]), resume=True, verbose=False)
    assert resumed.name == place.name and record == {"run_name": place.name, "mlflow_run_id": "abc"}
    fresh, record = place_run(config, resume=False, verbose=False)
    assert fresh.name != place.name and record is None
    with pytest.raises(ConfigError, match=r"optim\.lr: 0\.003 -> 0\.1"):
        place_run(load_config(None, [*sets, "optim.lr=0.1"]), resume=True, verbose=False)


def test_resume_refuses_a_config_that_trains_something_else(tmp_path: Path) -> None:
    from orchestrator.errors import ConfigError

    config = load_config(None, [f"storage.path={tmp_path}", "experiment=exp", "train.max_steps=40"])
    place = new_run(open_run_storage(config), run_name(config, []))
    place.check_resumable(config)  # no saved config yet: the run never got going
    place.write_config(config)
    # Watching, feeding, placing and billing the run may change...
    place.check_resumable(load_config(None, [f"storage.path={tmp_path}", "experiment=exp", "train.max_steps=40",
                                             "train.log_every=5", "scaling.num_workers=1", "data.prefetch_batches=8",
                                             "failure.max_failures=9", "tracking.enabled=false"]))
    # ...what is trained may not.
    with pytest.raises(ConfigError, match=r"optim\.lr: 0\.003 -> 0\.1.*train\.max_steps: 40 -> 80.*without --resume"):
        place.check_resumable(load_config(None, [f"storage.path={tmp_path}", "experiment=exp", "train.max_steps=80",
                                                 "optim.lr=0.1"]))


def test_resume_with_nothing_to_resume_says_so_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--resume` that finds no run to continue starts one, and says which experiment and storage it searched;
    one whose latest run saved no checkpoint says that run starts again from step 0. Without `--resume`, no line."""
    from orchestrator.run.place import place_run

    config = load_config(None, [f"storage.path={tmp_path}/runs", "experiment=exp"])
    place, record = place_run(config, resume=True, verbose=False)
    assert record is None
    assert capsys.readouterr().err.splitlines() == [
        f"--resume: no earlier run of experiment 'exp' in {tmp_path}/runs (storage.path): starting a new run, "
        f"{place.name}"]

    place.write_config(config)  # started, then stopped before its first checkpoint
    place.write_record({"run_name": place.name, "mlflow_run_id": "abc"})
    again, record = place_run(config, resume=True, verbose=True)
    assert again.name == place.name and record == {"run_name": place.name, "mlflow_run_id": "abc"}
    assert capsys.readouterr().err.splitlines() == [
        f"--resume: run {place.uri} saved no checkpoint: it starts again from step 0"]

    place_run(config, resume=False, verbose=True)
    assert capsys.readouterr().err == ""


def _run_of(storage: Storage, config: Config, started: float, checkpoint: int | None = None) -> RunPlace:
    """What a run leaves in storage.path once it has begun: its directory, saved config and record, and Ray's
    record of its checkpoints (`checkpoint_manager_snapshot.json`) once one registered."""
    place = new_run(storage, run_name(config, [], started))
    place.write_config(config)
    place.write_record({"run_name": place.name, "mlflow_run_id": None, "tracking_uri": None})
    if checkpoint is not None:
        place.write_text(RAY_CHECKPOINTS, f'{{"checkpoints": ["{place.path}/checkpoint_{checkpoint:08d}_a1b2c3"]}}')
    return place


def test_resume_continues_the_newest_run_this_config_trained_or_the_one_named(tmp_path: Path) -> None:
    """Two runs of one experiment, lr 0.1 then lr 0.003: the older run's exact command with --resume continues the
    older run (the newest whose saved config this config matches, what may change on resume aside), not the newest;
    `--resume <run name>` continues the run of that name, and refuses it with another config."""
    from orchestrator.errors import ConfigError

    sets = [f"storage.path={tmp_path}", "experiment=exp", "train.max_steps=40"]
    old_config, new_config = load_config(None, [*sets, "optim.lr=0.1"]), load_config(None, sets)
    storage = open_run_storage(old_config)
    older = _run_of(storage, old_config, STARTED, checkpoint=20)
    newer = _run_of(storage, new_config, STARTED + 60, checkpoint=10)
    assert latest_run(storage, "exp") == newer
    resumed, record = place_run(load_config(None, [*sets, "optim.lr=0.1", "train.log_every=5"]), resume=True,
                                verbose=False)
    assert resumed.name == older.name and record == {"run_name": older.name, "mlflow_run_id": None,
                                                     "tracking_uri": None}
    assert place_run(new_config, resume=True, verbose=False)[0].name == newer.name
    # By name: that run, whichever is newest.
    assert place_run(old_config, resume=older.name, verbose=False)[0].name == older.name
    with pytest.raises(ConfigError, match=rf"run {re.escape(older.uri)} was trained with a different config "
                                          r"\(optim\.lr: 0\.1 -> 0\.003\)"):
        place_run(new_config, resume=older.name, verbose=False)
    with pytest.raises(ConfigError, match=rf"--resume exp-20260101-000000: no run of that name in "
                                          rf"{re.escape(storage.uri)} \(storage\.path\).*{newer.name}"):
        place_run(new_config, resume="exp-20260101-000000", verbose=False)


def test_resume_that_matches_no_run_lists_the_runs_it_could_continue(tmp_path: Path) -> None:
    """No run of the experiment was trained with this config: the error names each run (newest first) with the
    step it reached, when it started and what differs, and how to pick one; nothing new is started."""
    from orchestrator.errors import ConfigError

    sets = [f"storage.path={tmp_path}", "experiment=exp", "train.max_steps=40"]
    storage = open_run_storage(load_config(None, sets))
    older = _run_of(storage, load_config(None, [*sets, "optim.lr=0.1"]), STARTED, checkpoint=20)
    newer = _run_of(storage, load_config(None, [*sets, "optim.lr=0.2"]), STARTED + 60)
    newer.write_attempt({"began": STARTED + 60, "ended": STARTED + 90, "reports": [{"step": 5}, {"step": 7}]})
    with pytest.raises(ConfigError) as refused:
        place_run(load_config(None, sets), resume=True, verbose=False)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(
        f"--resume: no run of experiment 'exp' in {storage.uri} (storage.path) was trained with this config; its runs, "
        f"newest first: {newer.name} (step 7, started 2026-12-06 05:13:38; optim.lr: 0.2 -> 0.003), {older.name} "
        "(step 20, started 2026-12-06 05:12:38; optim.lr: 0.1 -> 0.003)")
    assert message.endswith("pass --resume <run name> with that run's config, or run without --resume to start a "
                            "new run")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([older.name, newer.name])  # no new run


def test_resume_takes_a_run_directorys_path(tmp_path: Path) -> None:
    """`--resume <path>` (or s3://bucket/.../<run>): the run in that directory, its parent as storage.path; a path
    that holds no run is refused, naming it."""
    from orchestrator.errors import ConfigError
    from orchestrator.run.place import resume_target

    config = load_config(None, [f"storage.path={tmp_path}/elsewhere", "experiment=exp"])
    assert resume_target(config, True) == (config, True) and resume_target(config, "exp-x/") == (config, "exp-x")
    moved, name = resume_target(config, "s3://bucket/team/runs/exp-20260101-000000/")
    assert (moved.storage.path, name) == ("s3://bucket/team/runs", "exp-20260101-000000")
    stored = load_config(None, [f"storage.path={tmp_path}/runs", "experiment=exp"])
    run = _run_of(open_run_storage(stored), stored, STARTED, checkpoint=10)
    moved, name = resume_target(config, run.path)
    assert (moved.storage.path, name) == (f"{tmp_path}/runs", run.name)
    place, record = place_run(moved, resume=name, verbose=False)
    assert place.uri == run.uri and record is not None
    with pytest.raises(ConfigError, match=rf"--resume nothing: no run of that name in {re.escape(str(tmp_path))}/runs"):
        place_run(*resume_target(config, f"{tmp_path}/runs/nothing"), verbose=False)  # type: ignore[misc]


def test_resume_of_a_finished_run_says_where_its_result_is_and_starts_nothing(
        tmp_path: Path, digits_dir: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`--resume` of a run that finished (its record says so, as train() leaves it): one line with its step and
    result, where the run and its MLflow run are, exit 0; Ray is never started and MLflow gets no write (no second
    LoggedModel `model`, the run's metrics, tags and status as they were)."""
    from mlflow.tracking import MlflowClient

    from orchestrator import cli
    from orchestrator.run import launch

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sets = [f"data.train={digits_dir}/train", f"data.val={digits_dir}/val", f"storage.path={tmp_path}/runs",
            f"tracking.uri={uri}", "experiment=exp", "train.max_steps=40"]
    # What a finished run leaves: its MLflow run FINISHED with its final model, its directory and record.
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("default"), run_name="exp-run")
    client.log_metric(run.info.run_id, "train_loss", 0.25, step=40)
    client.create_logged_model(run.info.experiment_id, name="model", source_run_id=run.info.run_id)
    client.set_terminated(run.info.run_id, "FINISHED")
    from orchestrator.run.plan import plan_run

    plan = plan_run(load_config(None, sets), verbose=False)  # the config as the run saved it: resolved for the data
    place = _run_of(plan.place.storage, plan.config, STARTED, checkpoint=40)
    checkpoint = f"{place.path}/checkpoint_00000040_a1b2c3"
    place.write_record({"run_name": place.name, "mlflow_run_id": run.info.run_id, "tracking_uri": uri,
                        "finished": {"step": 40, "checkpoint": checkpoint,
                                     "metrics": {"train_loss": 0.25, "val_accuracy": 0.9, "val_loss": 0.3}}})
    before = client.get_run(run.info.run_id)

    def no_ray(*args: object, **kwargs: object) -> bool:
        raise AssertionError("Ray was started for a finished run")

    monkeypatch.setattr(launch, "connect_cluster", no_ray)
    monkeypatch.setattr(sys, "path", list(sys.path))  # cli.main puts the working directory on it
    assert cli.main(["train", "--resume", *[a for s in sets for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"{place.name} finished at step 40 (its result: train loss 0.2500, val accuracy 0.9000, "
                      "val loss 0.3000): nothing to resume")
    assert f"run directory: {place.uri}" in out and f"checkpoint: {checkpoint}" in out
    assert f"MLflow run id: {run.info.run_id}" in out
    # Named, the same.
    assert cli.main(["train", "--resume", place.name, *[a for s in sets for a in ("--set", s)]]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(f"{place.name} finished at step 40")
    after = client.get_run(run.info.run_id)
    assert (after.info.status, after.info.end_time, after.data.metrics, after.data.tags) == (
        before.info.status, before.info.end_time, before.data.metrics, before.data.tags)
    models = client.search_logged_models([run.info.experiment_id])
    assert [m.name for m in models] == ["model"]
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert not list(Path(place.path).glob("attempts/*"))  # nothing billed: the command trained nothing
    # The Python API: the finished run's result, as it was.
    import orchestrator

    result = orchestrator.train(load_config(None, sets), resume=place.name)
    assert result.already_finished and result.run_id == run.info.run_id and result.checkpoint_path == checkpoint
    assert result.metrics == {"step": 40, "train_loss": 0.25, "val_accuracy": 0.9, "val_loss": 0.3}
