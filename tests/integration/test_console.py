"""What a user's terminal shows for a healthy `orchestrator train` on a local cluster it starts: the product's own
lines only; Ray's and MLflow's go to the run's log file."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
# The product's own lines, start to end of a run (README shows them).
PRODUCT = re.compile(r"^(Ray and MLflow logs: |start-up [\d.]+ s to the first step: |step \d+/\d+ \| |"
                     r"auto micro-batch: |finished |final validation|time: |throughput: |parallel: |cost: |"
                     r"checkpoint: |MLflow run|open the MLflow UI: |this run in the MLflow UI: |warning: )")


def test_a_healthy_run_prints_only_the_products_lines(tmp_path: Path, digits_dir: str) -> None:
    command = [str(BIN / "orchestrator"), "train", "--config", str(ROOT / "examples" / "digits.yaml"),
               "--set", f"data.train={digits_dir}/train", "--set", f"data.val={digits_dir}/val",
               "--set", f"storage.path={tmp_path}/runs", "--set", f"tracking.uri=sqlite:///{tmp_path}/mlruns.db",
               "--set", "train.max_steps=100", "--set", "train.eval_every=50", "--set", "checkpoint.every=50"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line for line in lines if not PRODUCT.match(line)] == []
    assert done.stderr.strip() == "", done.stderr  # no library warning, deprecation or worker noise
    assert sum(line.startswith("step ") for line in lines) == 4 and len(lines) <= 16, lines
    (log,) = (tmp_path / "runs").glob("digits-mlp-*/orchestrator.log")
    assert lines[0] == f"Ray and MLflow logs: {log} (--verbose shows them here)"
    text = log.read_text()
    # What used to reach the terminal is in the log: Ray Data's execution lines (from the driver and the workers'
    # split coordinators) and MLflow's store set-up.
    assert "ray.data" in text and "execution finished" in text and "ray.worker." in text
    assert "mlflow" in text
    assert "exclude_resources" not in text  # the deprecated option is not passed (trainer.ingest_options)
