"""Start-up to the first step, and the end, beside Ray's own floor, measured side by side in one run (issue 37's and
issue 59's targets).

Every figure is a stopwatch the bench takes from outside (its own time.time() just before it starts a process),
printed next to what the product printed:

1. Ray's floor with its own cluster: a plain Ray Train script (`import ray`, `ray.init()` of a new local cluster,
   an empty 2-worker `TorchTrainer.fit()` whose function writes time.time() to a file), from the start of its
   process to the function running on both workers; median of 2. Its end: its `ray.shutdown()` after fit()
   returned, and from fit() returning to the process's exit.
2. `orchestrator train --config examples/digits.yaml` (2 workers), starting its own local cluster: its printed
   start-up against floor 1 (target <= floor + 3 s) and against the stopwatch (target: within 1 s); its end, from
   the last progress line to the process's exit (the prompt; target <= 1 s), split at the summary's first line.
3. A running cluster, started as a user starts one (`ray start --head`, 4 logical CPUs: docs/ray-cluster.md's
   `num_workers x cpus_per_worker + 2`, so Ray Data's read tasks never starve on a 2-core machine). Ray 2.60 starts
   it with token auth wherever ~/.ray/auth_token exists, and joins an explicit address with a token only under
   RAY_AUTH_MODE=token, which the bench does not set: the command with `--address host:port` shows what a user
   without it sees; then floor 3, the same script joining with `ray.init(address="auto")` (median of 2), and the
   command with `--address auto` (target <= floor 3 + 2 s).
4. The warm path: the command twice with `cluster.keep_warm_minutes=5`, the second joining the first's cluster
   (target <= 5 s); then `orchestrator cluster stop`.
5. The targets: measured, met or missed, the floor beside each.

The commands get the product's defaults and the environment of the shell the bench runs in (no Ray or product
variable added); only data, storage and the MLflow store go to a temporary directory, and train.max_steps is 30.
The floor script says `ray.init(address="local")`: what `ray.init()` does on a machine with no `ray start` cluster
recorded (a stale /tmp/ray/ray_current_cluster would make a bare `ray.init()` try to join a dead cluster instead).
No process records the first step for outsiders: the stopwatch stops when the bench reads the `start-up` line,
which the driver prints on the first report (step 25, `train.log_every`); less that report's seconds of steps since
the first batch (the run's own record) it is the stopwatch's first step, which the printed figure is held to.
MLflow's timestamp of the run's first metric row is shown beside it.

Run it alone on the machine (any other Ray work skews every figure):

    .venv/bin/python bench/startup.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from _common import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / ".venv" / "bin"
RAY_RECORD = Path("/tmp/ray/ray_current_cluster")  # Ray's record of the cluster the last `ray start` started
COMMAND_TIMEOUT_S = 600  # a command still running then is sent Ctrl+C (it ends KILLED)

# The plain Ray Train script of the floors: argv = the marks file to write, the address for ray.init.
FLOOR_SCRIPT = """
import json, sys, time
marks = {"python": time.time()}
import ray
import ray.train
from ray.train.torch import TorchTrainer
marks["import ray"] = time.time()
out, address = sys.argv[1], sys.argv[2]
ray.init(address=address)
marks["ray.init"] = time.time()

def function(config):
    with open(out + ".function", "a") as f:
        f.write(f"{time.time()}\\n")

trainer = TorchTrainer(function, scaling_config=ray.train.ScalingConfig(num_workers=2),
                       run_config=ray.train.RunConfig(storage_path=out + ".runs", name="floor"))
marks["fit"] = time.time()
trainer.fit()
marks["fit returned"] = time.time()
ray.shutdown()
marks["ray.shutdown"] = time.time()
with open(out + ".function") as f:
    marks["function"] = max(float(t) for t in f.read().split())  # running on both workers
with open(out, "w") as f:
    json.dump(marks, f)
"""
FLOOR_STAGES = ("python", "import ray", "ray.init", "fit", "function")


@dataclass
class Floor:
    seconds: float  # Popen -> the function running on both workers
    parts: dict[str, float]  # Popen -> python, -> import ray done, ... (each since the previous mark)
    shutdown: float = 0.0  # its `ray.shutdown()` after fit() returned
    exit: float = 0.0  # from fit() returning to the process's exit (the bench's stopwatch), ray.shutdown() included


@dataclass
class Command:
    label: str
    printed: float | None = None  # the product's start-up figure
    line: str = ""  # its start-up line, verbatim
    line_seen: float | None = None  # stopwatch: Popen -> the bench reads the start-up line
    process_start: float | None = None  # Popen -> the process's start, as the run's attempt record holds it
    steps_before_report: float | None = None  # the first report's interval (first batch -> step 25), run's record
    mlflow_first: tuple[float, int] | None = None  # Popen -> MLflow's first metric row of the run, and its step
    notes: list[str] = field(default_factory=list)  # what it said about the warm cluster
    error: str = ""
    wall: float = 0.0  # Popen -> its exit
    last_step_seen: float | None = None  # stopwatch: Popen -> the bench reads the last progress line
    summary_seen: float | None = None  # stopwatch: Popen -> the bench reads the summary's first line ("finished ")

    @property
    def end(self) -> float | None:
        """The end as the user waits for it: from the last progress line to the process's exit (the prompt)."""
        return None if self.last_step_seen is None else self.wall - self.last_step_seen

    @property
    def first_step_seen(self) -> float | None:
        """Stopwatch to the first step: to the start-up line, less the first report's steps (from the run's record)."""
        if self.line_seen is None or self.steps_before_report is None:
            return None
        return self.line_seen - self.steps_before_report

    @property
    def gap(self) -> float | None:
        """How far the printed figure is from the stopwatch's first step, either way."""
        seen = self.first_step_seen
        return None if seen is None or self.printed is None else abs(seen - self.printed)


def plain_ray_train(tmp: Path, address: str, label: str) -> Floor:
    """The floor script in its own process: seconds from the bench's Popen to the function running."""
    out = tmp / f"floor-{label}.json"
    with open(tmp / f"floor-{label}.log", "w") as log:
        started = time.time()
        done = subprocess.run([sys.executable, "-c", FLOOR_SCRIPT, str(out), address], cwd=tmp, stdout=log,
                              stderr=subprocess.STDOUT, timeout=COMMAND_TIMEOUT_S)
        exited = time.time()
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"the floor script failed (rc {done.returncode}):\n"
                         f"{(tmp / f'floor-{label}.log').read_text()[-3000:]}")
    marks = json.loads(out.read_text())
    parts, previous = {}, started
    for stage in FLOOR_STAGES:
        parts[stage], previous = marks[stage] - previous, marks[stage]
    return Floor(marks["function"] - started, parts, marks["ray.shutdown"] - marks["fit returned"],
                 exited - marks["fit returned"])


def floor_line(floor: Floor) -> str:
    p = floor.parts
    return (f"{floor.seconds:5.1f} s = python start {p['python']:.1f} | import ray {p['import ray']:.1f} | "
            f"ray.init {p['ray.init']:.1f} | trainer built {p['fit']:.1f} | fit() -> function {p['function']:.1f}"
            f"; end: ray.shutdown() {floor.shutdown:.1f} s, fit() returned -> exit {floor.exit:.1f} s")


def measure_floor(tmp: Path, address: str, label: str, runs: int = 2) -> Floor:
    """The floor script run `runs` times: the median of its figure and of each of its parts."""
    floors = []
    for n in range(runs):
        floors.append(plain_ray_train(tmp, address, f"{label}-{n}"))
        print(f"   run {n + 1}: {floor_line(floors[-1])}", flush=True)
    median = Floor(statistics.median(f.seconds for f in floors),
                   {stage: statistics.median(f.parts[stage] for f in floors) for stage in FLOOR_STAGES},
                   statistics.median(f.shutdown for f in floors), statistics.median(f.exit for f in floors))
    print(f"   floor: {median.seconds:.1f} s (median of {runs})", flush=True)
    return median


def orchestrator_train(tmp: Path, label: str, extra: list[str]) -> Command:
    """`orchestrator train` of the digits example in its own process, its output read line by line as it comes."""
    storage = tmp / f"runs-{label}"
    sets = [f"data.train={tmp}/digits/train", f"data.val={tmp}/digits/val", f"storage.path={storage}",
            f"tracking.uri=sqlite:///{tmp}/mlflow.db", "train.max_steps=30"]
    command = [str(BIN / "orchestrator"), "train", "--config", "examples/digits.yaml",
               *(arg for s in sets for arg in ("--set", s)), *extra]
    result = Command(label)
    with open(tmp / f"{label}.stderr", "w") as errors:
        started = time.time()
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=errors, text=True, bufsize=1)
        watchdog = threading.Timer(COMMAND_TIMEOUT_S, process.send_signal, [signal.SIGINT])  # Ctrl+C
        watchdog.start()
        assert process.stdout is not None
        for line in process.stdout:
            seen = time.time() - started
            if line.startswith("start-up ") and result.line_seen is None:
                result.line_seen, result.line = seen, line.strip()
            if line.startswith("step "):
                result.last_step_seen = seen
            if line.startswith("finished ") and result.summary_seen is None:
                result.summary_seen = seen
            if "warm Ray cluster" in line:
                result.notes.append(line.strip())
        rc = process.wait()
        result.wall = time.time() - started
        watchdog.cancel()
    found = re.match(r"start-up ([\d.]+) s", result.line)
    result.printed = float(found.group(1)) if found else None
    if rc != 0 or found is None:
        result.error = f"rc {rc}; stderr:\n{(tmp / f'{label}.stderr').read_text()[-3000:]}"
    _read_run_records(result, storage, tmp / "mlflow.db", started)
    return result


def last_line(text: str) -> str:
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")


def _read_run_records(result: Command, storage: Path, store: Path, started: float) -> None:
    """What the run left behind: its attempt record (process start, first report's interval) and MLflow's first
    metric row after step 0 (written when the driver took rank 0's first report)."""
    for record in storage.glob("*/attempts/*.json"):
        attempt = json.loads(record.read_text())
        result.process_start = attempt["began"] - started
        if attempt["reports"]:
            result.steps_before_report = attempt["reports"][0].get("interval_s")
    if not store.exists():
        return
    with sqlite3.connect(store) as db:
        run = db.execute("SELECT run_uuid FROM runs ORDER BY start_time DESC LIMIT 1").fetchone()
        row = db.execute("SELECT timestamp, step FROM metrics WHERE run_uuid = ? AND step > 0 "
                         "ORDER BY timestamp LIMIT 1", run).fetchone() if run else None
    if row:
        result.mlflow_first = (row[0] / 1000 - started, row[1])


def show(command: Command) -> None:
    """The command's printed start-up line verbatim, the stopwatch and the run's records beside it."""
    for note in command.notes:
        print(f"   {note}")
    print(f"   {command.line or '(no start-up line)'}")
    if command.error:
        print(f"   FAILED: {command.error}")
    if command.line_seen is None:
        return
    records = []
    if command.process_start is not None:
        records.append(f"the process started {round(command.process_start, 2) + 0.0:+.2f} s after Popen")
    if command.steps_before_report is not None:
        records.append(f"the {command.steps_before_report:.2f} s from the first batch to that report")
    if command.mlflow_first is not None:
        records.append(f"MLflow's first metric row (step {command.mlflow_first[1]}) at {command.mlflow_first[0]:.1f} s")
    seen = command.first_step_seen
    print(f"   printed {command.printed:.1f} s | stopwatch to the start-up line {command.line_seen:.1f} s (first "
          "report)" + ("" if seen is None else f", to the first step {seen:.1f} s | |stopwatch - printed| "
                                               f"{command.gap:.1f} s"), flush=True)
    print(f"   run's records: {'; '.join(records) or 'none'}", flush=True)
    if command.end is not None and command.last_step_seen is not None:
        summary = "" if command.summary_seen is None else (
            f" (to the summary {command.summary_seen - command.last_step_seen:.1f} s, summary -> exit "
            f"{command.wall - command.summary_seen:.1f} s)")
        print(f"   end: last progress line -> exit {command.end:.1f} s{summary}", flush=True)


def stages(line: str) -> dict[str, float]:
    """The parts of a printed start-up line: {'command': 4.8, 'ray start': 10.2, 'tracking (alongside)': 4.4...}."""
    out: dict[str, float] = {}
    for part in line.split(": ", 1)[-1].split(" | "):
        found = re.match(r"(.+?) ([\d.]+) s(?: \((.+?) ([\d.]+) s alongside\))?$", part)
        if found:
            out[found.group(1)] = float(found.group(2))
            if found.group(3):
                out[f"{found.group(3)} (alongside)"] = float(found.group(4))
    return out


def beside_floor(command: Command, floor: Floor) -> None:
    """The product's stages next to the floor script's parts that do the same thing, then the product's own."""
    s, f = stages(command.line), floor.parts
    if not s:
        return
    pairs = [(("command", "data inspection", "checks"), ("python", "import ray")), (("ray start",), ("ray.init",)),
             (("worker group",), ("fit", "function"))]
    shown = [f"{' + '.join(ours)} {sum(s.get(p, 0.0) for p in ours):.1f} / {' + '.join(theirs)} "
             f"{sum(f[p] for p in theirs):.1f}" for ours, theirs in pairs]
    own = ", ".join(f"{p} {s.get(p, 0.0):.1f}" for p in ("datasets", "worker set-up", "first batch"))
    print(f"   product / floor parts (s): {' | '.join(shown)} | the product's only: {own}", flush=True)


@dataclass
class Head:
    process: subprocess.Popen[bytes]
    address: str
    record_before: str | None  # what /tmp/ray/ray_current_cluster said before this head started


def start_head(tmp: Path) -> Head:
    """`ray start --head --block` in its own session, with ports of its own; ready once it says so. Like any
    `ray start`, it records its address in /tmp/ray/ray_current_cluster, where `ray.init()` and `address="auto"`
    find it; `stop_head` puts the file back as it was."""
    port = free_port()
    record = RAY_RECORD.read_text() if RAY_RECORD.exists() else None
    # `ray start` as the `ray` script runs it; -u (for this process only, not its children) so that its "started"
    # line reaches the log at once.
    command = [sys.executable, "-u", "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
               "--num-cpus=4", f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}",
               f"--dashboard-agent-listen-port={free_port()}"]
    log = tmp / "head.log"
    started = time.time()
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    head = Head(process, f"127.0.0.1:{port}", record)
    while "Ray runtime started" not in log.read_text(errors="replace"):
        if process.poll() is not None or time.time() - started > 120:
            stop_head(head)
            raise SystemExit(f"ray start --head did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)
    print(f"   `ray {' '.join(command[4:8])} ...` ready {time.time() - started:.1f} s after Popen, at {head.address}",
          flush=True)
    return head


def stop_head(head: Head) -> None:
    """SIGKILL the head's process tree and process group (its own session: only its Ray processes) by PID, and
    put Ray's record of the current cluster back as it was."""
    processes: list[psutil.Process] = []
    try:
        root = psutil.Process(head.process.pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        pass
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(head.process.pid, signal.SIGKILL)  # any of its processes that left the tree
    except ProcessLookupError:
        pass
    psutil.wait_procs(processes, timeout=15)
    head.process.wait()
    if head.record_before is not None:
        RAY_RECORD.write_text(head.record_before)
    elif RAY_RECORD.exists() and head.address.split(":")[1] in RAY_RECORD.read_text():
        RAY_RECORD.unlink()


def verdict(row: str, measured: float | None, limit: float | None, floor: str = "") -> str:
    """One row of the closing table; a missed target shows the floor that stops it."""
    if measured is None or limit is None:
        return f"{row:<44} {'-':>9}  {'':<10} not measured {floor}"
    met = measured <= limit
    return f"{row:<44} {measured:7.1f} s  <= {limit:5.1f} s  {'met' if met else 'MISSED ' + floor}"


def main() -> None:
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="sb-") as name:
        tmp = Path(name)
        # In a process of its own: scikit-learn sets KMP_* variables in the process that imports it, and the
        # commands below must get the bench's environment as the shell gave it.
        subprocess.run([str(BIN / "orchestrator"), "prepare", "digits", "--out", str(tmp / "digits")], cwd=ROOT,
                       check=True, capture_output=True)
        print("1. Ray's floor, its own local cluster: python -c 'import ray; ray.init(address=\"local\"); "
              "TorchTrainer(empty, 2 workers).fit()', Popen -> the function runs on both workers", flush=True)
        floor1 = measure_floor(tmp, "local", "local")

        print("2. orchestrator train --config examples/digits.yaml, its own local cluster", flush=True)
        own = orchestrator_train(tmp, "own", [])
        show(own)
        beside_floor(own, floor1)

        print("3. a running cluster (ray start --head)", flush=True)
        head = start_head(tmp)
        try:
            # Ray 2.60 turns token auth on for `ray start` wherever ~/.ray/auth_token exists (every machine that
            # ran a local `ray.init()`), and joins an explicit address with token auth only under
            # RAY_AUTH_MODE=token: what a user without it sees, then the address Ray finds itself ("auto").
            print(f"   orchestrator train ... --address {head.address} (no RAY_AUTH_MODE)", flush=True)
            explicit = orchestrator_train(tmp, "explicit", ["--address", head.address])
            print(f"   {'ended rc 0' if not explicit.error else 'failed'} after {explicit.wall:.1f} s: "
                  f"{explicit.line or last_line(explicit.error)[:300]}", flush=True)
            print("   Ray's floor on it: the same script with ray.init(address=\"auto\")", flush=True)
            floor3 = measure_floor(tmp, "auto", "running")
            print("   orchestrator train ... --address auto", flush=True)
            joined = orchestrator_train(tmp, "address", ["--address", "auto"])
            show(joined)
            beside_floor(joined, floor3)
        finally:
            stop_head(head)

        print("4. the warm path: orchestrator train ... --set cluster.keep_warm_minutes=5, twice", flush=True)
        warm = ["--set", "cluster.keep_warm_minutes=5"]
        try:
            first = orchestrator_train(tmp, "warm-1", warm)
            show(first)
            second = orchestrator_train(tmp, "warm-2", warm)
            show(second)
        finally:
            stopped = subprocess.run([str(BIN / "orchestrator"), "cluster", "stop"], cwd=ROOT, capture_output=True,
                                     text=True)
            print(f"   orchestrator cluster stop: {stopped.stdout.strip() or stopped.stderr.strip()}", flush=True)
        rejoined = any(note.startswith("joined the warm Ray cluster") for note in second.notes)
        if not rejoined:
            print("   the second command did NOT join the first one's cluster", flush=True)

    print(f"5. targets (bench wall clock {time.time() - began:.0f} s)", flush=True)
    print(f"{'target':<44} {'measured':>9}  {'limit':<10} {'result'}")
    print(verdict("own cluster: printed start-up <= floor 1 + 3", own.printed, floor1.seconds + 3,
                  f"(floor 1 {floor1.seconds:.1f} s)"))
    print(verdict("own cluster: end, last progress line -> exit", own.end, 1.0,
                  f"(floor 1: ray.shutdown() {floor1.shutdown:.1f} s, fit() returned -> exit {floor1.exit:.1f} s)"))
    print(verdict("--address: printed start-up <= floor 3 + 2", joined.printed, floor3.seconds + 2,
                  f"(floor 3 {floor3.seconds:.1f} s)"))
    print(verdict("warm, second command: printed start-up", second.printed if rejoined else None, 5.0,
                  f"(floor 3 {floor3.seconds:.1f} s, floor 1 {floor1.seconds:.1f} s)"))
    for command in (own, joined, first, second):  # explicit: reported above
        print(verdict(f"{command.label}: |stopwatch - printed|", command.gap, 1.0,
                      "(the stopwatch's first step: the start-up line's arrival less the first report's "
                      f"{command.steps_before_report or 0:.2f} s of steps)"))


if __name__ == "__main__":
    main()
