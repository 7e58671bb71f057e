"""Run places in storage: fresh names never reuse a run's name, --resume finds the newest run, records round-trip."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from orchestrator.config import load_config
from orchestrator.runs import latest_run, new_run, open_run_storage


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


def test_a_new_run_never_takes_an_existing_name(tmp_path: Path) -> None:
    storage = open_run_storage(load_config(None, [f"storage.path={tmp_path}"]))
    first = new_run(storage, "exp")
    Path(first.path).mkdir()
    second = new_run(storage, "exp")
    assert second.name != first.name


def test_train_takes_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`train --resume` reaches train(resume=True), which continues the newest run with its record and refuses a
    config that trains something else; without it (or with no earlier run) a new run starts. No Ray: the run's
    place is decided before any cluster is touched."""
    from orchestrator import cli, launch
    from orchestrator.errors import ConfigError
    from orchestrator.runs import place_run

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
    place = new_run(open_run_storage(config), "exp")
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
    from orchestrator.runs import place_run

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
