"""Where each second goes: phase timers, FLOPs per sample and model FLOPs utilisation (MFU)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

# Dense bf16/fp16 tensor-core peaks (FLOP/s) by a substring of torch.cuda.get_device_name().
# Longest match wins ("H100 PCIe" before "H100"). Set train.peak_tflops for anything else (CPUs
# included).
PEAK_FLOPS = {
    "H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "GH200": 989e12, "B200": 2250e12,
    "A100": 312e12, "A10G": 70e12, "A10": 125e12, "L40S": 362e12, "L4": 121e12,
    "V100": 125e12, "T4": 65e12, "RTX 4090": 165e12, "RTX 3090": 71e12,
}

# Dense fp32 peaks without tensor cores (FLOP/s), for runs in fp32 with TF32 off.
FP32_FLOPS = {
    "H200": 67e12, "H100 PCIe": 51e12, "H100": 67e12, "GH200": 67e12, "A100": 19.5e12,
    "A10G": 31.2e12, "A10": 31.2e12, "L40S": 91.6e12, "L4": 30.3e12, "V100": 15.7e12,
    "T4": 8.1e12, "RTX 4090": 82.6e12, "RTX 3090": 35.6e12,
}

PHASES = ("compute", "sync", "data_wait", "eval", "checkpoint", "report")


def peak_flops(device: torch.device, configured_tflops: float | None,
               precision: str = "bf16") -> float | None:
    """Peak FLOP/s of one device in `precision` (the run's: MFU against a faster mode's peak would
    understate it): the configured value, else the tables for known GPUs (TF32 runs at half the bf16
    tensor-core peak on Ampere and later), else unknown."""
    if configured_tflops:
        return configured_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if precision in ("bf16", "fp16"):
        return _lookup(PEAK_FLOPS, name)
    if torch.backends.cuda.matmul.allow_tf32 and torch.cuda.get_device_capability(device)[0] >= 8:
        peak = _lookup(PEAK_FLOPS, name)
        return peak / 2 if peak else None
    return _lookup(FP32_FLOPS, name)


def _lookup(table: dict[str, float], name: str) -> float | None:
    matches = [key for key in table if key in name]  # the longest match: "H100 PCIe" before "H100"
    return table[max(matches, key=len)] if matches else None


def count_flops(step: Callable[[], None]) -> int:
    """FLOPs of one call of `step` (forward + backward), counted by torch's flop counter, not
    estimated."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return counter.get_total_flops()


class PhaseTimer:
    """Seconds per phase within one report interval, read at the report.

    On CPU a mark is the host's clock. On CUDA kernels run after the host queued them, so a host
    clock would bill them to whichever phase happens to wait: each mark is instead a CUDA event
    recorded on the device's stream (queued, no wait), and the report synchronises once (`resolve`)
    before reading every span of the interval. A step never waits for the device to be timed.
    `events`: the event factory (CUDA's by default on a CUDA device; tests inject one)."""

    def __init__(self, device: torch.device, events: Callable[[], Any] | None = None) -> None:
        if events is None and device.type == "cuda":
            events = partial(torch.cuda.Event, enable_timing=True)
        self.events = events
        self.seconds: dict[str, float] = defaultdict(float)
        # to work out at the report
        self.pending: list[Callable[[Callable[[Any, Any], float]], None]] = []
        self.last: Any = None  # the newest event recorded
        self.started = time.perf_counter()

    def mark(self) -> Any:
        """A point in time: the host's clock, or a CUDA event recorded now on the current stream."""
        if self.events is None:
            return time.perf_counter()
        self.last = self.events()
        self.last.record()
        return self.last

    def later(self, work: Callable[[Callable[[Any, Any], float]], None]) -> None:
        """Run `work(between)` once the marks it reads are complete: now on the host's clock, at the
        report on a device's (`between(a, b)`: seconds from mark a to mark b)."""
        if self.events is None:
            work(_host_between)
        else:
            self.pending.append(work)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self.mark()
        try:
            yield
        finally:
            end = self.mark()
            self.later(lambda between: self.add(name, between(start, end)))

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def resolve(self) -> None:
        """At a report: wait once for the device to pass the newest mark, then work out every
        pending span."""
        if not self.pending:
            return
        self.last.synchronize()
        for work in self.pending:
            work(_event_between)
        self.pending.clear()

    def shares(self) -> dict[str, float]:
        """Share of the interval's wall time per phase; `other` is the rest (metrics, logging,
        Python)."""
        self.resolve()
        wall = max(time.perf_counter() - self.started, 1e-9)
        shares = {f"time/{name}_frac": self.seconds[name] / wall for name in PHASES}
        shares["time/other_frac"] = max(0.0, 1.0 - sum(shares.values()))
        return shares


def _host_between(start: float, end: float) -> float:
    return end - start


def _event_between(start: Any, end: Any) -> float:
    return start.elapsed_time(end) / 1000.0  # milliseconds
