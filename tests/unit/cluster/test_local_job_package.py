"""A Ray job's driver and its working directory (cluster.outside_job_package): Ray's copy of the uploaded package,
which the job's own `ray.init` can have deleted and extracted again under it (test_cluster_jobs.py runs the real
thing on two nodes). Here: where the driver works meanwhile, and that it never needs the package's directory."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from orchestrator.cluster.local import outside_job_package
from orchestrator.config import load_config
from orchestrator.errors import ConfigError

JOB = json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_0123456789abcdef.zip"}, "metadata": {}})


@pytest.fixture()
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A job's package directory, the working directory of a driver Ray started for a job with a working_dir."""
    directory = tmp_path / "working_dir_files" / "_ray_pkg_0123456789abcdef"
    directory.mkdir(parents=True)
    monkeypatch.chdir(directory)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", JOB)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return directory


def test_the_driver_works_beside_its_sqlite_store_while_the_package_is_replaced(package: Path,
                                                                                 tmp_path: Path) -> None:
    store = tmp_path / "tracking" / "mlflow.db"
    store.parent.mkdir()
    with outside_job_package(load_config(None, [f"tracking.uri=sqlite:///{store}"]).tracking):
        assert Path.cwd() == store.parent  # MLflow's default artifact root, ./mlruns, lands beside the store
        shutil.rmtree(package)  # what another node's runtime-env agent on this host does at the job's ray.init
        assert Path.cwd() == store.parent and Path("mlruns").resolve() == store.parent / "mlruns"
        package.mkdir()  # ... and extracted again
    assert Path.cwd() == package  # back in the (new) package


def test_a_server_tracked_job_works_from_the_users_cache(package: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with outside_job_package(load_config(None, ["tracking.uri=http://mlflow.internal:5000"]).tracking):
        assert Path.cwd() == tmp_path / "cache" / "orchestrator"
    assert Path.cwd() == package


def test_a_relative_sqlite_store_in_a_job_is_refused_before_anything_moves(package: Path) -> None:
    with pytest.raises(ConfigError, match=r"tracking.uri sqlite:///mlruns.db is relative: in a Ray job") as error:
        with outside_job_package(load_config(None, []).tracking):  # the default store
            pass
    assert "absolute path" in str(error.value) and Path.cwd() == package
    with pytest.raises(ConfigError, match=r"sqlite:////nowhere/at/all/m.db: no directory /nowhere/at/all on this"):
        with outside_job_package(load_config(None, ["tracking.uri=sqlite:////nowhere/at/all/m.db"]).tracking):
            pass


def test_outside_a_job_nothing_moves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    with outside_job_package(load_config(None, []).tracking):
        assert Path.cwd() == tmp_path
    # A job without a working_dir runs where it was started: nothing of Ray's to leave.
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {}}))
    with outside_job_package(load_config(None, []).tracking):
        assert Path(os.getcwd()) == tmp_path
