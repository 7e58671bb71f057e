"""A study's state in its storage (orchestrator-study.json, often a shared bucket): the config it was started with,
compared by a continued study, never with the tracking server's password in it."""

from __future__ import annotations

import json

import pytest

from orchestrator.config import load_config
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
