"""scripts/gpu_check.py on this CPU machine (issue 57): a GPU present with a CPU torch fails in one line instead of
passing as "nothing to check", and the torch tier's collection and probe run where Ray, MLflow and Arrow cannot be
imported, saying "no GPU"."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU torch is what these tests stand on")


def gpu_check(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def bin_dir(tmp_path: Path, nvidia_smi: str | None) -> Path:
    """A PATH of one folder: a stub nvidia-smi printing `nvidia_smi` (as `nvidia-smi -L` does), or none at all."""
    folder = tmp_path / "bin"
    folder.mkdir(parents=True)
    if nvidia_smi is not None:
        stub = folder / "nvidia-smi"
        stub.write_text(f"#!/bin/sh\necho '{nvidia_smi}'\n")
        stub.chmod(0o755)
    return folder


@pytest.mark.parametrize("tier", [[], ["--ray"]], ids=["torch", "ray"])
def test_a_gpu_with_a_cpu_torch_fails_in_one_line(tmp_path: Path, tier: list[str]) -> None:
    path = bin_dir(tmp_path, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0000)")
    done = subprocess.run([sys.executable, str(SCRIPT), *tier], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": str(path)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        f"gpu-check: FAIL: a GPU is present (GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0000)) but torch "
        f"{torch.__version__} is a CPU build (torch.version.cuda is None): install a CUDA build of torch"]


def test_the_driver_device_node_alone_shows_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(bin_dir(tmp_path, None)))
    check = gpu_check(monkeypatch)
    node = tmp_path / "nvidia0"
    assert check.gpu_present([str(node)]) is None
    node.touch()
    assert check.gpu_present([str(node)]) == f"{node} exists"
    assert "CPU build" in check.cuda_failure(check.gpu_present([str(node)]), torch)
    # nvidia-smi that lists no GPU (a driver without devices) shows none.
    monkeypatch.setenv("PATH", str(bin_dir(tmp_path / "empty", "No devices were found")))
    assert check.gpu_present([str(tmp_path / "absent")]) is None


BLOCKER = """import sys
for name in ("ray", "mlflow", "boto3", "botocore", "moto", "pyarrow", "pandas", "sklearn", "matplotlib"):
    sys.modules[name] = None  # as on a bare GPU machine: an import of one raises ImportError
"""


def test_the_torch_tier_collects_and_probes_without_ray_mlflow_or_arrow_and_says_no_gpu(tmp_path: Path) -> None:
    """Every Python the tier starts (pytest, the probe, the bench) gets the blocker through sitecustomize."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PATH": str(bin_dir(tmp_path, None)), "PYTHONPATH": str(site)})
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("pytest", "probe", "bench"))}
    # Collected and skipped for want of CUDA: none failed to import (an error would fail the row).
    assert "pass" in rows["pytest"] and " skipped" in rows["pytest"] and "error" not in rows["pytest"], out
    assert "pass" in rows["probe"] and "cpu fp32" in rows["probe"] and "0 host waits between reports" in rows["probe"]
    assert "pass" in rows["bench/gpu.py"], out
    assert out.splitlines()[-1] == "no GPU: nothing to check on a GPU"
