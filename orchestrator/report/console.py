"""What reaches the user's terminal: the product's own lines. Ray's and MLflow's (their loggers,
Python warnings, the output Ray forwards from the workers and raylets) go to a log file under the
run's directory, and to the terminal too with `--verbose`. Driver side only."""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from orchestrator.ray_internals import autoscaler_events, ray_data_logging_config, worker_output

# Loggers of the libraries the driver runs; a logger below these names goes where its parent goes.
LIBRARIES = ("ray", "mlflow", "alembic", "sqlalchemy", "urllib3", "filelock", "transformers",
             "huggingface_hub", "torch", "py.warnings")
# What the workers print that is the product's own: shown on the terminal (a worker's warnings.warn
# from the product's modules is shown as `warning: <message>`).
_WORKER_LINE = re.compile(r"^(auto micro-batch: |warning: )")
_PRODUCT_WARNING = re.compile(r"/(?:orchestrator|pipelines)/[\w/]+\.py:\d+: \w*Warning: (.*)$")


def product_line(line: str) -> str | None:
    """The terminal form of a line a worker printed, or None when it is a library's (it goes to the
    log only)."""
    if _WORKER_LINE.match(line):
        return line
    warning = _PRODUCT_WARNING.search(line)
    return f"warning: {warning.group(1)}" if warning else None


class _PendingFile(logging.Handler):
    """The run's log file, opened once the run has a directory (`open`): records before that are
    kept and written first, so a run refused before it starts (tracking unreachable) leaves no
    directory behind."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.pending: list[logging.LogRecord] = []
        self.file: logging.FileHandler | None = None

    def open(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with self.lock:  # opened in a thread while Ray logs in the main one: no record lost between
            file = logging.FileHandler(path, encoding="utf-8")
            file.setFormatter(self.formatter)
            for record in self.pending:
                file.handle(record)
            self.pending.clear()
            self.file = file

    def emit(self, record: logging.LogRecord) -> None:
        if self.file is not None:
            self.file.handle(record)
        else:
            self.pending.append(record)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        super().close()


class _ToFile(logging.Filter):
    """On the libraries' loggers and console handlers: every record goes to the log file once, and
    on to the console only when `show`."""

    def __init__(self, log: logging.Handler, show: bool) -> None:
        super().__init__()
        self.log, self.show = log, show

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "_in_run_log", False) and record.levelno >= logging.INFO:
            record._in_run_log = True
            self.log.handle(record)
        return self.show


_ACTIVE: list[RunLog] = []  # the run log of the run in progress in this process, if any


class RayDataConsole(logging.Handler):
    """The console handler of Ray Data's loggers in the product's runs. Ray Data sets its handlers
    up again at every dataset execution (so a filter put on the old ones is lost): the product
    points it, through RAY_DATA_LOGGING_CONFIG, at a config naming this class. Inside a run its
    records go where the run log sends library lines; elsewhere (a worker) to stderr, as Ray Data's
    own handler would."""

    def emit(self, record: logging.LogRecord) -> None:
        if _ACTIVE and _ACTIVE[-1]._filter is not None and not _ACTIVE[-1]._filter.filter(record):
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def ray_data_config(directory: Path) -> Path | None:
    """Ray Data's own logging config with its console handler replaced by RayDataConsole (None where
    Ray's config moved: Ray Data then logs as it would)."""
    import copy

    import yaml

    found = ray_data_logging_config()
    if found is None:
        return None
    config = copy.deepcopy(found)
    config["handlers"]["console"] = {"class": f"{__name__}.RayDataConsole", "formatter": "ray",
                                     "level": "INFO", "filters": ["console_filter"]}
    from pipelines.storage import owner_only

    path = directory / "ray-data-logging.yaml"
    with open(path, "w", opener=owner_only) as out:
        out.write(yaml.safe_dump(config))
    return path


def own_ray_data_config() -> bool:
    """Whether RAY_DATA_LOGGING_CONFIG in this process is the run log's own (a file removed when the
    run ends), not one the user set."""
    return bool(_ACTIVE) and _ACTIVE[-1]._saved.get("ray_data") is None


class RunLog:
    """Diverts the libraries' lines into the run's log file while a run is on (`with RunLog(verbose)
    as log: ...; log.open(path)` once the run has a directory). Call
    `divert()` again once a library has set up more loggers or handlers (ray.init, Ray Data on first
    use)."""

    def __init__(self, verbose: bool = False) -> None:
        self.verbose = verbose
        self._file = _PendingFile()
        self.path: Path | None = None  # the log file, once opened
        self._filter: _ToFile | None = None
        self._diverted: list[logging.Logger | logging.Handler] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> RunLog:
        # its loggers exist from here on, so they are diverted before ray.init logs
        import ray  # noqa: F401

        self._filter = _ToFile(self._file, self.verbose)
        # Warnings become records of `py.warnings`; loggers without a handler anywhere (urllib3's
        # retries) end in logging.lastResort: a fresh one here, diverted like the rest. Handlers
        # that appear on the root logger during the run are Ray's (ray.init's logging_config), not
        # the user's.
        logging.captureWarnings(True)
        self._saved["last_resort"] = logging.lastResort
        logging.lastResort = logging.StreamHandler(sys.stderr)
        logging.lastResort.setLevel(logging.WARNING)
        self._saved["root"] = {id(h) for h in logging.root.handlers}
        # Set in this process, and inherited by the local cluster it starts (a value the user set
        # wins).
        self._saved["ray_data"] = os.environ.get(RAY_DATA_CONFIG)
        if self._saved["ray_data"] is None:
            self._saved["ray_data_dir"] = tempfile.mkdtemp(prefix="orchestrator-")
            if (config := ray_data_config(Path(self._saved["ray_data_dir"]))) is not None:
                os.environ[RAY_DATA_CONFIG] = str(config)
        _ACTIVE.append(self)
        self.divert()
        return self

    def open(self, path: Path) -> None:
        """Start writing the log file at `path` (the lines so far included)."""
        self._file.open(path)
        self.path = path

    def divert(self) -> None:
        """Put the filter on every library logger (the records it creates) and on every console
        handler they or Ray's root handlers print through (records of loggers created since the last
        call)."""
        assert self._filter is not None
        loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
                   if n.split(".")[0] in _ROOTS]
        handlers = [h for lg in loggers for h in lg.handlers]
        handlers += ([h for h in logging.root.handlers if id(h) not in self._saved["root"]]
                     + [logging.lastResort])
        consoles = [h for h in handlers if isinstance(h, logging.StreamHandler) and not isinstance(
            h, logging.FileHandler)]
        for item in [*loggers, *consoles]:
            if self._filter not in item.filters:  # type: ignore[union-attr]
                item.addFilter(self._filter)  # type: ignore[union-attr]
                self._diverted.append(item)  # type: ignore[arg-type]

    def attach_ray(self) -> None:
        """Route what Ray forwards from workers and raylets: every line to the log, the product's to
        the terminal (all of it with --verbose, as Ray prints it)."""
        printer = worker_output()
        if printer is not None and "ray_printer" not in self._saved:
            ray_worker, dispatcher = printer
            self._saved["ray_printer"] = [(n, h) for n, h in dispatcher.handlers
                                          if n == "ray_print_logs"]
            dispatcher.remove_handler("ray_print_logs")
            dispatcher.add_handler("orchestrator", self._worker_lines)
            # Ray's error listener prints what raylets send this driver ("(raylet) WARNING: 12
            # PYTHON worker processes have been started ...") through this function, past the
            # dispatcher.
            self._saved["print_to_stdstream"] = original = ray_worker.print_to_stdstream

            def raylets_to_log(data: dict[str, Any], ignore_prefix: bool = False) -> None:
                if data.get("pid") == "raylet":
                    self._worker_lines(data)
                else:
                    original(data, ignore_prefix)

            ray_worker.print_to_stdstream = raylets_to_log
        self.divert()

    def _worker_lines(self, data: dict[str, Any]) -> None:
        assert self._filter is not None
        log = self._filter.log
        who = data.get("actor_name") or data.get("task_name") or data.get("pid")
        lines = data.get("lines", [])
        # its periodic status table; Ray's own printer keeps only the events too
        if who == "autoscaler":
            lines = autoscaler_events(lines)
        for line in lines:
            record = {"name": f"ray.worker.{who}", "msg": f"pid={data.get('pid')} {line}",
                      "levelname": "stderr" if data.get("is_err") else "stdout"}
            log.handle(logging.makeLogRecord(record))
            shown = line if self.verbose else product_line(line)
            if shown is not None:
                print(shown, file=sys.stderr if data.get("is_err") else sys.stdout, flush=True)

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)
        if self._saved["ray_data"] is None:
            os.environ.pop(RAY_DATA_CONFIG, None)
            shutil.rmtree(self._saved["ray_data_dir"], ignore_errors=True)
        for item in self._diverted:
            item.removeFilter(self._filter)  # type: ignore[arg-type]
        logging.lastResort = self._saved["last_resort"]
        logging.captureWarnings(False)
        # Ray prints what it forwards itself again, as before the run
        if "ray_printer" in self._saved:
            # found when the printer was saved
            ray_worker, dispatcher = worker_output()  # type: ignore[misc]
            dispatcher.remove_handler("orchestrator")
            for name, handler in self._saved["ray_printer"]:
                dispatcher.add_handler(name, handler)
            ray_worker.print_to_stdstream = self._saved["print_to_stdstream"]
        self._file.close()


_ROOTS = {name.split(".")[0] for name in LIBRARIES}
LOG_FILE = "orchestrator.log"  # a run's (or a study's) log, in its directory
RAY_DATA_CONFIG = "RAY_DATA_LOGGING_CONFIG"
