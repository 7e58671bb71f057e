"""The MLflow UI a user opens after `orchestrator train`, in a real browser: a short real run into a SQLite store,
`orchestrator ui` started on it (a free port), and the URLs the product printed loaded in headless Chromium at
1600x1200 with a fresh profile. From the rendered DOM: the experiment opens on its training-runs list (not the GenAI
overview), the run's first charts are the loss, the validation metric and samples/s, and its Overview holds the
description. Screenshots stay under runs/ui/ (CI keeps runs/ as artifacts) for a person to look at."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import psutil
import pytest
from terminal import from_a_terminal

from orchestrator import load_config, train
from orchestrator.run.result import TrainResult, summary

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "runs" / "ui"
WINDOW = "1600,1200"
SETTLE_MS = 60_000  # virtual time for the page to fetch and draw its charts (charts render once in the viewport)


def chromium() -> str:
    """Debian's `chromium`, which `make test` installs (scripts/browser.sh) where it can; else the test is skipped
    saying how to install it."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.skip("needs Debian's chromium: `make browser` (or `apt-get install -y chromium` as root) installs it")
    return found


class _Text(HTMLParser):
    """The page's visible text, in document order (scripts and styles left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._hidden = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._hidden += tag in ("script", "style")

    def handle_endtag(self, tag: str) -> None:
        self._hidden -= tag in ("script", "style")

    def handle_data(self, data: str) -> None:
        if data.strip() and not self._hidden:
            self.parts.append(data.strip())


def browse(browser: str, url: str, name: str, profile: Path) -> list[str]:
    """The visible text of `url` once settled (its DOM dumped), and a screenshot as runs/ui/<name>.png."""
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              f"--user-data-dir={profile / name}", f"--window-size={WINDOW}", f"--virtual-time-budget={SETTLE_MS}",
              "--run-all-compositor-stages-before-draw"]
    SHOTS.mkdir(parents=True, exist_ok=True)
    # One browser for both: the DOM goes to stdout, the screenshot (taken at the same settled moment) to the file.
    dom = subprocess.run([*common, "--dump-dom", f"--screenshot={SHOTS / f'{name}.png'}", url], capture_output=True,
                         text=True, timeout=300, check=True)
    (SHOTS / f"{name}.html").write_text(dom.stdout)
    text = _Text()
    text.feed(dom.stdout)
    return text.parts


@pytest.fixture(scope="module")
def browser() -> str:
    """Chromium, looked for (and installed) before anything is trained: a skip costs nothing."""
    return chromium()


@pytest.fixture(scope="module")
def trained(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory, digits_dir: str) -> tuple[TrainResult, str]:
    """`make train`'s run (examples/digits.yaml, the product's defaults: checkpoint.every=auto among them) made
    short, as a user would shorten it: 60 steps, validated three times (so its validation metric is a curve),
    tracked in a SQLite store in a temp dir; with what the command prints after it."""
    tmp = tmp_path_factory.mktemp("ui")
    sets = [f"data.train={digits_dir}/train", f"data.val={digits_dir}/val", f"storage.path={tmp}/runs",
            f"tracking.uri=sqlite:///{tmp}/mlruns.db", "tracking.experiment=ui-tests", "train.max_steps=60",
            "train.log_every=10", "train.eval_every=20"]
    config = load_config(ROOT / "examples" / "digits.yaml", sets)
    assert config.checkpoint.every == "auto"
    with pytest.MonkeyPatch.context() as patch:  # the command that trains it: the run's Source
        patch.setattr(sys, "argv", [str(Path(sys.executable).parent / "orchestrator"), "train", "--config",
                                    "examples/digits.yaml", *(part for value in sets for part in ("--set", value))])
        result = train(config, verbose=False)
    return result, summary(result)


@pytest.fixture(scope="module")
def ui(trained: tuple[TrainResult, str],
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, subprocess.Popen[bytes]]]:
    """`orchestrator ui` as the run's summary prints it (this environment's program), until the module ends: the
    URL it printed, its port and its process (`mlflow ui` and its server run as its children)."""
    result, printed = trained
    command = next(line for line in printed.splitlines() if line.startswith("open the MLflow UI: "))
    argv = command.removeprefix("open the MLflow UI: ").split()
    assert Path(argv[0]).name == "orchestrator" and argv[1] == "ui", command
    log = tmp_path_factory.mktemp("ui-log") / "out.txt"
    with open(log, "w") as out:
        process = subprocess.Popen(from_a_terminal([str(Path(sys.executable).parent / "orchestrator"), *argv[1:]]),
                                   stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (found := re.search(r"^open: (http://127\.0\.0\.1:(\d+)/\S+)$", log.read_text(), re.MULTILINE)):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield found[1], int(found[2]), process
    finally:
        process.send_signal(2)  # Ctrl+C: how a user stops it
        try:
            assert process.wait(timeout=30) == 0, log.read_text()
        finally:
            if process.poll() is None:  # its `mlflow ui` child too: the group it leads
                os.killpg(process.pid, 9)


def on_port(url: str, port: int) -> str:
    """A URL the product printed, on the port the UI took (5055, or a free one when that was taken)."""
    return re.sub(r"^http://127\.0\.0\.1:\d+", f"http://127.0.0.1:{port}", url)


def test_the_printed_urls_open_the_training_views(browser: str, trained: tuple[TrainResult, str],
                                                  ui: tuple[str, int, subprocess.Popen[bytes]],
                                                  tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    result, printed = trained
    experiment_url, port, _ = ui
    run = MlflowClient(result.tracking_uri).get_run(result.run_id)

    # The experiment: the "Model training" runs list with this run and its dataset, not the GenAI overview.
    assert experiment_url.endswith(f"/#/experiments/{run.info.experiment_id}/runs?workflowType=machine_learning"
                                   "&viewStateShareKey=orchestrator-runs")
    page = browse(browser, experiment_url, "experiment", tmp_path)
    assert "Runs" in page and "Training runs" in page, page[:80]  # the product's view, by its name
    assert not {"Detect Issues", "Token Usage", "Usage"} & set(page), page[:80]
    # The table's first row as it opens: the name (what the command changed first), the headline metrics as
    # columns holding the run's values, and the Source: the command whole, which runs when pasted. (The grid's DOM
    # order is not its visual order: the columns' order is the view's, tests/unit/report/test_ui.py.)
    headline = ["headline/val_accuracy", "headline/train_loss", "headline/train_samples_per_s"]
    header, row = page.index("Run Name"), page.index(run.info.run_name)
    assert {"Created", "Metrics", "Source", *headline} <= set(page[header:row]), page[header:row]
    assert run.info.run_name.startswith("steps60-"), run.info.run_name
    cells = page[row + 1:row + 8]
    assert {repr(run.data.metrics[key]) for key in headline} <= set(cells), cells
    command = run.data.tags["orchestrator.command"]
    assert command in cells and shlex.split(command)[:4] == ["orchestrator", "train", "--config",
                                                             "examples/digits.yaml"], cells

    # The run, at the URL `orchestrator train` printed: its charts, the headline section first.
    run_line = next(line for line in printed.splitlines() if line.startswith("this run in the MLflow UI: "))
    run_url = on_port(run_line.removeprefix("this run in the MLflow UI: "), port)
    assert run_url.endswith("/model-metrics?workflowType=machine_learning")
    page = browse(browser, run_url, "run-charts", tmp_path)
    assert run.info.run_name in page and "Model metrics" in page
    sections = [p for p, n in zip(page, page[1:], strict=False) if re.fullmatch(r"\(\d+\)", n)]
    assert sections[0] == "headline", sections
    # Each rendered chart's legend names the run and the key: the first three charts drawn on the first screen,
    # in the section's name order; checkpoint.every=auto's figures come later, with the time shares.
    legend = re.compile(rf"^{re.escape(run.info.run_name)} \((\S+)\)$")
    charts = [m[1] for p in page if (m := legend.match(p))]
    assert charts[:3] == ["headline/train_loss", "headline/train_samples_per_s", "headline/val_accuracy"], charts
    assert not [k for k in run.data.metrics if k.rsplit("/", 1)[0] < "headline"], sorted(run.data.metrics)
    assert page.index("train_loss") < page.index(f"{run.info.run_name} (headline/train_loss)")  # titled by name

    # Its Overview: the description with the headline figures, and the datasets.
    overview = on_port(run_line.removeprefix("this run in the MLflow UI: ").removesuffix(
        "/model-metrics?workflowType=machine_learning") + "?workflowType=machine_learning", port)
    page = browse(browser, overview, "run-overview", tmp_path)
    text = " ".join(page)
    assert "samples/s over the training" in text and "val_accuracy" in text, text[:500]
    assert any("train" in p for p in page)


def test_the_ui_runs_no_job_runner(ui: tuple[str, int, subprocess.Popen[bytes]]) -> None:
    """MLflow's job runner (GenAI jobs) starts seven processes that each import MLflow; the UI for training runs
    needs none of them. What runs under `orchestrator ui`: `mlflow ui` and its one uvicorn."""
    import psutil

    commands = [" ".join(p.cmdline()) for p in psutil.Process(ui[2].pid).children(recursive=True)]
    assert not [c for c in commands if "huey" in c], commands
    assert any("uvicorn" in c for c in commands) and len(commands) == 2, commands


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:`port` (a closed server's port may linger in TIME_WAIT,
    which a new server binds through SO_REUSEADDR: what matters is that nothing listens)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except OSError:
        return False
    return True


def test_a_terminated_ui_stops_its_mlflow_server(tmp_path: Path) -> None:
    """`orchestrator ui` stopped as a service manager or `kill` stops it (SIGTERM; SIGHUP, a closed terminal, takes
    the same path): the MLflow server it started in a session of its own (with its uvicorn worker) goes with it.
    An empty SQLite store (MLflow creates the schema); no Ray, no browser."""
    store = tmp_path / "mlruns.db"
    store.touch()
    output = tmp_path / "out.txt"
    # This checkout's code (not whatever the environment installed), as `orchestrator` runs it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH")] if p)}
    with open(output, "w") as out:
        ui = subprocess.Popen([sys.executable, "-m", "orchestrator", "ui", "--tracking-uri", f"sqlite:///{store}"],
                              stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True, env=env)
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while not (found := re.search(r"^open: http://127\.0\.0\.1:(\d+)/", output.read_text(), re.MULTILINE)):
            assert ui.poll() is None and time.monotonic() < deadline, output.read_text()
            time.sleep(0.5)
        port = int(found[1])
        children = psutil.Process(ui.pid).children(recursive=True)
        assert children and listening(port)  # `mlflow ui` and its server answer there

        ui.send_signal(signal.SIGTERM)
        ui.wait(timeout=60)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
        assert not listening(port), f"port {port} still listened on after SIGTERM"
    finally:
        for process in [*children, ui]:  # whatever is left of what this test started, by pid
            try:
                process.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        ui.wait(timeout=10)


def test_the_ui_and_its_server_workers_carry_the_store_in_their_environment_not_their_command_lines(
        tmp_path: Path) -> None:
    """Every user of the machine reads a process's command line (`ps`): a SQL store's password there would be
    theirs while the UI runs. `orchestrator ui` hands `mlflow ui` its store in its environment, and MLflow hands it
    on to its uvicorn worker the same way: the store is on no command line of the UI's processes, and the UI serves
    it. A SQLite store (a URI cannot give it a password: its path stands in for one); no Ray, no browser."""
    import json
    import urllib.request

    from mlflow.tracking import MlflowClient

    from orchestrator.report.ui import free_port, start, stop, wait_until_up

    store = tmp_path / "the-store-s3cr3t.db"
    uri = f"sqlite:///{store}"
    MlflowClient(tracking_uri=uri).create_experiment("served-from-the-environment")
    port, log = free_port(0), tmp_path / "ui.log"
    process = start(uri, port, log)
    try:
        wait_until_up(process, port, log)
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        commands = [" ".join(p.cmdline()) for p in tree]
        assert any("uvicorn" in c for c in commands), commands  # the server's worker is among those looked at
        assert not [c for c in commands if "s3cr3t" in c], commands
        url = (f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/get-by-name"
               "?experiment_name=served-from-the-environment")
        with urllib.request.urlopen(url, timeout=30) as answer:
            assert json.load(answer)["experiment"]["name"] == "served-from-the-environment"
    finally:
        stop(process)
