"""MLflow on the driver: one run per `orchestrator train`. A failing tracking call warns and never
stops training; a store that stops answering mid-run is warned about once, then skipped (tried again
every OUTAGE_RETRY_S). The run's metric points, tags and checkpoint models are written off the
report path by one thread (writer.py): kept while the store is down, all written before the run's
end status.

MlflowTracker logs a run's params, metrics (charted or summarised as view.py names them), summary
table, tags, artifacts and final status through an MlflowClient with explicit run ids; its
checkpoint and dataset logging is in lineage.py. The Tracker protocol, NullTracker and start_tracker
are in tracker.py.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.config import TrackingConfig
from orchestrator.tracking.context import context_tags
from orchestrator.tracking.lineage import Lineage
from orchestrator.tracking.links import _EXPERIMENT_OF, RUNS_VIEW_TAG, runs_view
from orchestrator.tracking.store import is_outage, unavailable
from orchestrator.tracking.uri import credentials_in_clear, mask_password, resolve_uri
from orchestrator.tracking.view import (
    HEADLINE,
    NOTE_TAG,
    SUMMARY_TABLE,
    canonical_key,
    headline_keys,
    headline_note,
    logged_as,
    mlflow_key,
    summary_rows,
)
from orchestrator.tracking.writer import Writer

# A dead tracking server would otherwise stall training for minutes (7 retries, 120 s timeout by
# default).
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
                  "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
# What every process that tracks sets in its environment (a value the user exported wins): the HTTP
# defaults, and no MLflow "View run ... at <tracking URI>" line on stdout: the product prints the
# run's URL itself (training view, no credentials), and MLflow's would show a password in the URI.
PROCESS_SETTINGS = {**_HTTP_DEFAULTS, "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
# Once the store stops answering, calls are skipped (not each charged those retries) and one is
# tried again after this long: a dead server costs one warning and a few seconds, not a stalled
# driver and a warning per report.
OUTAGE_RETRY_S = 30.0
_WARNED: set[str] = set()  # the exposure warnings this process printed
# A param the config of a resumed run changed (MLflow keeps a param's first value): tagged
# `<prefix><key>: old -> new`.
PARAM_CHANGED = "orchestrator.param_changed."

# The MLflow UI opens an experiment of this kind on its "Training runs" table (a study's trials
# under their parent).
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}


class MlflowTracker(Lineage):
    """Wraps the MLflow client with explicit run ids (no global active run, safe from callback
    threads)."""

    def __init__(self, cfg: TrackingConfig, run_name: str, tags: dict[str, str] | None = None,
                 run_id: str | None = None, headline: str | None = None,
                 context: dict[str, str] | None = None, uri: str | None = None) -> None:
        """A new run, or with `run_id` the existing run reopened (a resumed Tune study or trial).
        `headline`: the task's validation metric (tune.metric), charted with the loss and samples/s
        in the headline section. `context`: the command's context_tags(), taken by a caller that
        opens the run after Ray started (in a Ray job, `ray.init` can remove the working directory
        the commit is read from); else taken here. `uri`: the store as a run's plan resolved it
        (run/plan.py RunPlan.tracking_uri); else `cfg.uri` resolved here."""
        for key, value in PROCESS_SETTINGS.items():
            os.environ.setdefault(key, value)
        from mlflow.tracking import MlflowClient

        # what connects; `mask_password(self.uri)` is what is shown
        self.uri = uri or resolve_uri(cfg.uri)
        if (warning := credentials_in_clear(self.uri)) is not None and warning not in _WARNED:
            _WARNED.add(warning)  # once per command, not once per trial
            print(warning, file=sys.stderr, flush=True)
        self._client = MlflowClient(tracking_uri=self.uri)
        self._failed: set[str] = set()
        # calls come from the report thread and the driver's main thread
        self._lock = threading.Lock()
        # while the store is unreachable: when to try it again
        self._down_until: float | None = None
        self._skipped = 0
        self._summary: dict[str, Any] = {}  # the summary table's figures, written when the run ends
        self._metric = headline
        self._headline = headline_keys(headline)
        # A series is charted from its first change on; until then its value and (timestamp, step)s
        # wait here, and one that never changed is a row of the summary table instead (a constant is
        # not a chart). The headline is charted from its first point: a driver that dies before a
        # change must not lose it.
        self._charted: set[str] = set(self._headline)
        self._held: dict[str, tuple[float, list[tuple[int, int]]]] = {}
        self._noted = False  # a description set by the caller is kept
        self._reopened = run_id is not None  # its params and tags may be there already
        # Checkpoint models (checkpoint_models.py) by step, the points of linked series sent per
        # step, and the (name, digest) of the datasets they are measured on: a step's metrics are
        # linked to its checkpoint's model whichever of the report and the checkpoint's commit
        # reaches the driver first.
        self._models: dict[int, str] = {}
        self._sent: dict[int, list[tuple[str, str, float, int]]] = {}
        self._datasets: dict[str, tuple[str, str]] = {}
        # the tags this process set: one set again to its value is not rewritten
        self._tags: dict[str, str] = {}
        self._dropped_warned = False  # the writer's one line for points dropped during an outage
        self.run_id: str | None = None  # from when the run exists
        self.writer = Writer(lambda **batch: self._client.log_batch(self.run_id, **batch),
                             self._attempt, self._dropping)
        try:
            self._open(cfg.experiment, run_name, tags, run_id, context)
        # Ctrl+C once the run is RUNNING: it ends KILLED, as after the set-up
        except KeyboardInterrupt:
            if self.run_id is not None:
                self.finish("KILLED")
            raise
        except Exception as exc:  # unreachable server, bad URI, locked database...
            raise unavailable(self.uri, exc) from None

    def _open(self, experiment_name: str, run_name: str, tags: dict[str, str] | None,
              run_id: str | None, context: dict[str, str] | None) -> None:
        """The experiment found (tagged, or made) and the run created, or reopened RUNNING with what
        it charted."""
        experiment = self._client.get_experiment_by_name(experiment_name)
        if experiment is None:
            self.experiment_id = self._client.create_experiment(experiment_name,
                                                                tags=EXPERIMENT_TAGS)
            kept: dict[str, str] = dict(EXPERIMENT_TAGS)
        else:
            self.experiment_id, kept = experiment.experiment_id, experiment.tags
            # one made before the tag existed; never another kind
            for key, value in EXPERIMENT_TAGS.items():
                if key not in kept:
                    self._client.set_experiment_tag(self.experiment_id, key, value)
        # The runs table's columns: the headline, the validation metric first (what runs are
        # compared by).
        headline = sorted(self._headline.values(),
                          key=lambda key: not key.startswith(f"{HEADLINE}val_"))
        view = runs_view(headline, kept.get(RUNS_VIEW_TAG))
        if view != kept.get(RUNS_VIEW_TAG):
            self._client.set_experiment_tag(self.experiment_id, RUNS_VIEW_TAG, view)
        if run_id is not None:
            self.run_id = run_id  # first: a Ctrl+C right after the update still ends it KILLED
            self._client.update_run(run_id, status="RUNNING")
            # What an earlier session charted stays charted, constant or not from here on.
            self._charted |= {canonical_key(k) for k in self._client.get_run(run_id).data.metrics}
        else:
            run_tags = (context or context_tags()) | (tags or {})
            run_id = self._client.create_run(self.experiment_id, run_name=run_name,
                                             tags=run_tags).info.run_id
        self.run_id = run_id
        _EXPERIMENT_OF[run_id] = self.experiment_id

    def _safe(self, what: str, call: Any, *args: Any, force: bool = False, **kwargs: Any) -> None:
        """Make one tracking call; a failure prints one warning line (once) and never raises. While
        the store is unreachable, calls are skipped until OUTAGE_RETRY_S has passed; `force` tries
        anyway (the final status)."""
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
        # the product's own line: on the terminal even while the libraries' go to the run log
        if message:
            print(f"warning: {message}", file=sys.stderr, flush=True)

    def _attempt(self, what: str, call: Any, force: bool) -> str:
        """The writer's call (writer.py): "done", "refused" (the store answered no: warned once per
        kind of call) or "down" (the store does not answer, or did not lately: not tried until
        OUTAGE_RETRY_S has passed, unless `force`), which the writer keeps for the next try."""
        with self._lock:
            if not force and self._down_until is not None and time.monotonic() < self._down_until:
                return "down"
        try:
            call()
        except Exception as exc:
            message, outcome = self._failure(what, exc), "down" if is_outage(exc) else "refused"
        else:
            message, outcome = self._answered(), "done"
        if message:
            print(f"warning: {message}", file=sys.stderr, flush=True)
        return outcome

    def _dropping(self, count: int) -> None:
        """The writer dropped the oldest `count` points a store that does not answer left waiting:
        said once."""
        with self._lock:
            if self._dropped_warned:
                return
            self._dropped_warned = True
        print(f"warning: MLflow tracking at '{mask_password(self.uri)}' has not "
              "taken this run's points for a while: the oldest beyond the last "
              f"{self.writer.limit:,} are dropped (the run's end says how many)",
              file=sys.stderr, flush=True)

    def flush(self) -> None:
        """Write what the writer holds now and wait for it (kept if the store is down)."""
        self.writer.flush()

    def _failure(self, what: str, exc: Exception) -> str | None:
        """The warning to show for a failed call, or None when this failure was already reported."""
        detail = mask_password(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}")
        with self._lock:
            if not is_outage(exc):  # the store answered and refused this call: others still work
                if what in self._failed:  # warn once per kind of call, not once per step
                    return None
                self._failed.add(what)
                return (f"MLflow {what} was refused by '{mask_password(self.uri)}' ({detail}); "
                        "training continues")
            first = self._down_until is None
            self._down_until = time.monotonic() + OUTAGE_RETRY_S
            if not first:  # still down: one warning per outage
                return None
        return (f"MLflow tracking at '{mask_password(self.uri)}' failed ({what}: {detail}); "
                f"training continues without it, trying again every {OUTAGE_RETRY_S:.0f} s")

    def _answered(self) -> str | None:
        """After an outage, the note that the store answers again and how many calls were lost
        meanwhile."""
        with self._lock:
            if self._down_until is None:
                return None
            skipped, self._down_until, self._skipped = self._skipped, None, 0
        skipped_line = (f"; {skipped} other tracking calls were skipped while it was down"
                        if skipped else "")
        return (f"MLflow tracking at '{mask_password(self.uri)}' answers again: "
                f"the points and tags kept meanwhile are written{skipped_line}")

    def log_params(self, params: dict[str, Any]) -> None:
        """Params not logged yet. MLflow refuses to change a param's value (a resumed run's config
        may: a resize), so a changed one keeps its first value and gets a tag `PARAM_CHANGED<key>:
        old -> new`; one changed back loses that tag."""
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
        changed = [RunTag(PARAM_CHANGED + k, f"{logged[k][:3900]} -> {v[:3900]}")
                   for k, v in values.items() if k in logged and logged[k] != v]
        for i in range(0, len(changed), 100):
            self._safe("set_tags", self._client.log_batch, self.run_id, tags=changed[i:i + 100])
        for key in stale:
            self._safe("set_tags", self._client.delete_tag, self.run_id, key)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Figures under the loop's names (a report, the ledger's, the start-up breakdown): each
        under its `mlflow_key`, as a point at `step` of a charted series (the headline three under
        HEADLINE) or (`logged_as`) a row of the summary table, written when the run ends. A series
        is charted from the report that changes its value, with the points before it; one reported
        more than once that never changes ends in the summary table (one reported once is charted
        when the run ends)."""
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
        if batch:  # off the report path: written by the writer's thread
            self.writer.put(*(("metric", metric) for metric in batch))

    def _points(self, key: str, value: float, now: int, step: int) -> list[tuple[float, int, int]]:
        """The (value, timestamp, step) points of series `key` to log now: none while it has kept
        one value."""
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

    def summary(self) -> dict[str, Any]:
        """The summary table's figures so far, by MLflow key."""
        with self._lock:
            return dict(self._summary)

    def _log_summary(self) -> None:
        """The summary table as `summary.json` (MLflow's table format: `section`, `figure` and
        `value` columns, one row per figure, rounded, grouped by section), replacing the one an
        earlier session of this run wrote; shown in the UI like `log_table`'s. Series reported twice
        or more that never changed join it here."""
        from mlflow.entities import Metric

        # a series reported once is not known to be constant: a point (an early-stopped trial's
        # metric)
        single = []
        with self._lock:
            for key, (value, points) in self._held.items():
                if len(points) > 1:
                    self._summary[key] = value
                else:
                    single += [(key, value, t, s) for t, s in points]
            self._held.clear()
        once = [Metric(self._headline.get(key, key), value, t, s, **self._link(key, s))
                for key, value, t, s in single]
        self.writer.put(*(("metric", metric) for metric in once))
        figures = self.summary()
        if not figures:
            return
        self.log_table(SUMMARY_TABLE, ["section", "figure", "value"], summary_rows(figures))
        note = headline_note(figures, self._metric)
        if note and not self._noted:
            self._safe("set_tags", self._client.set_tag, self.run_id, NOTE_TAG, note)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        """A table artifact `name` (a .json file in MLflow's table format: `columns` and `data`
        rows, as `MlflowClient.log_table` writes it), replacing one of that name, and listed by the
        UI as a table."""
        table = {"columns": columns, "data": rows}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_text(json.dumps(table, indent=1, allow_nan=False, default=str) + "\n")
            self._safe("log_table", self._client.log_artifact, self.run_id, str(path))
        self._safe("log_table", self._mark_table, name)

    def _mark_table(self, name: str) -> None:
        """The tag by which the UI lists the artifact as a table (what `MlflowClient.log_table`
        sets)."""
        tags = self._client.get_run(self.run_id).data.tags
        tables = json.loads(tags.get("mlflow.loggedArtifacts", "[]"))
        entry = {"path": name, "type": "table"}
        if entry not in tables:
            self._client.set_tag(self.run_id, "mlflow.loggedArtifacts",
                                 json.dumps([*tables, entry]))

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self._noted = self._noted or NOTE_TAG in tags
        # a tag set again to the value it has (the precision with every report) is not rewritten
        with self._lock:
            new = {k: str(v) for k, v in tags.items() if self._tags.get(k) != str(v)}
            self._tags |= new
        self.writer.put(*(("tag", RunTag(k, v)) for k, v in new.items()))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._safe("log_artifact", self._client.log_artifact, self.run_id, str(path), artifact_path)

    def finish(self, status: str) -> None:
        """Write what the writer holds and the summary table, then end the run with `status` (tried
        even while the store is down): the end status last. What a store still down did not take is
        said in one line."""
        self._log_summary()
        left = self.writer.flush(end=True)
        if self.writer.lost:
            why = (f"{left:,} of them as the run ended: it did not answer" if left
                   else "dropped while it did not answer")
            print(f"warning: {self.writer.lost:,} metric points and tags of this run "
                  f"were not written to MLflow at '{mask_password(self.uri)}' ({why})",
                  file=sys.stderr, flush=True)
        self._safe("set_terminated", self._client.set_terminated, self.run_id, status, force=True)

    def find_run(self, tags: dict[str, str]) -> str | None:
        """The newest run of this experiment carrying all `tags` (how a resumed study finds its
        trials' runs)."""
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        try:
            runs = self._client.search_runs([self.experiment_id], query, max_results=1,
                                            order_by=["attributes.start_time DESC"])
        except Exception:
            return None
        return runs[0].info.run_id if runs else None


