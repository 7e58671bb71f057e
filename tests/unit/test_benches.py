"""The GPU benchmark must run unattended with only torch; here it runs at its tiny CPU size."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_bench_runs_on_cpu_at_a_tiny_size() -> None:
    out = subprocess.run([sys.executable, "bench/gpu.py", "--no-compile", "--steps", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "auto micro-batch: 4 sequences" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith(("fp32 strict", "tf32", "bf16"))]
    assert len(rows) == 3


def test_autopilot_bench_runs_in_its_quick_mode() -> None:
    # The starts, one more grid point and both autopilot runs on a small MLP, in this process's children only.
    out = subprocess.run([sys.executable, "bench/autopilot.py", "--quick"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    assert "grid best: micro" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith(("poor ", "defaults "))]
    assert len(rows) == 2
    assert "targets (autopilot's steady state" in out.stdout
