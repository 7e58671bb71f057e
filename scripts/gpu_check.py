"""`make gpu-check`: proves the GPU path in one command, the first time a machine with CUDA is at hand.

Each check runs as its own command with its own time limit (8 minutes in all on one H100), and one table closes the
run: the check, pass or fail, and what it measured (samples/s, MFU). Without CUDA it says so in one line and exits 0.

    1. pytest -m gpu       every CUDA-only branch: bf16 and fp16 (GradScaler, fused optimizer), a GPT trained with
                           torch.cuda.set_sync_debug_mode("error") in the steps between reports (no device sync),
                           an OOM retry from a real allocation, the auto micro-batch, memory statistics
    2. bench/gpu.py        strict fp32 / TF32 / bf16 / bf16+compile tokens/s and MFU of the built-in GPT
    3. train (Ray)         `orchestrator train` on one GPU through Ray Train, product defaults (bf16 by auto)
    4. autopilot           the same from a poor start (micro-batch 8 with accumulation): what the search chose

    .venv/bin/python scripts/gpu_check.py [--plan]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


@dataclass(frozen=True)
class Check:
    name: str
    command: list[str]
    timeout_s: int
    figures: Callable[[str], str]  # what the check measured, from its output


def _pytest_figures(out: str) -> str:
    found = re.findall(r"(\d+) (passed|failed|skipped|error)", out)
    return ", ".join(f"{n} {what}" for n, what in found) or "no summary line"


def _bench_figures(out: str) -> str:
    rows = [line.split() for line in out.splitlines() if line.startswith(("fp32 strict", "tf32", "bf16"))]
    return "; ".join(f"{' '.join(r[:-5])} {r[-5]} tokens/s MFU {r[-3]}" for r in rows) or "no table"


def _train_figures(out: str) -> str:
    picked = [line for line in out.splitlines()
              if line.startswith(("throughput:", "autopilot", "time:")) or "mfu" in line.lower()]
    return " | ".join(picked)[:400] or "no summary lines"


def checks(scratch: Path) -> list[Check]:
    data, runs = scratch / "data", scratch / "runs"
    orchestrator = str(Path(PYTHON).parent / "orchestrator")
    train = [orchestrator, "train", "--set", f"data.train={data}/train", "--set", f"data.val={data}/val",
             "--set", "data.features=[features]", "--set", f"storage.path={runs}", "--set", "tracking.enabled=false",
             "--set", "model.hidden=[1024, 1024]", "--set", "scaling.num_workers=1", "--set", "scaling.use_gpu=true",
             "--set", "train.global_batch_size=1024", "--set", "train.max_steps=600", "--set", "train.log_every=50"]
    return [
        Check("pytest -m gpu", [PYTHON, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/unit"],
              150, _pytest_figures),
        # 12 of the bench's 24 layers: compiling the model stays within the limit.
        Check("bench/gpu.py", [PYTHON, "bench/gpu.py", "--steps", "5", "--layers", "12"], 180, _bench_figures),
        Check("prepare data", [orchestrator, "prepare", "synthetic", "--out", str(data), "--rows", "200000",
                               "--shards", "8", "--val-rows", "5000"], 30, lambda out: ""),
        Check("train (Ray, 1 GPU)", train, 60, _train_figures),
        Check("autopilot, poor start", [*train, "--set", "autopilot.enabled=true", "--set", "train.micro_batch_size=8",
                                        "--set", "train.grad_accum_steps=128"], 60, _train_figures),
    ]


def run(check: Check) -> tuple[bool, str, float]:
    started = time.perf_counter()
    try:
        done = subprocess.run(check.command, cwd=ROOT, capture_output=True, text=True, timeout=check.timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return False, f"timed out after {check.timeout_s} s; last output: {out[-300:]}", check.timeout_s
    seconds = time.perf_counter() - started
    out = done.stdout + done.stderr
    if done.returncode != 0:
        tail = " / ".join(line for line in out.splitlines()[-6:] if line.strip())
        return False, f"exit {done.returncode}: {tail[-400:]}", seconds
    return True, check.figures(out), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", action="store_true", help="print the checks' commands and time limits, run none")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        plan = checks(Path(scratch))
        if args.plan:
            for check in plan:
                print(f"{check.name:<24}{check.timeout_s:>5} s  {' '.join(check.command)}")
            return 0
        import torch

        if not torch.cuda.is_available():
            print("gpu-check: no CUDA device on this machine, nothing to check (run it where a GPU is)")
            return 0
        print(f"gpu-check on {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}",
              flush=True)
        results = []
        for check in plan:
            ok, figures, seconds = run(check)
            results.append((check.name, ok, figures, seconds))
            print(f"  {'pass' if ok else 'FAIL'} {check.name} ({seconds:.0f} s): {figures}", flush=True)
    print(f"\n{'check':<24}{'result':<8}{'s':>6}  measured")
    for name, ok, figures, seconds in results:
        print(f"{name:<24}{'pass' if ok else 'FAIL':<8}{seconds:>6.0f}  {figures}")
    return 0 if all(ok for _, ok, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
