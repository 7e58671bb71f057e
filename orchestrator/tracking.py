"""MLflow on the driver: one run per `orchestrator train`. A failing tracking call warns and never stops training."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from orchestrator.config import TrackingConfig
from orchestrator.errors import UserError

# A dead tracking server would otherwise stall training for minutes (7 retries, 120 s timeout by default).
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
                  "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


class Tracker(Protocol):
    run_id: str | None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def finish(self, status: str) -> None: ...


DEFAULT_URI = "sqlite:///mlruns.db"


def resolve_uri(uri: str | None) -> str:
    """The configured URI, else $MLFLOW_TRACKING_URI (set by cluster runtime envs), else a local SQLite file.
    A relative SQLite path becomes absolute, so Ray processes and the printed UI command use the same file."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + os.path.abspath(uri[len(prefix):])
    return uri


class NullTracker:
    """Used when tracking.enabled is false."""

    run_id: str | None = None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def finish(self, status: str) -> None: ...


class MlflowTracker:
    """Wraps the MLflow client with explicit run ids (no global active run, safe from callback threads)."""

    def __init__(self, cfg: TrackingConfig, run_name: str, tags: dict[str, str] | None = None,
                 run_id: str | None = None) -> None:
        """A new run, or with `run_id` the existing run reopened (a resumed Tune study or trial)."""
        for key, value in _HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        from mlflow.tracking import MlflowClient

        self.uri = resolve_uri(cfg.uri)
        self._client = MlflowClient(tracking_uri=self.uri)
        self._failed: set[str] = set()
        try:
            experiment = self._client.get_experiment_by_name(cfg.experiment)
            self.experiment_id = (experiment.experiment_id if experiment
                                  else self._client.create_experiment(cfg.experiment))
            if run_id is not None:
                self._client.update_run(run_id, status="RUNNING")
            else:
                run_id = self._client.create_run(self.experiment_id, run_name=run_name, tags=tags).info.run_id
            self.run_id: str | None = run_id
        except Exception as exc:  # unreachable server, bad URI, locked database...
            raise UserError(f"MLflow tracking at '{self.uri}' is unavailable ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}): start the server, fix tracking.uri, "
                            "or set tracking.enabled=false") from None

    def _safe(self, what: str, call: Any, *args: Any, **kwargs: Any) -> None:
        try:
            call(*args, **kwargs)
        except Exception as exc:
            if what not in self._failed:  # warn once per kind of call, not once per step
                self._failed.add(what)
                warnings.warn(f"MLflow {what} failed ({type(exc).__name__}: {exc}); training continues",
                              stacklevel=2)

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        batch = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(batch), 100):  # MLflow caps a batch at 100 params
            self._safe("log_params", self._client.log_batch, self.run_id, params=batch[i:i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()
                 if isinstance(v, int | float) and math.isfinite(v)]
        self._safe("log_metrics", self._client.log_batch, self.run_id, metrics=batch)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self._safe("set_tags", self._client.log_batch, self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._safe("log_artifact", self._client.log_artifact, self.run_id, str(path), artifact_path)

    def finish(self, status: str) -> None:
        self._safe("set_terminated", self._client.set_terminated, self.run_id, status)

    def find_run(self, tags: dict[str, str]) -> str | None:
        """The newest run of this experiment carrying all `tags` (how a resumed study finds its trials' runs)."""
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        try:
            runs = self._client.search_runs([self.experiment_id], query, max_results=1,
                                            order_by=["attributes.start_time DESC"])
        except Exception:
            return None
        return runs[0].info.run_id if runs else None


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
                  run_id: str | None = None) -> Tracker:
    return MlflowTracker(cfg, run_name, tags, run_id) if cfg.enabled else NullTracker()


def ui_command(uri: str) -> str:
    """The exact command that opens the MLflow UI on these results."""
    if uri.startswith(("http://", "https://")):
        return f"open {uri}"
    return f"mlflow ui --backend-store-uri {uri} --port 5000   # then open http://127.0.0.1:5000"
