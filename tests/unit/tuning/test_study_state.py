"""A study's state in its storage (orchestrator-study.json, often a shared bucket): the config it was started with,
compared by a continued study, never with the tracking server's password in it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import Config, load_config
from orchestrator.errors import ConfigError
from orchestrator.tuning.study import _check_same_study, _fingerprint


def test_the_study_state_keeps_no_tracking_password_and_a_new_password_continues_the_study() -> None:
    config = load_config(None, ["tracking.uri=http://user:SECRET@mlflow.internal:5000"])
    state = {"config": _fingerprint(config)}
    assert "SECRET" not in json.dumps(state)
    assert state["config"]["tracking.uri"] == "http://user:***@mlflow.internal:5000"
    # The same study with the password rotated: the same study.
    _check_same_study(state, load_config(None, ["tracking.uri=http://user:ROTATED@mlflow.internal:5000"]), "s", "p")
    # Another server is another config.
    with pytest.raises(ConfigError, match="tracking.uri"):
        _check_same_study(state, load_config(None, ["tracking.uri=http://user:SECRET@other:5000"]), "s", "p")


@dataclass
class _Trial:
    """What the study's callback reads of a Ray Tune Trial to open its child run."""

    trial_id: str
    config: dict[str, Any]
    last_result: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"lr={self.config['optim.lr']}"


def _trainable(config: dict[str, Any]) -> None:
    """A study's trainable: never run here (nothing is fitted)."""


def test_the_saved_study_callback_holds_no_password_and_a_resumed_study_tracks_with_the_commands_own(
        tmp_path: Path) -> None:
    """Tune pickles the run config's callbacks into `<storage>/<study>/tuner.pkl` (often a shared bucket) and
    unpickles them on Tuner.restore. The saved callback keeps no password of any URI; the resumed study's callback
    tracks with the resuming command's config, its password rotated or not. A real Tuner writes and restores the
    file (neither starts Ray)."""
    import ray.cloudpickle  # what Tune writes tuner.pkl with
    from mlflow.tracking import MlflowClient
    from ray import tune

    from orchestrator.tracking.client import MlflowTracker
    from orchestrator.tuning.plan import TrialPlanner
    from orchestrator.tuning.search import user_tree
    from orchestrator.tuning.trials import ParentRun, StudyCallback, StudyFacts, restored_as

    store = tmp_path / "mlruns.db"

    def config(password: str) -> Config:  # a store URI that carries a secret and still connects (SQLite ignores it)
        return load_config(None, [f"tracking.uri=sqlite:///{store}?password={password}",
                                  f"data.s3.endpoint=http://minio:{password}@127.0.0.1:9000"])

    def callback(cfg: Config, parent: str) -> StudyCallback:
        study = StudyFacts("s", TrialPlanner(user_tree(cfg)), ("optim.lr",), "val_accuracy", 30)
        return StudyCallback(study, ParentRun(cfg.tracking, parent), verbose=False)

    first = config("SECRET")
    parent = MlflowTracker(first.tracking, "s", tags={"orchestrator.study": "s"})
    tune.Tuner(_trainable, param_space={"optim.lr": tune.choice([0.01])},
               run_config=tune.RunConfig(name="s", storage_path=str(tmp_path / "studies"),
                                         callbacks=[callback(first, parent.run_id)]))
    saved = (tmp_path / "studies" / "s" / "tuner.pkl").read_bytes()
    assert b"SECRET" not in saved

    # Unpickled without the resuming command's callback (the study never restores it so): masked, no password.
    alone = ray.cloudpickle.loads(saved)["_run_config"].callbacks[0]
    assert alone.parent.tracking.uri == f"sqlite:///{store}?password=***"

    for password in ("SECRET", "ROTATED"):  # the study resumed with its password, or a new one
        resuming = config(password)
        with restored_as(callback(resuming, parent.run_id)):
            restored = tune.Tuner.restore(str(tmp_path / "studies" / "s"), _trainable)
        # The callback Tune will call (Ray has no public accessor for a restored Tuner's run config).
        study = restored._local_tuner.get_run_config().callbacks[0]
        assert study.parent.tracking.uri == resuming.tracking.uri
        assert study.study.trials.tree == user_tree(resuming)
        trial = _Trial(f"t_{password}", {"optim.lr": 0.01})
        study.on_trial_start(0, [trial], trial)  # opens the trial's child run in the store
        study.on_experiment_end([trial])
        runs = MlflowClient(tracking_uri=resuming.tracking.uri).search_runs(
            [parent._client.get_run(parent.run_id).info.experiment_id],
            f"tags.`orchestrator.trial_id` = '{trial.trial_id}'")
        assert [r.data.tags["mlflow.parentRunId"] for r in runs] == [parent.run_id]
        assert runs[0].data.params["optim.lr"] == "0.01" and password not in json.dumps(runs[0].data.params)
    parent.finish("FINISHED")


def test_the_study_state_masks_the_password_of_every_uri_in_the_config() -> None:
    """Not only tracking.*: an S3 endpoint's userinfo, a query parameter's password; a rotated one is the same
    study."""
    def config(password: str) -> Config:
        return load_config(None, [f"data.s3.endpoint=http://minio:{password}@127.0.0.1:9000",
                                  f"tracking.uri=postgresql://db/mlflow?user=u&password={password}"])

    state = {"config": _fingerprint(config("SECRET"))}
    assert "SECRET" not in json.dumps(state)
    assert state["config"]["data.s3.endpoint"] == "http://minio:***@127.0.0.1:9000"
    assert state["config"]["tracking.uri"] == "postgresql://db/mlflow?user=u&password=***"
    _check_same_study(state, config("ROTATED"), "s", "p")


def test_a_callback_an_earlier_version_saved_takes_the_resuming_commands_settings() -> None:
    """A study whose tuner.pkl holds the callback as the version before StudyFacts pickled it (its attributes one by
    one, the study by its name): resumed, the callback is the resuming command's."""
    from orchestrator.tuning.plan import TrialPlanner
    from orchestrator.tuning.trials import ParentRun, StudyCallback, StudyFacts, restored_as

    config = load_config(None, ["tracking.uri=http://user:SECRET@mlflow.internal:5000"])
    saved = {"study": "s", "tree": {}, "keys": ["optim.lr"], "metric": "val_accuracy", "max_steps": 30,
             "tracking": None, "parent_run_id": "p", "verbose": True, "table_every_s": 2.0, "infos": None,
             "live": None, "shared_search": False}
    resuming = StudyCallback(StudyFacts("s", TrialPlanner({"optim": {"lr": 0.1}}), ("optim.lr",), "val_accuracy", 30),
                             ParentRun(config.tracking, "p"), verbose=False)
    restored = StudyCallback.__new__(StudyCallback)
    with restored_as(resuming):
        restored.__setstate__(saved)
    assert restored.settings() == resuming.settings() and restored._runs == {}
    assert restored.parent is not None and "SECRET" in str(restored.parent.tracking.uri)
    masked = restored.__getstate__()  # saved again, in this version's form: no password
    assert "SECRET" not in str(masked["parent"].tracking.uri) and masked["study"].name == "s"
