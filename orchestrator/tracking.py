"""MLflow on the driver: one run per `orchestrator train`. A failing tracking call warns and never stops training;
a store that stops answering mid-run is warned about once, then skipped (tried again every OUTAGE_RETRY_S)."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from orchestrator.config import TrackingConfig
from orchestrator.errors import UserError

# A dead tracking server would otherwise stall training for minutes (7 retries, 120 s timeout by default).
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
                  "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
# Once the store stops answering, calls are skipped (not each charged those retries) and one is tried again after
# this long: a dead server costs one warning and a few seconds, not a stalled driver and a warning per report.
OUTAGE_RETRY_S = 30.0


class Tracker(Protocol):
    run_id: str | None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def finish(self, status: str) -> None: ...


DEFAULT_URI = "sqlite:///mlruns.db"


def mlflow_key(name: str) -> str:
    """The MLflow metric key under which a metric the loop reports as `name` is logged (and read back)."""
    return name


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
        self._lock = threading.Lock()  # calls come from the report thread and the driver's main thread
        self._down_until: float | None = None  # while the store is unreachable: when to try it again
        self._skipped = 0
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

    def _safe(self, what: str, call: Any, *args: Any, force: bool = False, **kwargs: Any) -> None:
        """Make one tracking call; a failure prints one warning line (once) and never raises. While the store is
        unreachable, calls are skipped until OUTAGE_RETRY_S has passed; `force` tries anyway (the final status)."""
        with self._lock:
            if not force and self._down_until is not None and time.monotonic() < self._down_until:
                self._skipped += 1
                return
        try:
            call(*args, **kwargs)
        except Exception as exc:
            message = self._failure(what, exc)
        else:
            message = self._answered()
        if message:  # the product's own line: on the terminal even while the libraries' go to the run log
            print(f"warning: {message}", file=sys.stderr, flush=True)

    def _failure(self, what: str, exc: Exception) -> str | None:
        """The warning to show for a failed call, or None when this failure was already reported."""
        from mlflow.exceptions import RestException

        detail = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
        with self._lock:
            if isinstance(exc, RestException):  # the store answered and refused this call: others still work
                if what in self._failed:  # warn once per kind of call, not once per step
                    return None
                self._failed.add(what)
                return f"MLflow {what} was refused by '{self.uri}' ({detail}); training continues"
            first = self._down_until is None
            self._down_until = time.monotonic() + OUTAGE_RETRY_S
            if not first:  # still down: one warning per outage
                return None
        return (f"MLflow tracking at '{self.uri}' failed ({what}: {detail}); training continues without it, "
                f"trying again every {OUTAGE_RETRY_S:.0f} s")

    def _answered(self) -> str | None:
        """After an outage, the note that the store answers again and how many calls were lost meanwhile."""
        with self._lock:
            if self._down_until is None:
                return None
            skipped, self._down_until, self._skipped = self._skipped, None, 0
        return f"MLflow tracking at '{self.uri}' answers again; {skipped} tracking calls were skipped while it was down"

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        batch = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(batch), 100):  # MLflow caps a batch at 100 params
            self._safe("log_params", self._client.log_batch, self.run_id, params=batch[i:i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
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
        self._safe("set_terminated", self._client.set_terminated, self.run_id, status, force=True)

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
