"""Run places in storage: a run's one name (its folder, its MLflow run, its terminal lines), fresh names never reuse
a run's name, --resume finds the newest run of its experiment, records round-trip."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from orchestrator.config import load_config
from orchestrator.run.place import latest_run, new_run, open_run_storage, run_name

STARTED = time.mktime((2026, 12, 6, 5, 12, 38, 0, 0, -1))  # 2026-12-06 05:12:38, local time


def test_a_runs_name_tells_it_apart_at_a_glance() -> None:
    """The experiment, the model unless the experiment names it, what the command's --set flags changed in what is
    trained (short), and when it started: two runs of one config differ by their start."""
    sets = ["experiment=digits-mlp", "optim.lr=1e-3", "storage.path=/tmp/x", "tracking.uri=http://u:pw@h:5000",
            "train.log_every=5"]
    config = load_config(None, sets)
    keys = [s.split("=")[0] for s in sets]
    assert run_name(config, keys, STARTED) == "digits-mlp-lr1e-3-20261206-051238"  # not where it lives, or the URI
    assert run_name(config, [], STARTED) == "digits-mlp-20261206-051238"
    assert run_name(config, [], STARTED + 1) == "digits-mlp-20261206-051239"  # the next second: another name
    assert run_name(load_config(None, ["experiment=digits"]), [], STARTED) == "digits-mlp-20261206-051238"
    cnn = load_config(None, ["experiment=digits-mlp", "model.name=cnn", "model.channels=[8, 16]"])
    assert run_name(cnn, ["model.name", "model.channels"], STARTED) == "digits-mlp-cnn-channels8x16-20261206-051238"
    many = load_config(None, ["train.seed=1", "scaling.num_workers=4", "train.precision=fp32",
                              "optim.warmup_steps=50", "autopilot.enabled=true", "train.compile=false"])
    name = run_name(many, ["train.seed", "scaling.num_workers", "train.precision", "optim.warmup_steps",
                           "autopilot.enabled", "train.compile"], STARTED)
    assert name == "digits-mlp-seed1-workers4-fp32-20261206-051238"  # the first changes, as many as fit at a glance
    name = run_name(many, ["autopilot.enabled", "train.compile"], STARTED)
    assert name == "digits-mlp-autopilot-no-compile-20261206-051238" and re.fullmatch(r"[A-Za-z0-9._-]+", name)
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
    assert re.fullmatch(r"exp-mlp-lr0\.1-\d{8}-\d{6}", mine.name) and latest_run(storage, "exp") == mine
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

    calls: list[bool] = []

    class Stop(Exception):
        pass

    def fake_train(config: object, address: str | None = None, verbose: bool = True, resume: bool = False,
                   started_at: float | None = None, show_logs: bool = False) -> None:
        calls.append(resume)
        raise Stop  # nothing past the flag's hand-over is under test here

    monkeypatch.setattr(launch, "train", fake_train)
    monkeypatch.setattr(sys, "path", list(sys.path))  # cli.main puts the working directory on it
    for argv in (["train", "--resume"], ["train"]):
        with pytest.raises(Stop):
            cli.main([*argv, "--set", f"storage.path={tmp_path}"])
    assert calls == [True, False]

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
