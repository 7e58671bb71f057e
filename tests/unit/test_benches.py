"""The GPU benchmark must run unattended with only torch; here it runs at its tiny CPU size."""

from __future__ import annotations

import os
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


def test_gpu_check_says_so_without_cuda_and_every_planned_command_would_run(tmp_path: Path) -> None:
    """The Ray tier's CPU path: one line and exit 0 (the torch tier's: tests/unit/test_gpu_check.py); on a GPU
    machine every command of both tiers must run the first time, so each names a program and files that exist and
    every training command's overrides load as a config."""
    import importlib.util

    from orchestrator.config import load_config

    out = subprocess.run([sys.executable, "scripts/gpu_check.py", "--ray"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PATH": str(tmp_path)})  # no nvidia-smi on that PATH
    assert out.returncode == 0 and out.stdout.splitlines() == ["gpu-check: no GPU: nothing to check (run it where a "
                                                               "GPU is)"], out
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["gpu_check"] = gpu_check  # its dataclass looks its module up there
    spec.loader.exec_module(gpu_check)  # type: ignore[union-attr]
    torch_tier, ray_tier = gpu_check.torch_tier(cuda=True), gpu_check.ray_tier(tmp_path, gpus=2)
    assert [c.name for c in torch_tier] == ["pytest -m gpu", "probe", "bench/gpu.py"]
    assert [c.name for c in ray_tier] == ["prepare data", "train (Ray, 1 GPU)", "autopilot, poor start",
                                          "train (Ray, 2 GPUs, NCCL)"]
    assert sum(c.timeout_s for c in torch_tier) <= 8 * 60
    assert "tests/unit/training/test_gpu.py" in torch_tier[0].command
    for check in torch_tier + ray_tier:
        assert Path(check.command[0]).exists(), check.command[0]
        assert all((ROOT / arg).exists() for arg in check.command if arg.startswith(("bench/", "tests/")))
        overrides = [check.command[i + 1] for i, arg in enumerate(check.command) if arg == "--set"]
        if overrides:
            load_config(None, overrides)
    table = ("mode  tokens/s  vs fp32  MFU  peak GiB  wall s\nfp32 strict  120,000  1.00x  10.0%  30.1  9.0\n"
             "tf32  400,000  3.33x  16.0%  30.1  5.0\nbf16  900,000  7.50x  45.0%  20.0  4.0\n")
    assert gpu_check._bench_figures(table).startswith("fp32 strict 120,000 tokens/s MFU 10.0%")
