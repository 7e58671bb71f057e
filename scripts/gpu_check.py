"""The GPU check in two tiers, one command each (docs/testing.md has the one-call command for a bare GPU machine).

Torch tier (`make gpu-check`): the machine's own Python and CUDA torch (2.11 or newer) with a few carried wheels
(pydantic, PyYAML, psutil, numpy, pytest): no Ray, no MLflow, no set-up. Under 8 minutes on one H100.
    1. pytest -m gpu    the gpu-marked tests, collecting only their files: bf16 and fp16 (GradScaler, fused
                        optimizer), a GPT trained with torch.cuda.set_sync_debug_mode("error") between reports, an
                        OOM retry from a real allocation, the auto micro-batch, memory statistics
    2. probe            the step on the device: a small GPT through the loop at the product's defaults (precision
                        auto), its host reads and device syncs between reports (0), tokens/s and peak memory
    3. bench/gpu.py     strict fp32 / TF32 / bf16 / bf16+compile tokens/s and MFU of the built-in GPT
Ray tier (`--ray`, `make gpu-check-ray`): the full .venv with a CUDA torch (a user's GPU node): `orchestrator train`
through Ray Train on one GPU, the autopilot from a poor start, and on two GPUs (NCCL) where there are two.

Both tiers fail (exit 1, one line) where a GPU is present (nvidia-smi lists one, or /dev/nvidia0 exists) but torch
has no CUDA. Without any GPU the Ray tier says "no GPU: nothing to check" (exit 0); the torch tier still runs its
collection and its probe on the CPU (the tier's imports proved), then says the same.

    python scripts/gpu_check.py [--ray] [--plan]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
DEVICE_NODES = ("/dev/nvidia0",)  # the NVIDIA driver's first device: there whether or not torch can use it
# What the torch tier imports beside torch (module names): the carried wheels of docs/testing.md.
TORCH_TIER_NEEDS = ("pydantic", "yaml", "psutil", "numpy", "pytest")


@dataclass(frozen=True)
class Check:
    name: str
    command: list[str]
    timeout_s: int
    figures: Callable[[str], str]  # what the check measured, from its output


def gpu_present(nodes: Sequence[str] = DEVICE_NODES) -> str | None:
    """What shows a GPU on this machine whatever torch says: nvidia-smi listing one, or the driver's device node."""
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            listed = ""
        gpus = [line.strip() for line in listed.splitlines() if line.startswith("GPU ")]
        if gpus:
            return gpus[0] + (f" and {len(gpus) - 1} more" if len(gpus) > 1 else "")
    return next((f"{node} exists" for node in nodes if Path(node).exists()), None)


def cuda_failure(gpu: str | None, torch: Any) -> str | None:
    """The one line that fails the check where a GPU is present but torch cannot use it (else None): a CPU torch
    (a pip index that offered `+cpu` first) must not pass as "nothing to check"."""
    if gpu is None:
        return None
    if torch is None:
        return f"gpu-check: FAIL: a GPU is present ({gpu}) but torch is not installed"
    if torch.version.cuda is None:
        return (f"gpu-check: FAIL: a GPU is present ({gpu}) but torch {torch.__version__} is a CPU build "
                "(torch.version.cuda is None): install a CUDA build of torch")
    if not torch.cuda.is_available():
        return (f"gpu-check: FAIL: a GPU is present ({gpu}) but torch {torch.__version__} (CUDA "
                f"{torch.version.cuda}) cannot use it (torch.cuda.is_available() is False: driver too old?)")
    return None


def gpu_test_files() -> list[str]:
    """The unit test files with gpu-marked tests: only these are collected (the others import Ray, MLflow, moto)."""
    found = [p for p in sorted((ROOT / "tests" / "unit").rglob("test_*.py")) if "mark.gpu" in p.read_text()]
    return [p.relative_to(ROOT).as_posix() for p in found]


def _pytest_figures(out: str) -> str:
    found = re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", out)
    return ", ".join(f"{n} {what}" for n, what in found) or "no summary line"


def _bench_figures(out: str) -> str:
    rows = [line.split() for line in out.splitlines() if line.startswith(("fp32 strict", "tf32", "bf16"))]
    return "; ".join(f"{' '.join(r[:-5])} {r[-5]} tokens/s MFU {r[-3]}" for r in rows) or "no table"


def _probe_figures(out: str) -> str:
    return next((line.removeprefix("probe: ") for line in out.splitlines() if line.startswith("probe: ")),
                "no probe line")


def _train_figures(out: str) -> str:
    picked = [line for line in out.splitlines()
              if line.startswith(("throughput:", "autopilot", "time:")) or "mfu" in line.lower()]
    return " | ".join(picked)[:400] or "no summary lines"


def torch_tier(cuda: bool) -> list[Check]:
    pytest = [PYTHON, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *gpu_test_files()]
    # 12 of the bench's 24 layers: compiling the model stays within the limit. Without a GPU only its imports.
    bench = ["--steps", "5", "--layers", "12"] if cuda else ["--help"]
    return [Check("pytest -m gpu", pytest, 200, _pytest_figures),
            Check("probe", [PYTHON, str(Path(__file__).resolve()), "--probe"], 90, _probe_figures),
            Check("bench/gpu.py", [PYTHON, "bench/gpu.py", *bench], 180,
                  _bench_figures if cuda else (lambda out: "imports (no GPU: not run)"))]


def ray_tier(scratch: Path, gpus: int) -> list[Check]:
    data, runs = scratch / "data", scratch / "runs"
    orchestrator = str(Path(PYTHON).parent / "orchestrator")
    train = [orchestrator, "train", "--set", f"data.train={data}/train", "--set", f"data.val={data}/val",
             "--set", "data.features=[features]", "--set", f"storage.path={runs}", "--set", "tracking.enabled=false",
             "--set", "model.hidden=[1024, 1024]", "--set", "scaling.num_workers=1", "--set", "scaling.use_gpu=true",
             "--set", "train.global_batch_size=1024", "--set", "train.max_steps=600", "--set", "train.log_every=50"]
    checks = [
        Check("prepare data", [orchestrator, "prepare", "synthetic", "--out", str(data), "--rows", "200000",
                               "--shards", "8", "--val-rows", "5000"], 30, lambda out: ""),
        Check("train (Ray, 1 GPU)", train, 60, _train_figures),
        Check("autopilot, poor start", [*train, "--set", "autopilot.enabled=true", "--set", "train.micro_batch_size=8",
                                        "--set", "train.grad_accum_steps=128"], 60, _train_figures),
    ]
    if gpus >= 2:
        checks.append(Check("train (Ray, 2 GPUs, NCCL)", [*train, "--set", "scaling.num_workers=2"], 90,
                            _train_figures))
    return checks


def run(check: Check) -> tuple[bool, str, float]:
    # The checkout on the path (nothing is installed on a bare machine); only pytest's own plugins (a bare machine
    # has no others, and another plugin may import what the tier lacks).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    started = time.perf_counter()
    try:
        done = subprocess.run(check.command, cwd=ROOT, capture_output=True, text=True, timeout=check.timeout_s,
                              env=env)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return False, f"timed out after {check.timeout_s} s; last output: {out[-300:]}", check.timeout_s
    seconds = time.perf_counter() - started
    out = done.stdout + done.stderr
    if done.returncode != 0:
        tail = " / ".join(line for line in out.splitlines()[-6:] if line.strip())
        return False, f"exit {done.returncode}: {tail[-400:]}", seconds
    return True, check.figures(out), seconds


def probe() -> int:
    """The step's device behaviour, in a process of its own: a small GPT through the loop at precision auto (bf16 on
    a GPU that has it), every host read and device sync between reports counted (tests/unit/training/reads.py)."""
    import math

    import torch

    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "unit" / "training")]
    from reads import HostReads

    from orchestrator.config import load_config
    from orchestrator.training.loop import Data
    from orchestrator.training.loop import run as run_loop
    from orchestrator.training.parts import build_parts

    cuda = torch.cuda.is_available()
    device, steps, seq = torch.device("cuda" if cuda else "cpu"), 60 if cuda else 8, 256 if cuda else 32
    cfg = load_config(None, [
        "scaling.num_workers=1", f"scaling.use_gpu={str(cuda).lower()}", "model.name=gpt", "data.label=null",
        "task.name=causal_lm", f"model.d_model={256 if cuda else 32}", "model.n_layer=4", "model.n_head=4",
        "model.num_classes=512", "train.global_batch_size=32", "train.micro_batch_size=16", f"train.max_steps={steps}",
        f"train.log_every={steps // 2}", "data.val=null", "train.eval_every=null", f"checkpoint.every={steps * 2}",
        "optim.warmup_steps=2"])
    parts = build_parts(cfg, seq, device)
    tokens = torch.randint(0, 512, (32 * steps, seq + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if cuda:
        x, y = x.pin_memory(), y.pin_memory()  # as RankBatches hands them on a GPU rank

    class Reports:
        def __init__(self) -> None:
            self.metrics: list[dict[str, Any]] = []

        def publish(self, metrics: dict[str, Any]) -> None:
            self.metrics.append(metrics)

        def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
            pass

    reports = Reports()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with HostReads(sync_debug=True).around_loop() as reads:
        run_loop(cfg, parts, Data(lambda epoch: [{"x": x[i:i + 16], "labels": y[i:i + 16]}
                                                 for i in range(0, len(x), 16)]), reports)
    last = reports.metrics[-1]
    waits = reads.counts.get("step", 0) + reads.syncs.get("step", 0)
    finite = all(math.isfinite(m["train_loss"]) for m in reports.metrics)
    peak = f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB peak" if cuda else "CPU"
    print(f"probe: {device.type} {parts.precision.mode}, fused optimizer {bool(parts.optimizer.defaults.get('fused'))}"
          f", {reads.steps} steps, {last.get('tokens_per_s', 0):,.0f} tokens/s, {waits} host waits between reports, "
          f"loss {last['train_loss']:.3f}, {peak}")
    return 0 if waits == 0 and finite and reads.steps == steps else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ray", action="store_true", help="the Ray tier (needs the full .venv with a CUDA torch)")
    parser.add_argument("--plan", action="store_true", help="print the checks' commands and time limits, run none")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the torch tier's probe process
    args = parser.parse_args(argv)
    if args.probe:
        return probe()
    gpu = gpu_present()
    try:
        torch: Any = importlib.import_module("torch")
    except ImportError as exc:  # absent, or a build whose libraries do not load: one line either way
        torch = None
        if gpu is not None and importlib.util.find_spec("torch") is not None:
            print(f"gpu-check: FAIL: a GPU is present ({gpu}) but torch does not import: {exc}")
            return 1
    failure = cuda_failure(gpu, torch)
    if failure:
        print(failure)
        return 1
    cuda = torch is not None and torch.cuda.is_available()
    if not args.ray:
        missing = [name for name in TORCH_TIER_NEEDS if importlib.util.find_spec(name) is None]
        if torch is None or missing:
            print(f"gpu-check: FAIL: the torch tier needs {', '.join((['torch'] if torch is None else []) + missing)}"
                  " here: carry their wheels as docs/testing.md says")
            return 1
    elif not cuda:
        print("gpu-check: no GPU: nothing to check (run it where a GPU is)")
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        plan = ray_tier(Path(scratch), torch.cuda.device_count()) if args.ray else torch_tier(cuda)
        if args.plan:
            for check in plan:
                print(f"{check.name:<26}{check.timeout_s:>5} s  {' '.join(check.command)}")
            return 0
        where = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}" if cuda
                 else "no GPU: the tier's collection and probe on the CPU")
        print(f"gpu-check, {'Ray' if args.ray else 'torch'} tier, on {where}, torch {torch.__version__}", flush=True)
        results = []
        for check in plan:
            ok, figures, seconds = run(check)
            results.append((check.name, ok, figures, seconds))
            print(f"  {'pass' if ok else 'FAIL'} {check.name} ({seconds:.0f} s): {figures}", flush=True)
    print(f"\n{'check':<26}{'result':<8}{'s':>6}  measured")
    for name, ok, figures, seconds in results:
        print(f"{name:<26}{'pass' if ok else 'FAIL':<8}{seconds:>6.0f}  {figures}")
    passed = all(ok for _, ok, _, _ in results)
    if not cuda:
        print("no GPU: nothing to check on a GPU" + ("" if passed else " (and the tier failed on the CPU)"))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
