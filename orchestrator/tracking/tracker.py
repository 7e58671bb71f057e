"""The Tracker a run logs through: its protocol, NullTracker (what a run with tracking.enabled=false
logs to), start_tracker (which of the two a run gets) and closed_on_error (a run that raised or was
interrupted never stays RUNNING). The MLflow one, MlflowTracker, is in client.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
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


class FencedTracker:
    """`inner`, whose writes are dropped once `refused()` (a flag: a newer attempt of the run
    claimed it, see run/fencing.py), so that an attempt that lives on writes nothing into the run
    its successor continues: what its writer still holds included (the writer asks before each
    write, and drops it all once refused)."""

    def __init__(self, inner: Tracker, refused: Callable[[], bool]) -> None:
        self.inner, self.refused = inner, refused
        if isinstance(inner, MlflowTracker):
            inner.writer.refused = refused
        self.run_id = inner.run_id
        self.uri = getattr(inner, "uri", None)

    def log_params(self, params: dict[str, Any]) -> None:
        if not self.refused():
            self.inner.log_params(params)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        if not self.refused():
            self.inner.log_metrics(metrics, step)

    def set_tags(self, tags: dict[str, str]) -> None:
        if not self.refused():
            self.inner.set_tags(tags)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if not self.refused():
            self.inner.log_artifact(path, artifact_path)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        if not self.refused():
            self.inner.log_table(name, columns, rows)

    def log_datasets(self, infos: Mapping[str, DatasetInfo]) -> None:
        if not self.refused():
            self.inner.log_datasets(infos)

    def log_checkpoint(self, step: int, uri: str) -> None:
        if not self.refused():
            self.inner.log_checkpoint(step, uri)

    def keep_checkpoints(self, kept: Mapping[str, int | None]) -> None:
        if not self.refused():
            self.inner.keep_checkpoints(kept)

    def finish(self, status: str) -> None:
        if not self.refused():
            self.inner.finish(status)


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
                  context: dict[str, str] | None = None, uri: str | None = None) -> Tracker:
    """An MLflow run of `cfg`'s store (`uri`: as a run's plan resolved it), or nothing with tracking
    off."""
    return (MlflowTracker(cfg, run_name, tags, run_id, headline, context, uri) if cfg.enabled
            else NullTracker())


def direct(tracker: Tracker) -> Tracker:
    """The tracker that writes, for what goes through MLflow's own client (the final model): a
    FencedTracker's own, or a NullTracker once it refuses."""
    if isinstance(tracker, FencedTracker):
        return NullTracker() if tracker.refused() else tracker.inner
    return tracker
