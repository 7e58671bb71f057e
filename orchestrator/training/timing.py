"""Where each second goes: phase timers, FLOPs per sample and model FLOPs utilisation (MFU)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

# Dense bf16/fp16 tensor-core peaks (FLOP/s) by a substring of torch.cuda.get_device_name().
# Longest match wins ("H100 PCIe" before "H100"). Set train.peak_tflops for anything else (CPUs included).
PEAK_FLOPS = {
    "H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "GH200": 989e12, "B200": 2250e12,
    "A100": 312e12, "A10G": 70e12, "A10": 125e12, "L40S": 362e12, "L4": 121e12,
    "V100": 125e12, "T4": 65e12, "RTX 4090": 165e12, "RTX 3090": 71e12,
}

PHASES = ("compute", "sync", "data_wait", "eval", "checkpoint", "report")


def peak_flops(device: torch.device, configured_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device: the configured value, else the table for known GPUs, else unknown."""
    if configured_tflops:
        return configured_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    matches = [key for key in PEAK_FLOPS if key in name]
    return PEAK_FLOPS[max(matches, key=len)] if matches else None


def count_flops(step: Callable[[], None]) -> int:
    """FLOPs of one call of `step` (forward + backward), counted by torch's flop counter, not estimated."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return counter.get_total_flops()


class PhaseTimer:
    """Wall seconds per phase within one report interval. On CUDA the device is synchronised at phase ends,
    otherwise asynchronous kernels would be billed to whichever phase happens to wait for them."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)
        self.started = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def shares(self) -> dict[str, float]:
        """Share of the interval's wall time per phase; `other` is the rest (metrics, logging, Python)."""
        wall = max(time.perf_counter() - self.started, 1e-9)
        shares = {f"time/{name}_frac": self.seconds[name] / wall for name in PHASES}
        shares["time/other_frac"] = max(0.0, 1.0 - sum(shares.values()))
        return shares
