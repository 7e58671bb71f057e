"""MLflow on the driver: one run per `orchestrator train`. A failing tracking call warns and never stops training;
a store that stops answering mid-run is warned about once, then skipped (tried again every OUTAGE_RETRY_S).

What a run holds (the same for a Tune trial's child run and a study's parent run): the loop reports under its own
names (the progress line, the history and Tune use them); `mlflow_key` names each in MLflow, in sections (`train/`,
`val/`, `perf/`, `time/`, `system/`, `memory/`), and `logged_as` says where it goes. The three a user looks for
first, the training loss, the task's validation metric and samples/s, are charted in the `headline/` section, which
the UI shows first (it sorts sections by name). Series that change from report to report are metrics; a series
reported more than once whose values never changed (`comm_bytes_per_sample` on one worker, top-5 accuracy on 5
classes), facts that do not change (the worker's pid, precision, FLOPs per sample, device facts, the start-up
breakdown) and whole-run figures (`final/*`, the cost ledger `cost/*`) go into one `summary.json` table artifact,
rounded and grouped, and the headline figures into the run's description (`mlflow.note.content`).
"""

from __future__ import annotations

import functools
import getpass
import hashlib
import json
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from orchestrator.config import TrackingConfig, flatten, to_dict
from orchestrator.errors import UserError

if TYPE_CHECKING:
    from orchestrator.config import Config, ModelConfig
    from pipelines.sources import DatasetInfo

# A dead tracking server would otherwise stall training for minutes (7 retries, 120 s timeout by default).
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
                  "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
# Once the store stops answering, calls are skipped (not each charged those retries) and one is tried again after
# this long: a dead server costs one warning and a few seconds, not a stalled driver and a warning per report.
OUTAGE_RETRY_S = 30.0
# A param the config of a resumed run changed (MLflow keeps a param's first value): tagged `<prefix><key>: old -> new`.
PARAM_CHANGED = "orchestrator.param_changed."


class Tracker(Protocol):
    run_id: str | None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_datasets(self, infos: Mapping[str, DatasetInfo]) -> None: ...
    def log_checkpoint(self, step: int, uri: str) -> None: ...
    def keep_checkpoints(self, kept: Mapping[str, int | None]) -> None: ...
    def finish(self, status: str) -> None: ...


DEFAULT_URI = "sqlite:///mlruns.db"


# The loop's (and the driver's) names -> MLflow keys. A name not listed keeps its key (a `val_*` becomes `val/*`).
_KEYS = {
    "train_loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "step": "train/step", "epoch": "train/epoch", "samples_seen": "train/samples_seen",
    "skipped_steps": "train/skipped_steps", "nonfinite_skipped": "train/nonfinite_skipped",
    "oom_retries": "train/oom_retries", "micro_batch_size": "train/micro_batch_size",
    "grad_accum_steps": "train/grad_accum_steps", "global_batch": "train/global_batch",
    "precision": "train/precision", "world_size": "train/world_size", "worker_pid": "train/worker_pid",
    # train.parallel's facts: ddp or fsdp, and the fp32 parameter and optimizer-state bytes one worker holds.
    "parallel": "train/parallel", "param_bytes_per_rank": "train/param_bytes_per_rank",
    "optimizer_bytes_per_rank": "train/optimizer_bytes_per_rank",
    "samples_per_s": "perf/samples_per_s", "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu",
    # One name for the interval's data-wait share (the loop reports it twice, as a time/* share and on its own).
    "data_wait_frac": "perf/data_wait_frac", "time/data_wait_frac": "perf/data_wait_frac",
    "comm_bytes": "perf/comm_bytes", "comm_bytes_per_sample": "perf/comm_bytes_per_sample",
    "flops_per_sample": "perf/flops_per_sample", "compile_s": "perf/compile_s",
    "interval_s": "time/interval_s",
}
# Keys whose value does not change from report to report (or that only count rare events): the summary table's.
_FACTS = {"train/step", "train/epoch", "train/samples_seen", "train/skipped_steps", "train/nonfinite_skipped",
          "train/oom_retries", "train/micro_batch_size", "train/grad_accum_steps", "train/global_batch",
          "train/precision", "train/world_size", "train/worker_pid", "perf/comm_bytes", "perf/flops_per_sample",
          "perf/compile_s", "train/parallel", "train/param_bytes_per_rank", "train/optimizer_bytes_per_rank"}
# Sections of whole-run figures, and of a study's (`study/`): rows of the summary table, never charted.
_SUMMARY_SECTIONS = ("final/", "cost/", "startup/", "device/", "study/")
# The summary table's groups, in the order a reader wants them; a figure of another section comes after.
_SUMMARY_ORDER = ("final", "study", "cost", "startup", "train", "val", "perf", "device")
# What only the driver uses: when a report arrived, the worker's start-up marks, which rank reported, events.
_DROPPED = {"elapsed_s", "world_rank", "drain_checkpoint"}
SUMMARY_TABLE = "summary.json"
# The MLflow UI opens an experiment of this kind on its "Training runs" table (a study's trials under their parent).
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
# The section that holds the training loss, the task's validation metric and samples/s: MLflow 3's run page sorts
# its chart sections by name (plain string order), so this one comes before memory/, perf/, train/, val/...
HEADLINE = "headline/"
NOTE_TAG = "mlflow.note.content"  # the run's description in the UI
SIGNIFICANT = 4  # digits of a figure in the summary table


def mlflow_key(name: str) -> str:
    """The MLflow key under which a figure the loop (or the driver) reports as `name` is logged and read back: a
    metric's, or a row of the summary table's (`logged_as` says which). Idempotent: a key maps to itself.
    `summary/<name>` (a whole-run figure of `name`) -> `final/<mlflow_key(name)>`."""
    if name.startswith("summary/"):
        return "final/" + mlflow_key(name.removeprefix("summary/"))
    if name in _KEYS:
        return _KEYS[name]
    if name.startswith("val_"):
        return "val/" + name.removeprefix("val_")
    return name


def logged_as(key: str) -> Literal["metric", "summary"] | None:
    """Where the figure under MLflow key `key` goes: a metric (a series over steps; one whose values never change is
    moved to the summary table when the run ends, see MlflowTracker), a row of the run's summary table, or nowhere
    (None: the driver's own bookkeeping)."""
    if key in _DROPPED or key.startswith("at/"):
        return None
    if key in _FACTS or key.startswith(_SUMMARY_SECTIONS):
        return "summary"
    return "metric"


def headline_keys(metric: str | None) -> dict[str, str]:
    """MLflow key -> the key it is charted under in the headline section: the training loss, the task's validation
    metric `metric` (tune.metric, resolved per task; val_loss when it is not a validation figure) and samples/s."""
    val = metric if metric and metric.startswith("val_") else "val_loss"
    return {mlflow_key(name): HEADLINE + name for name in ("train_loss", val, "samples_per_s")}


def canonical_key(key: str) -> str:
    """The MLflow key a charted key reads back as: `headline/<name>` -> `mlflow_key(name)`, anything else itself."""
    return mlflow_key(key.removeprefix(HEADLINE)) if key.startswith(HEADLINE) else key


def chart_key(key: str, metric: str | None) -> str:
    """The key under which the metric with MLflow key `key` is charted, on a run whose validation metric is
    `metric`."""
    return headline_keys(metric).get(key, key)


def rounded(value: Any) -> Any:
    """A float to SIGNIFICANT significant digits (what the summary table shows); anything else as it is."""
    if isinstance(value, float) and math.isfinite(value) and value != 0:
        return float(f"{value:.{SIGNIFICANT}g}")
    return value


def summary_rows(figures: Mapping[str, Any]) -> list[list[Any]]:
    """[section, figure, value] rows of the summary table: grouped by section (_SUMMARY_ORDER first), by name
    within one, each value rounded."""
    def order(key: str) -> tuple[int, str]:
        section = key.split("/")[0]
        return (_SUMMARY_ORDER.index(section) if section in _SUMMARY_ORDER else len(_SUMMARY_ORDER), key)

    return [[key.split("/")[0] if "/" in key else "run", key, rounded(figures[key])]
            for key in sorted(figures, key=order)]


def headline_note(figures: Mapping[str, Any], metric: str | None = None) -> str:
    """The run's description: its headline figures in one line, from the summary table's figures (by MLflow key),
    the task's validation `metric` first."""
    parts = []
    val = {k.removeprefix("final/val/"): v for k, v in figures.items() if k.startswith("final/val/")}
    head = (metric or "").removeprefix("val_")
    if val:
        names = sorted(val, key=lambda n: (n != head, n != "loss", n))[:2]
        text = ", ".join(f"val_{n} {rounded(float(val[n])):.4g}" for n in names)
        step = figures.get("train/step")
        parts.append(text + (f" at step {int(step)}" if isinstance(step, int | float) else ""))
    if isinstance(figures.get("final/perf/samples_per_s"), int | float):
        parts.append(f"{figures['final/perf/samples_per_s']:,.0f} samples/s over the training")
    if isinstance(figures.get("startup/total_s"), int | float):
        parts.append(f"start-up {figures['startup/total_s']:.1f} s")
    if isinstance(figures.get("cost/wall_s"), int | float):
        wall = f"{figures['cost/wall_s']:.0f} s wall clock"
        if isinstance(figures.get("cost/productive_frac"), int | float):
            share = figures["cost/productive_frac"]
            wall += f", productive {share:.0%}" if share >= 0.1 else f", productive {share:.1%}"
        parts.append(wall)
    if isinstance(figures.get("cost/usd"), int | float):
        parts.append(f"${figures['cost/usd']:.4f}")
    return "; ".join(parts) + ("." if parts else "") + (" All run-level figures: the summary.json artifact."
                                                       if parts else "")


# `scheme://user:PASSWORD@host`: the password of a URI's userinfo (up to the authority's last @).
_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/@:]*):[^\s/]*@")


def mask_password(text: str) -> str:
    """`text` with the password of every URI in it (`postgresql://user:PASSWORD@host/db`, an http server's
    `http://user:PASSWORD@host`) replaced by `***`: what is logged, written or printed of a tracking URI (MLflow
    params cannot be deleted). Never what the product connects with."""
    return _PASSWORD.sub(r"\1:***@", text)


def without_userinfo(url: str) -> str:
    """An http(s) URL without its `user:password@`: the address to open in a browser, which asks for the
    credentials itself."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])) if "@" in parts.netloc else url


def resolve_uri(uri: str | None) -> str:
    """The configured URI, else $MLFLOW_TRACKING_URI (set by cluster runtime envs), else a local SQLite file.
    A relative SQLite path becomes absolute, so Ray processes and the printed UI command use the same file."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    store = sqlite_file(uri)
    return "sqlite:///" + os.path.abspath(store) if store is not None and not os.path.isabs(store) else uri


def sqlite_file(uri: str | None) -> str | None:
    """The database file of the SQLite store that `uri` (else $MLFLOW_TRACKING_URI, else the default) names, as
    written (relative or absolute); None for any other store."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    return uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else None


def check_server_listens(cfg: TrackingConfig, timeout_s: float = 3.0) -> None:
    """An http(s) tracking server that nothing listens at fails here, before Ray starts (the MLflow run is otherwise
    opened while Ray starts, and would be found unreachable only once Ray runs). A TCP connect only: whether the
    store works is MlflowTracker's to find out."""
    uri = resolve_uri(cfg.uri)
    if not cfg.enabled or not uri.startswith(("http://", "https://")):
        return
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname or "localhost", port), timeout=timeout_s).close()
    except OSError as exc:
        raise unavailable(uri, exc) from None


def unavailable(uri: str, exc: Exception) -> UserError:
    """The one error for a tracking store the command cannot use at its start."""
    detail = mask_password(str(exc).splitlines()[0]) if str(exc) else ""
    return UserError(f"MLflow tracking at '{mask_password(uri)}' is unavailable ({type(exc).__name__}: {detail}): "
                     "start the server, fix tracking.uri, or set tracking.enabled=false")


class NullTracker:
    """Used when tracking.enabled is false."""

    run_id: str | None = None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_datasets(self, infos: Mapping[str, DatasetInfo]) -> None: ...
    def log_checkpoint(self, step: int, uri: str) -> None: ...
    def keep_checkpoints(self, kept: Mapping[str, int | None]) -> None: ...
    def finish(self, status: str) -> None: ...


class MlflowTracker:
    """Wraps the MLflow client with explicit run ids (no global active run, safe from callback threads)."""

    def __init__(self, cfg: TrackingConfig, run_name: str, tags: dict[str, str] | None = None,
                 run_id: str | None = None, headline: str | None = None,
                 context: dict[str, str] | None = None) -> None:
        """A new run, or with `run_id` the existing run reopened (a resumed Tune study or trial). `headline`: the
        task's validation metric (tune.metric), charted with the loss and samples/s in the headline section.
        `context`: the command's context_tags(), taken by a caller that opens the run while Ray starts (in a Ray
        job, `ray.init` can remove the working directory the commit is read from); else taken here."""
        for key, value in _HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        # MLflow's own "View run ... at <tracking URI>" line on stdout: the product prints the run's URL itself
        # (training view, no credentials), and MLflow's would show a password in the URI.
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        from mlflow.tracking import MlflowClient

        self.uri = resolve_uri(cfg.uri)  # what connects; `mask_password(self.uri)` is what is shown
        self._client = MlflowClient(tracking_uri=self.uri)
        self._failed: set[str] = set()
        self._lock = threading.Lock()  # calls come from the report thread and the driver's main thread
        self._down_until: float | None = None  # while the store is unreachable: when to try it again
        self._skipped = 0
        self._summary: dict[str, Any] = {}  # the summary table's figures, written when the run ends
        self._metric = headline
        self._headline = headline_keys(headline)
        # A series is charted from its first change on; until then its value and (timestamp, step)s wait here, and
        # one that never changed is a row of the summary table instead (a constant is not a chart). The headline is
        # charted from its first point: a driver that dies before a change must not lose it.
        self._charted: set[str] = set(self._headline)
        self._held: dict[str, tuple[float, list[tuple[int, int]]]] = {}
        self._noted = False  # a description set by the caller is kept
        self._reopened = run_id is not None  # its params and tags may be there already
        # Checkpoint models (checkpoint_models.py) by step, the points of linked series sent per step, and the
        # (name, digest) of the datasets they are measured on: a step's metrics are linked to its checkpoint's
        # model whichever of the report and the checkpoint's commit reaches the driver first.
        self._models: dict[int, str] = {}
        self._sent: dict[int, list[tuple[str, str, float, int]]] = {}
        self._datasets: dict[str, tuple[str, str]] = {}
        self.run_id: str | None = None  # from when the run exists
        try:
            experiment = self._client.get_experiment_by_name(cfg.experiment)
            if experiment is None:
                self.experiment_id = self._client.create_experiment(cfg.experiment, tags=EXPERIMENT_TAGS)
            else:
                self.experiment_id = experiment.experiment_id
                for key, value in EXPERIMENT_TAGS.items():  # one made before the tag existed; never another kind
                    if key not in experiment.tags:
                        self._client.set_experiment_tag(self.experiment_id, key, value)
            if run_id is not None:
                self.run_id = run_id  # first: a Ctrl+C right after the update still ends it KILLED
                self._client.update_run(run_id, status="RUNNING")
                # What an earlier session charted stays charted, constant or not from here on.
                self._charted |= {canonical_key(k) for k in self._client.get_run(run_id).data.metrics}
            else:
                run_id = self._client.create_run(self.experiment_id, run_name=run_name,
                                                 tags=(context or context_tags()) | (tags or {})).info.run_id
            self.run_id = run_id
            _EXPERIMENT_OF[run_id] = self.experiment_id
        except KeyboardInterrupt:  # Ctrl+C once the run is RUNNING: it ends KILLED, as after the set-up
            if self.run_id is not None:
                self.finish("KILLED")
            raise
        except Exception as exc:  # unreachable server, bad URI, locked database...
            raise unavailable(self.uri, exc) from None

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
        detail = mask_password(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}")
        with self._lock:
            if not is_outage(exc):  # the store answered and refused this call: others still work
                if what in self._failed:  # warn once per kind of call, not once per step
                    return None
                self._failed.add(what)
                return f"MLflow {what} was refused by '{mask_password(self.uri)}' ({detail}); training continues"
            first = self._down_until is None
            self._down_until = time.monotonic() + OUTAGE_RETRY_S
            if not first:  # still down: one warning per outage
                return None
        return (f"MLflow tracking at '{mask_password(self.uri)}' failed ({what}: {detail}); training continues "
                f"without it, "
                f"trying again every {OUTAGE_RETRY_S:.0f} s")

    def _answered(self) -> str | None:
        """After an outage, the note that the store answers again and how many calls were lost meanwhile."""
        with self._lock:
            if self._down_until is None:
                return None
            skipped, self._down_until, self._skipped = self._skipped, None, 0
        return (f"MLflow tracking at '{mask_password(self.uri)}' answers again; {skipped} tracking calls were "
                "skipped while it was down")

    def log_params(self, params: dict[str, Any]) -> None:
        """Params not logged yet. MLflow refuses to change a param's value (a resumed run's config may: a resize),
        so a changed one keeps its first value and gets a tag `PARAM_CHANGED<key>: old -> new`; one changed back
        loses that tag."""
        from mlflow.entities import Param, RunTag

        values = {k: str(v)[:6000] for k, v in params.items()}
        logged: dict[str, str] = {}
        stale: list[str] = []
        if self._reopened:
            run: list[Any] = []
            self._safe("get_run", lambda: run.append(self._client.get_run(self.run_id)))
            if run:
                logged, tags = run[0].data.params, run[0].data.tags
                stale = [PARAM_CHANGED + k for k, v in values.items()
                         if logged.get(k) == v and PARAM_CHANGED + k in tags]
        batch = [Param(k, v) for k, v in values.items() if k not in logged]
        for i in range(0, len(batch), 100):  # MLflow caps a batch at 100 params
            self._safe("log_params", self._client.log_batch, self.run_id, params=batch[i:i + 100])
        changed = [RunTag(PARAM_CHANGED + k, f"{logged[k][:3900]} -> {v[:3900]}") for k, v in values.items()
                   if k in logged and logged[k] != v]
        for i in range(0, len(changed), 100):
            self._safe("set_tags", self._client.log_batch, self.run_id, tags=changed[i:i + 100])
        for key in stale:
            self._safe("set_tags", self._client.delete_tag, self.run_id, key)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Figures under the loop's names (a report, the ledger's, the start-up breakdown): each under its
        `mlflow_key`, as a point at `step` of a charted series (the headline three under HEADLINE) or (`logged_as`)
        a row of the summary table, written when the run ends. A series is charted from the report that changes
        its value, with the points before it; one reported more than once that never changes ends in the summary
        table (one reported once is charted when the run ends)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = []
        for name, value in metrics.items():
            key = mlflow_key(name)
            where = logged_as(key)
            if (where is None or isinstance(value, bool) or not isinstance(value, int | float | str)
                    or (not isinstance(value, str) and not math.isfinite(value))):
                continue
            if where == "summary":
                with self._lock:
                    self._summary[key] = value
            elif not isinstance(value, str):
                chart = self._headline.get(key, key)
                for v, t, s in self._points(key, float(value), now, step):
                    batch.append(Metric(chart, v, t, s, **self._link(key, s)))
                    self._remember(key, chart, v, t, s)
        if batch:
            self._safe("log_metrics", self._client.log_batch, self.run_id, metrics=batch)

    def _points(self, key: str, value: float, now: int, step: int) -> list[tuple[float, int, int]]:
        """The (value, timestamp, step) points of series `key` to log now: none while it has kept one value."""
        with self._lock:
            if key in self._charted:
                return [(value, now, step)]
            held = self._held.get(key)
            if held is None or held[0] == value:
                self._held.setdefault(key, (value, []))[1].append((now, step))
                return []
            del self._held[key]
            self._charted.add(key)
        return [(held[0], t, s) for t, s in held[1]] + [(value, now, step)]

    def log_checkpoint(self, step: int, uri: str) -> None:
        """A checkpoint Ray Train committed (at `uri`, of `step`) as an external LoggedModel of the run, with the
        metrics of its step linked to it: those already logged now (the same points again: the store keeps one),
        the others as they are logged."""
        from mlflow.entities import Metric

        from orchestrator.checkpoint_models import create_checkpoint_model

        created: list[str] = []
        self._safe("log_checkpoint", lambda: created.append(
            create_checkpoint_model(self._client, self.experiment_id, self.run_id, step, uri)))
        if not created:
            return
        with self._lock:
            self._models[step] = created[0]
            sent = list(self._sent.get(step, []))
        linked = [Metric(chart, v, t, step, **self._link(key, step)) for key, chart, v, t in sent]
        if linked:
            self._safe("log_metrics", self._client.log_batch, self.run_id, metrics=linked)

    def keep_checkpoints(self, kept: Mapping[str, int | None]) -> None:
        """The checkpoints in storage at the run's end ({URI: step}): the models of the others (deleted by
        retention) are deleted, and one the driver never heard of (committed while an earlier attempt's driver
        was going away) is made now, with the run's points of its step linked."""
        from orchestrator.checkpoint_models import delete_dropped

        modelled: list[set[str]] = []
        self._safe("log_checkpoint", lambda: modelled.append(
            delete_dropped(self._client, self.experiment_id, self.run_id, set(kept))))
        for uri, step in kept.items():
            if modelled and uri not in modelled[0] and step is not None:
                self.log_checkpoint(step, uri)
                if step in self._models:
                    self._safe("log_metrics", self._link_logged, step)

    def _link_logged(self, step: int) -> None:
        """Link the run's points at `step` in the store (an earlier attempt's) to the step's checkpoint model."""
        from mlflow.entities import Metric

        keys = [key for key in self._client.get_run(self.run_id).data.metrics if _linkable(canonical_key(key))]
        points = [Metric(key, m.value, m.timestamp, step, **self._link(canonical_key(key), step)) for key in keys
                  for m in self._client.get_metric_history(self.run_id, key) if m.step == step]
        if points:
            self._client.log_batch(self.run_id, metrics=points)

    def _link(self, key: str, step: int) -> dict[str, str]:
        """Metric(...)'s arguments linking a point of series `key` at `step` to the step's checkpoint model and to
        the dataset it was measured on: the validation figures and the training loss; {} for anything else."""
        with self._lock:
            model = self._models.get(step)
        if not _linkable(key) or model is None:
            return {}
        name, digest = self._datasets.get("val" if key.startswith("val/") else "train", (None, None))
        return {"model_id": model} | ({"dataset_name": name, "dataset_digest": digest} if name else {})

    def _remember(self, key: str, chart: str, value: float, timestamp: int, step: int) -> None:
        """A linkable point sent to the run, for the checkpoint of its step if that comes later (recent steps)."""
        if _linkable(key):
            with self._lock:
                self._sent.setdefault(step, []).append((key, chart, value, timestamp))
                while len(self._sent) > 256:
                    del self._sent[min(self._sent)]

    def summary(self) -> dict[str, Any]:
        """The summary table's figures so far, by MLflow key."""
        with self._lock:
            return dict(self._summary)

    def _log_summary(self) -> None:
        """The summary table as `summary.json` (MLflow's table format: `section`, `figure` and `value` columns,
        one row per figure, rounded, grouped by section), replacing the one an earlier session of this run wrote;
        shown in the UI like `log_table`'s. Series reported twice or more that never changed join it here."""
        from mlflow.entities import Metric

        single = []  # a series reported once is not known to be constant: a point (an early-stopped trial's metric)
        with self._lock:
            for key, (value, points) in self._held.items():
                if len(points) > 1:
                    self._summary[key] = value
                else:
                    single += [(key, value, t, s) for t, s in points]
            self._held.clear()
        once = [Metric(self._headline.get(key, key), value, t, s, **self._link(key, s)) for key, value, t, s in single]
        if once:
            self._safe("log_metrics", self._client.log_batch, self.run_id, metrics=once)
        figures = self.summary()
        if not figures:
            return
        table = {"columns": ["section", "figure", "value"], "data": summary_rows(figures)}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / SUMMARY_TABLE
            path.write_text(json.dumps(table, indent=1, allow_nan=False, default=str) + "\n")
            self._safe("log_table", self._client.log_artifact, self.run_id, str(path))
        self._safe("log_table", self._mark_table)
        note = headline_note(figures, self._metric)
        if note and not self._noted:
            self._safe("set_tags", self._client.set_tag, self.run_id, NOTE_TAG, note)

    def _mark_table(self) -> None:
        """The tag by which the UI lists the artifact as a table (what `MlflowClient.log_table` sets)."""
        tags = self._client.get_run(self.run_id).data.tags
        tables = json.loads(tags.get("mlflow.loggedArtifacts", "[]"))
        entry = {"path": SUMMARY_TABLE, "type": "table"}
        if entry not in tables:
            self._client.set_tag(self.run_id, "mlflow.loggedArtifacts", json.dumps([*tables, entry]))

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self._noted = self._noted or NOTE_TAG in tags
        self._safe("set_tags", self._client.log_batch, self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._safe("log_artifact", self._client.log_artifact, self.run_id, str(path), artifact_path)

    def log_datasets(self, infos: Mapping[str, DatasetInfo]) -> None:
        """The training and validation data as the run's inputs (the UI's Dataset column): `dataset_input` of each."""
        from mlflow.entities import DatasetInput, InputTag

        entities = {split: dataset_entity(info) for split, info in infos.items()}
        self._datasets |= {split: (entity.name, entity.digest) for split, entity in entities.items()}
        inputs = [DatasetInput(entity, [InputTag("mlflow.data.context", _CONTEXTS.get(split, split))])
                  for split, entity in entities.items()]
        if inputs:
            self._safe("log_inputs", self._client.log_inputs, self.run_id, datasets=inputs)

    def finish(self, status: str) -> None:
        """Write the summary table, then end the run with `status` (tried even while the store is down)."""
        self._log_summary()
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


_CONTEXTS = {"train": "training", "val": "validation"}


def _linkable(key: str) -> bool:
    """Whether the series under MLflow key `key` is linked to the checkpoint models of its steps: the validation
    figures and the training loss."""
    return key.startswith("val/") or key == mlflow_key("train_loss")


def dataset_entity(info: DatasetInfo) -> Any:
    """An MLflow Dataset for the Parquet data `info` describes: named by its last two path parts (`digits/train`),
    its URI as source, its columns as schema, its rows, bytes and files as profile; the digest (8 hex digits) of
    the path, schema and row count tells two datasets apart in the UI."""
    from mlflow.entities import Dataset

    path = info.path.rstrip("/")
    name = "/".join(path.split("/")[-2:])
    columns = [{"name": f.name, "type": str(f.type)} for f in info.schema] if info.schema is not None else []
    schema = json.dumps({"mlflow_colspec": columns})
    digest = hashlib.sha256(f"{path}|{schema}|{info.num_rows}".encode()).hexdigest()[:8]
    profile = json.dumps({"num_rows": info.num_rows, "num_bytes": info.num_bytes}
                         | ({"num_files": len(info.files)} if info.files else {}))
    return Dataset(name=name, digest=digest, source_type="s3" if path.startswith("s3://") else "local",
                   source=json.dumps({"uri": path}), schema=schema, profile=profile)


def is_outage(exc: BaseException) -> bool:
    """Whether a failed tracking call means the store cannot be reached now (a connection refused, reset or timed
    out, a database locked or that cannot be opened), not that it answered and refused this call (a changed param, a
    bad key, a deleted run, a missing file): MLflow raises MlflowException for both, the cause tells them apart."""
    import requests
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import ErrorCode

    unreachable: tuple[type[BaseException], ...] = (
        ConnectionError, TimeoutError, requests.ConnectionError, requests.Timeout, requests.exceptions.RetryError)
    botocore = sys.modules.get("botocore.exceptions")  # S3 artifacts; raised only once loaded
    if botocore is not None:
        unreachable += (botocore.ConnectionError, botocore.HTTPClientError)
    unavailable = ErrorCode.Name(ErrorCode.TEMPORARILY_UNAVAILABLE)  # SQLAlchemy's OperationalError, wrapped
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:  # MLflow wraps the requests or SQLAlchemy error
        seen.add(id(cause))
        if isinstance(cause, unreachable) or (isinstance(cause, MlflowException) and cause.error_code == unavailable):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


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


UI_PORT = 5055  # `orchestrator ui`'s default (or the next free one): not 5000, which macOS's AirPlay takes
_EXPERIMENT_OF: dict[str, str] = {}  # run id -> experiment id, for the runs this process tracked
# MLflow 3 opens an experiment on its GenAI views unless asked for the training ones (the experiment's
# `mlflow.experimentKind` tag does not change that in 3.17): every URL the product prints asks.
TRAINING_VIEW = "workflowType=machine_learning"


def ui_base(uri: str, port: int = UI_PORT) -> str:
    """Where the UI for the store `uri` answers: the tracking server itself (without credentials), else the local
    `orchestrator ui`."""
    return without_userinfo(uri).rstrip("/") if uri.startswith(("http://", "https://")) else f"http://127.0.0.1:{port}"


def ui_command(uri: str, experiment: str | None = None) -> str:
    """The command that opens the MLflow UI on these results, as a new shell runs it: this environment's own
    `orchestrator ui` (its path when the environment is not on PATH), or the server's address. No password in it:
    a store whose URI holds one is named by $MLFLOW_TRACKING_URI, which the user exports (README)."""
    if uri.startswith(("http://", "https://")):
        return f"open {ui_base(uri)}"
    shown = mask_password(uri)
    command = f"{orchestrator_program()} ui" + (f" --tracking-uri {shlex.quote(uri)}" if shown == uri else "")
    command += f" --experiment {shlex.quote(experiment)}" if experiment else ""
    return command if shown == uri else f"{command}  # with MLFLOW_TRACKING_URI={shown} exported, password filled in"


def orchestrator_program() -> str:
    """`orchestrator` as a new shell finds this installation: its path in this Python's bin directory (relative to
    the working directory when below it), or the bare name where no such script exists."""
    program = Path(sys.executable).parent / "orchestrator"
    if not program.is_file():
        return "orchestrator"
    try:
        return str(program.relative_to(Path.cwd()))
    except ValueError:
        return str(program)


def experiment_url(uri: str, experiment_id: str, port: int = UI_PORT) -> str:
    """The experiment's runs list in the UI, in its training view."""
    return f"{ui_base(uri, port)}/#/experiments/{experiment_id}?{TRAINING_VIEW}"


def run_url(uri: str, run_id: str, experiment_id: str | None = None, tab: str = "model-metrics",
            port: int = UI_PORT) -> str | None:
    """The run's page in the MLflow UI, on its `tab` (model-metrics: the charts, headline first; overview: the
    description, params and datasets): on the tracking server for an http(s) URI, else on the one `orchestrator ui`
    starts. None when the run's experiment is unknown (not tracked by this process nor given)."""
    experiment_id = experiment_id or _EXPERIMENT_OF.get(run_id)
    if not experiment_id:
        return None
    page = "" if tab == "overview" else f"/{tab}"
    return f"{ui_base(uri, port)}/#/experiments/{experiment_id}/runs/{run_id}{page}?{TRAINING_VIEW}"


def experiment_of(run_id: str) -> str | None:
    """The experiment id of a run this process tracked."""
    return _EXPERIMENT_OF.get(run_id)


def short_run_name(config: Config, place_name: str) -> str:
    """A run's MLflow name, short enough for the runs table and different between runs in its first 20
    characters: the model, its learning rate and 4 hex digits of the run's directory name (`mlp-lr3e-3-0f2a`). A
    model built by `model.entrypoint` is named by its module (`my_models:build` -> `my_models`): the function's
    name is most often a verb (`build`) that says nothing of the model."""
    entrypoint = config.model.entrypoint
    model = (entrypoint.split(":")[0].split(".")[-1] if entrypoint else config.model.name)[:10]
    tag = hashlib.sha1(place_name.encode()).hexdigest()[:4]
    return f"{model}-lr{compact_number(config.optim.lr)}-{tag}"


def compact_number(value: float) -> str:
    """3e-3, 2.5e-4, 0.05, 1: a number in the fewest characters that keep 2 significant digits."""
    if value != 0 and not 1e-2 <= abs(value) < 1e4:
        mantissa, exponent = f"{value:.1e}".split("e")
        return f"{mantissa.removesuffix('.0')}e{int(exponent)}"
    return f"{value:.2g}"


# Run context: MLflow's own tags for where a run came from (the UI's Source and User columns), set on new runs.


def source_name(argv: list[str] | None = None) -> str:
    """The command (`orchestrator train --config ...`) or, for a run started from Python, the script."""
    argv = sys.argv if argv is None else argv
    if not argv or not argv[0]:
        return "<console>"
    program = Path(argv[0])
    if program.name == "orchestrator" or (program.name == "__main__.py" and program.parent.name == "orchestrator"):
        return mask_password(shlex.join(["orchestrator", *argv[1:]]))[:2000]
    return argv[0]


def source_type(environ: Mapping[str, str] | None = None) -> str:
    """JOB for a Ray job's entrypoint (`ray job submit`, a KubeRay RayJob: Ray gives it its job config), else
    LOCAL."""
    environ = os.environ if environ is None else environ
    return "JOB" if "RAY_JOB_CONFIG_JSON_ENV_VAR" in environ else "LOCAL"


def current_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name (a container user without a passwd entry)
        return "unknown"


@functools.cache
def git_commit(directory: str | None = None) -> str | None:
    """HEAD of the git checkout at `directory` (the working directory), or None: not a checkout, no git."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory or os.getcwd(), capture_output=True,
                              text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and len(commit) >= 40 else None


def context_tags() -> dict[str, str]:
    """`mlflow.source.name`, `mlflow.source.type`, `mlflow.user` and, in a git checkout, `mlflow.source.git.commit`."""
    tags = {"mlflow.source.name": source_name(), "mlflow.source.type": source_type(), "mlflow.user": current_user()}
    commit = git_commit(os.getcwd())
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags


# Params: the complete resolved config.


def model_defaults(model: ModelConfig) -> dict[str, Any]:
    """The builder's own options with their signature defaults (what the model is built with when the config leaves
    them out); {} when the builder cannot be loaded here."""
    import inspect

    try:
        from orchestrator.models import model_builder

        parameters = inspect.signature(model_builder(model.name, model.entrypoint)).parameters.values()
    except Exception:  # a checked config loads its builder; anything else is not worth failing tracking over
        return {}
    return {p.name: list(p.default) if isinstance(p.default, tuple) else p.default for p in parameters
            if p.default is not inspect.Parameter.empty and p.name not in ("in_features", "num_classes", "self")
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}


def config_params(config: Config, study: bool = False) -> dict[str, Any]:
    """The flattened resolved config, defaults included: the model's options from its builder's signature under
    `model.*`, overridden by the config's (an option set to null means the builder's default). Keys left null are
    left out, and so is the `tune` section unless `study` (a study's parent run): the full config is the run's
    `config.yaml`. A password in a URI (tracking.uri) is masked."""
    tree = to_dict(config)
    model = tree["model"]
    defaults = model_defaults(config.model)
    tree["model"] = {**model, **{key: value for key, value in defaults.items() if model.get(key) is None}}
    if not study:
        tree.pop("tune", None)
    return {key: mask_password(value) if isinstance(value, str) else value for key, value in flatten(tree).items()
            if value is not None}


# Reading a run back (doctor, tests).


def read_summary(client: Any, run_id: str) -> dict[str, Any]:
    """The run's summary table as {figure: value}; {} when it has none."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = client.download_artifacts(run_id, SUMMARY_TABLE, tmp)
            table = json.loads(Path(path).read_text())
    except Exception:  # no table: a run still going, or one from before the table existed
        return {}
    columns = table.get("columns", [])
    at = columns.index("figure") if "figure" in columns else 0
    value = columns.index("value") if "value" in columns else 1
    return {str(row[at]): row[value] for row in table.get("data", [])}


def read_metrics(client: Any, run_id: str) -> dict[str, list[float]]:
    """Every metric's values in step order (a headline chart's under its own MLflow key), and each number of the
    summary table as a one-value history, all under their MLflow keys: what `RunRecord.values(name)` looks up as
    `mlflow_key(name)`."""
    run = client.get_run(run_id)
    metrics, last_step = {}, None
    for key in run.data.metrics:
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
        metrics[canonical_key(key)] = [m.value for m in history]
        last_step = max([last_step or 0, *(m.step for m in history)])
    for key, value in read_summary(client, run_id).items():
        if key not in metrics and isinstance(value, int | float) and not isinstance(value, bool):
            metrics[key] = [float(value)]
    if mlflow_key("step") not in metrics and last_step is not None:  # a run still going: its table comes at the end
        metrics[mlflow_key("step")] = [float(last_step)]
    return metrics
