"""The Tracker a run logs through: its protocol, NullTracker (what a run with tracking.enabled=false logs to),
start_tracker (which of the two a run gets) and closed_on_error (a run that raised or was interrupted never stays
RUNNING). The MLflow one, MlflowTracker, is in client.py."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from orchestrator.config import TrackingConfig
from orchestrator.tracking.client import MlflowTracker

if TYPE_CHECKING:
    from pipelines.sources import DatasetInfo


class Tracker(Protocol):
    run_id: str | None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None: ...
    def log_datasets(self, infos: Mapping[str, DatasetInfo]) -> None: ...
    def log_checkpoint(self, step: int, uri: str) -> None: ...
    def keep_checkpoints(self, kept: Mapping[str, int | None]) -> None: ...
    def finish(self, status: str) -> None: ...


class NullTracker:
    """Used when tracking.enabled is false."""

    run_id: str | None = None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None: ...
    def log_datasets(self, infos: Mapping[str, DatasetInfo]) -> None: ...
    def log_checkpoint(self, step: int, uri: str) -> None: ...
    def keep_checkpoints(self, kept: Mapping[str, int | None]) -> None: ...
    def finish(self, status: str) -> None: ...


@contextmanager
def closed_on_error(tracker: Tracker) -> Iterator[None]:
    """A run interrupted by Ctrl+C ends KILLED, one that raised ends FAILED (never left RUNNING)."""
    try:
        yield
    except KeyboardInterrupt:
        tracker.finish("KILLED")
        raise
    except BaseException:
        tracker.finish("FAILED")
        raise


def start_tracker(cfg: TrackingConfig, run_name: str, tags: dict[str, str] | None = None,
                  run_id: str | None = None, headline: str | None = None,
                  context: dict[str, str] | None = None) -> Tracker:
    return MlflowTracker(cfg, run_name, tags, run_id, headline, context) if cfg.enabled else NullTracker()
