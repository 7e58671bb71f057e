"""One writer per run (issue 58), on a real local Ray cluster with a real MLflow store: two attempts of one run alive at
once (a RayJob retry that starts before the old attempt's pods are gone, KubeRay #5211; a driver left running behind
a partition), each the product's own `orchestrator train` command. Only the newer attempt's checkpoints and metrics
land; the older one says so in one line and exits non-zero."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_reliability import held_command, registered_snapshot, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def started(command: list[str]) -> tuple[subprocess.Popen[str], list[str], list[str]]:
    """The command running, its stdout and stderr lines collected as they come."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    err: list[str] = []
    threading.Thread(target=lambda: out.extend(process.stdout or []), daemon=True).start()
    threading.Thread(target=lambda: err.extend(process.stderr or []), daemon=True).start()
    return process, out, err


def test_an_older_attempt_alive_beside_a_newer_one_lands_nothing(ray_cluster: None, tmp_path: Path,
                                                                digits_dir: str) -> None:
    """Attempt 1 holds its workers in step 21 (held_model), after its step-20 checkpoint; attempt 2, a `--resume` of
    the same run, starts meanwhile and trains it to the end from that checkpoint. Then attempt 1 is let go, as a
    zombie driver would go on: it commits no checkpoint (nor Ray Train's record of the latest) and logs no metric
    into the MLflow run; it says so in one line and exits non-zero. Attempt 2's checkpoints stay the run's latest."""
    from mlflow.tracking import MlflowClient

    from orchestrator.tracking.view import chart_key, mlflow_key

    hold, command = held_command(tmp_path, digits_dir, "fenced", 40)
    runs = tmp_path / "runs"
    first, _, first_err = started(command)
    second = None
    try:
        wait_for(lambda: len(list(hold.glob("held-*"))) == 2 and "checkpoint_00000020" in registered_snapshot(runs),
                 "attempt 1's workers held after its step-20 checkpoint registered", timeout=240)
        first_pids = {p.name.removeprefix("held-") for p in hold.glob("held-*")}
        (run_dir,) = runs.glob("*fenced-*")

        # Attempt 2: the same run resumed while attempt 1 still lives. Its own workers never wait in the hold.
        second, second_out, second_err = started([*command, "--resume"])
        while second.poll() is None:
            for held in hold.glob("held-*"):
                if held.name.removeprefix("held-") not in first_pids:
                    (hold / f"release-{held.name.removeprefix('held-')}").touch()
            time.sleep(0.2)
        time.sleep(0.5)  # the reader threads' last lines
        assert second.returncode == 0, "".join(second_out[-30:] + second_err[-30:])
        record = json.loads((run_dir / "orchestrator-run.json").read_text())
        client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
        key = chart_key(mlflow_key("train_loss"), None)

        def landed() -> dict[str, Any]:
            """What the run holds: its checkpoints, Ray Train's record of them (the latest), its own record, and
            its MLflow run's status and metric points."""
            run = client.get_run(record["mlflow_run_id"])
            return {"checkpoints": sorted(p.name for p in run_dir.glob("checkpoint_0*")),
                    "ray_record": registered_snapshot(runs), "run_record": (run_dir / "orchestrator-run.json"
                                                                            ).read_text(),
                    "status": (run.info.status, run.info.end_time),
                    "metrics": sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(
                        record["mlflow_run_id"], key))}

        newer = landed()
        assert newer["status"][0] == "FINISHED" and "checkpoint_00000040" in newer["ray_record"], newer["status"]

        # Attempt 1 goes on.
        for pid in first_pids:
            (hold / f"release-{pid}").touch()
        code = first.wait(timeout=180)
        time.sleep(0.5)
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
    after = landed()
    assert after["checkpoints"] == newer["checkpoints"], "attempt 1 committed checkpoints after attempt 2's claim"
    assert after["ray_record"] == newer["ray_record"], "attempt 1 rewrote Ray Train's record of the latest"
    assert after["metrics"] == newer["metrics"], "attempt 1 logged metrics after attempt 2's claim"
    assert after["status"] == newer["status"] and after["run_record"] == newer["run_record"]
    said = [line for line in first_err if "of the same run started at" in line]
    assert len(said) == 1 and said[0].startswith(f"error: attempt 1 of run {run_dir.name} stopped: attempt 2 of "
                                                 "the same run started at "), first_err[-20:]
    assert said[0].rstrip().endswith("writes nothing more to the run or its MLflow run")
    assert code != 0
    # Each attempt's number is recorded with the run: its claim, and its record for the cost ledger.
    assert sorted(p.name[:8] for p in (run_dir / "claims").iterdir()) == ["00000001", "00000002"]
    numbers = [json.loads(p.read_text()).get("attempt") for p in (run_dir / "attempts").glob("*.json")]
    assert sorted(numbers) == [1, 2], numbers
