"""What a user's terminal shows for a healthy `orchestrator train` on a local cluster it starts, with the product's
defaults and with `--autopilot`: the product's own lines only (the autopilot's table among them); Ray's and MLflow's
go to the run's log file. The autopilot's record in MLflow is read back too. When the command exits, no process it
started (its private cluster's, the workers) is left."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
# The product's own lines, start to end of a run (README shows them).
PRODUCT = re.compile(r"^(Ray and MLflow logs: |run: [\d,]+ params \| |start-up [\d.]+ s to the first step: |"
                     r"step \d+/\d+ \| |"
                     r"auto micro-batch: |finished |final validation|time: |throughput: |parallel: |cost: |"
                     r"checkpoint: |MLflow run|open the MLflow UI: |this run in the MLflow UI: |warning: |"
                     r"autopilot: |  candidate +samples/s|  micro \d+ x \d+ \| )")


@pytest.mark.parametrize("autopilot", [False, True], ids=["defaults", "autopilot"])
def test_a_healthy_run_prints_only_the_products_lines(tmp_path: Path, digits_dir: str, autopilot: bool) -> None:
    command = [str(BIN / "orchestrator"), "train", "--config", str(ROOT / "examples" / "digits.yaml"),
               "--set", f"data.train={digits_dir}/train", "--set", f"data.val={digits_dir}/val",
               "--set", f"storage.path={tmp_path}/runs", "--set", f"tracking.uri=sqlite:///{tmp_path}/mlruns.db",
               "--set", "train.max_steps=100", "--set", "train.eval_every=50", "--set", "checkpoint.every=50"]
    if autopilot:  # with a budget a 100-step run can pay a search with (the default 5% is too short: skipped)
        command += ["--autopilot", "--set", "autopilot.budget=0.5"]
    done, seen, started = run_timed(command, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    _check_no_process_is_left(started, lines, seen)
    _check_the_start_up_against_a_stopwatch(lines, seen, tmp_path)
    assert [line for line in lines if not PRODUCT.match(line)] == []
    assert done.stderr.strip() == "", done.stderr  # no library warning, deprecation or worker noise
    assert sum(line.startswith("step ") for line in lines) == 4 and len(lines) <= (31 if autopilot else 17), lines
    assert sum(line.startswith("run: ") for line in lines) == 1, lines  # what runs, before the first step's lines
    assert lines.index(next(line for line in lines if line.startswith("run: "))) < lines.index(
        next(line for line in lines if line.startswith("step "))), lines
    if autopilot:
        _check_the_autopilot(lines, tmp_path)
    else:
        assert not [line for line in lines if "autopilot" in line]
    (log,) = (tmp_path / "runs").glob("*digits-mlp-*/orchestrator.log")
    assert lines[0] == f"Ray and MLflow logs: {log} (--verbose shows them here)"
    text = log.read_text()
    # What used to reach the terminal is in the log: MLflow's store set-up. Ray Data ran nothing: the driver read
    # the small data and the ranks split it themselves (pipelines/held.py), with no split coordinator.
    assert "mlflow" in text
    assert "execution finished" not in text and "SplitCoordinator" not in text


def run_timed(command: list[str], cwd: Path
              ) -> tuple[subprocess.CompletedProcess[str], list[float], dict[int, tuple[psutil.Process, str]]]:
    """The command run to its end, when each of its stdout lines arrived, in seconds after the stopwatch started
    (just before the process did), and the processes it started (its descendants, looked at every 0.2 s while it
    ran), by id; the last entry of the times is its exit."""
    with (cwd / "stderr.txt").open("w+") as err:
        began = time.time()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, cwd=cwd)
        started: dict[int, tuple[psutil.Process, str]] = {}
        watching = threading.Thread(target=_watch_descendants, args=(process, started), daemon=True)
        watching.start()
        out, seen = [], []
        assert process.stdout is not None
        for line in process.stdout:
            seen.append(time.time() - began)
            out.append(line)
        process.wait(timeout=300)
        seen.append(time.time() - began)
        watching.join()
        err.seek(0)
        return subprocess.CompletedProcess(command, process.returncode, "".join(out), err.read()), seen, started


def _watch_descendants(process: subprocess.Popen[str], started: dict[int, tuple[psutil.Process, str]]) -> None:
    """Every process below `process` (Ray's, which reparent when their parent ends, and the workers below them)
    kept in `started` with its last name seen, as psutil sees it (its start time with it: a reused id is not taken for
    it)."""
    try:
        parent = psutil.Process(process.pid)
        while process.poll() is None:
            for child in parent.children(recursive=True):
                # A child seen between its fork and its exec still has its parent's name: the name is read again
                # each time round, so the last one kept is the program it runs (a GCS forked from the driver).
                known = started.get(child.pid, (child, ""))[0]
                try:
                    started[child.pid] = (known, known.name())
                except psutil.NoSuchProcess:
                    continue
            time.sleep(0.2)
    except psutil.NoSuchProcess:
        pass


def _check_no_process_is_left(started: dict[int, tuple[psutil.Process, str]], lines: list[str],
                              seen: list[float]) -> None:
    """When the command has exited, every process it started has ended (none running, none left a zombie), and
    the processes seen include its private cluster's (a raylet and a GCS) and the workers'."""
    kinds = {name for _, name in started.values()}
    left = [f"{p.pid} {name}" for p, name in started.values() if _alive(p)]
    last_step = max(i for i, line in enumerate(lines) if line.startswith("step "))
    print(f"processes the command started: {len(started)} ({', '.join(sorted(kinds - {''}))}); left after its exit: "
          f"{len(left)}; from the last progress line to its exit {seen[-1] - seen[last_step]:.1f} s")
    assert {"raylet", "gcs_server"} <= kinds and len(started) >= 5, kinds
    assert left == [], left


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _check_the_start_up_against_a_stopwatch(lines: list[str], seen: list[float], tmp_path: Path) -> None:
    """The printed start-up is the time from the process's start to the first step, as seen from outside: the
    start-up line comes with the first report (step 25), whose record says how long its steps took since the first
    batch; the line's arrival less that is when the first step began, by this test's stopwatch."""
    (at,) = [i for i, line in enumerate(lines) if line.startswith("start-up ")]
    printed = float(lines[at].split()[1])
    (record,) = (tmp_path / "runs").glob("*digits-mlp-*/attempts/*.json")
    first = json.loads(record.read_text())["reports"][0]
    outside = seen[at] - first["interval_s"]
    assert first["step"] == 25 and abs(printed - outside) <= 1.0, (printed, seen[at], first["interval_s"])


def _check_the_autopilot(lines: list[str], tmp_path: Path) -> None:
    """Its table printed once (the starting config's row first, one chosen), the summary's line of what it gained,
    and MLflow's record: the chosen settings as params, the table artifact, the figures in the summary table."""

    from mlflow.tracking import MlflowClient

    from orchestrator.tracking.read import read_summary

    heading = lines.index("autopilot: candidates measured on the run's own steps, samples/s in training steps "
                          "(compute and gradient sync; the progress lines' samples/s also count data waits)")
    rows = [line for line in lines[heading + 2:] if line.startswith("  micro ")]
    assert lines[heading + 1].startswith("  candidate") and rows and "1.00x" in rows[0].split(), rows  # the start
    assert sum(line.endswith("✓") for line in rows) == 1, rows
    # On CPU no candidate has a peak memory: the column is left out, and a line says why.
    assert "peak memory" not in lines[heading + 1]
    assert lines[heading + 2 + len(rows)].startswith("autopilot: columns left out: peak memory (measured on GPUs "
                                                     "only)"), lines
    # The summary: the throughput over the wall clock, then the autopilot's samples/s in training steps, in the search
    # and after it, named as its table names them; no speed-up of the training against the search's figures.
    (throughput,) = [line for line in lines if line.startswith("throughput: ")]
    assert throughput.endswith("samples/s over the training's wall clock (first step to last)"), throughput
    (gained,) = [line for line in lines if line.startswith("autopilot: ") and " in the search, " in line]
    assert "; samples/s in training steps: " in gained and " after it (compute and gradient sync; the throughput " \
        "over the training's wall clock also counts data waits, evaluation and checkpoints); search " in gained, gained
    assert not [line for line in lines if "achieved" in line]
    # It trained, under its one name: what the command's --set flags changed in what is trained, then its start.
    assert any(re.match(r"finished steps100-autopilot-digits-mlp-\d{8}-\d{6}: step 100", line) for line in lines)
    run_id = next(line for line in lines if line.startswith("MLflow run id: ")).split(": ")[1]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns.db")
    params = client.get_run(run_id).data.params
    assert params["autopilot.enabled"] == "True" and int(params["autopilot.micro_batch_size"]) > 0
    assert {"autopilot.compile", "autopilot.torch_threads", "autopilot.flush_denormal"} <= set(params)
    table = json.loads(Path(client.download_artifacts(run_id, "autopilot.json", str(tmp_path))).read_text())
    dropped = [line for line in lines if line.startswith("autopilot: dropped ")]
    assert len(table["data"]) == len(rows) + len(dropped) and sum(row[-1] for row in table["data"]) == 1
    figures = read_summary(client, run_id)
    assert figures["autopilot/predicted_speedup"] >= 1.0 and figures["autopilot/search_s"] > 0
    assert figures["autopilot/achieved_samples_per_s"] > 0
    assert not [k for k in client.get_run(run_id).data.metrics if "autopilot" in k]  # never charted
    # doctor reads back what was logged: the predicted against the achieved speed-up.
    from orchestrator.doctor.report import doctor, summary

    printed = summary(run_id, doctor(run_id, f"sqlite:///{tmp_path}/mlruns.db"))
    (finding,) = [line for line in printed.splitlines() if "] autopilot: " in line]
    assert (f"predicted {figures['autopilot/predicted_speedup']:.2f}x" in finding
            and f"achieved {figures['autopilot/achieved_speedup']:.2f}x" in finding), finding
