"""Ray's internals in one module (orchestrator/ray_internals.py): no other product file imports them, and where one
has moved (a Ray release renames them without notice) its function falls back as documented instead of failing the
run. A moved module is made so here: removed from its package and from the import system."""

from __future__ import annotations

import ast
import importlib
import logging
import sys
import tempfile
from pathlib import Path

import pytest

from orchestrator import ray_internals

ROOT = Path(__file__).resolve().parents[2]
def internal(name: str) -> bool:
    """A module of Ray's that its name marks private (`ray._private`, `ray._common`, `ray.data._internal` ...)."""
    return name.split(".")[0] == "ray" and any(part.startswith("_") for part in name.split(".")[1:])


def test_only_the_one_module_imports_rays_internals() -> None:
    found = []
    for path in [*(ROOT / "orchestrator").rglob("*.py"), *(ROOT / "pipelines").rglob("*.py")]:
        if path.name == "ray_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if internal(n)]
    assert not found, found


def moved(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """As if Ray no longer had these modules (their packages imported first: Ray's own modules import them)."""
    parents = [importlib.import_module(name.rpartition(".")[0]) for name in names]
    for name, parent in zip(names, parents, strict=True):
        monkeypatch.delattr(parent, name.rpartition(".")[2], raising=False)
        monkeypatch.setitem(sys.modules, name, None)  # type: ignore[arg-type]


def test_each_use_works_today_and_falls_back_where_the_internal_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    # Today's Ray: each one finds what it uses.
    assert ray_internals.ray_data_logging_config() is not None
    assert ray_internals.worker_output() is not None
    with ray_internals.local_only():
        from ray._private import ray_constants

        assert ray_constants.ENABLE_RAY_CLUSTER is False
    assert ray_constants.ENABLE_RAY_CLUSTER is True
    # No Ray started in this process: nothing of a node's to stop, a plain ray.shutdown() (integration tests: a node's).
    assert ray_internals.started_process_ids() == [] and ray_internals.shutdown_leaving_processes() is False
    moved(monkeypatch, "ray.data._internal.logging", "ray._private.worker", "ray._private.ray_logging",
          "ray._private.ray_constants", "ray._private.authentication.authentication_token_setup",
          "ray.train.v2._internal.execution", "ray._common.utils")
    assert ray_internals.ray_data_logging_config() is None  # Ray Data logs as it would
    assert ray_internals.worker_output() is None  # Ray prints its workers' lines itself
    assert ray_internals.autoscaler_events(["a status line"]) == ["a status line"]
    with ray_internals.local_only():  # nothing changed
        pass
    assert ray_internals.token_auth_by_default() is None and ray_internals.ensure_token() is None
    assert ray_internals.system_temp_dir() == tempfile.gettempdir()
    assert ray_internals.started_process_ids() == []  # nothing to stop: Ray's shutdown stops its processes
    before = {name: logging.getLogger(name).level for name in logging.root.manager.loggerDict}
    ray_internals.quiet_train_report_log()
    assert {name: logging.getLogger(name).level for name in before} == before
