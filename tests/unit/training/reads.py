"""Counting what makes the host wait for the device: every value read back from a tensor (`.item()`, `bool()`,
`float()`, `int()` go through `aten._local_scalar_dense`; `.tolist()` is counted where it is called) and every
device synchronisation, split into the loop's steps and its reports. The real loop runs; only the counting is added
(the counted functions are wrapped, not replaced).

With `profile`, the waits torch's profiler sees are counted too, by the same windows: on CUDA the runtime calls
that block the host (what `set_sync_debug_mode` misses: `torch.cuda.synchronize`, `Event.synchronize`, a
synchronous `cudaMemcpy`), on any device each read of a value (`aten::_local_scalar_dense`)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from orchestrator.training import loop
from orchestrator.training.cadence import Cadence

# The profiler's names for a host that waits for the device (cudaMemcpy: the synchronous copy, not ...Async), and
# for a value read back (on CUDA its copy and wait are among those; on the CPU it waits for nothing but marks a read).
CUDA_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
READ, READERS = "aten::_local_scalar_dense", ("aten::item", "aten::is_nonzero")


class HostReads(TorchDispatchMode):
    """Counts reads and synchronisations by where the loop is: `step` (a step between reports), `report` (the
    report and what follows it), `first` (this process's first step: FLOPs counted, optimizer state measured)."""

    def __init__(self, sync_debug: bool = False, profile: bool = False) -> None:
        super().__init__()
        # On CUDA: torch raises on any device synchronisation made while the loop is in its steps.
        self.sync_debug = sync_debug and torch.cuda.is_available()
        self.where = "step"
        self.counts: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.steps = 0
        # The profiler's WAITS by window ("report", "step", ...: (where, name) -> count); each window a profiler
        # range named `waits.<where>`, one after another; a cadence window belongs to the report it found due.
        self.profile = profile
        self.waits: Counter[tuple[str, str]] = Counter()
        self._range: Any = None
        self._due: list[bool] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counts["step" if self.where == "cadence" else self.where] += 1
        return func(*args, **(kwargs or {}))

    def _enter(self, where: str) -> None:
        self.where = where
        if self.sync_debug:
            torch.cuda.set_sync_debug_mode("error" if where == "step" else "default")
        if self.profile:
            if self._range is not None:
                self._range.__exit__(None, None, None)
            self._range = torch.profiler.record_function(f"waits.{where}")
            self._range.__enter__()

    def _count_waits(self, events: Any) -> None:
        """Each profiled wait into the window its start falls in, on the loop's thread."""
        windows = sorted((e.time_range.start, e.time_range.end, e.name.removeprefix("waits."))
                         for e in events if e.name.startswith("waits."))
        due = iter(self._due)
        windows = [(start, end, ("report" if next(due, False) else "step") if where == "cadence" else where)
                   for start, end, where in windows]
        for event in events:
            if event.name in CUDA_WAITS or (event.name == READ and not _inside_an_op(event)):
                where = next((w for start, end, w in windows if start <= event.time_range.start < end), "outside")
                self.waits[where, event.name] += 1

    @contextlib.contextmanager
    def around_loop(self) -> Iterator[HostReads]:
        """Within: loop.run's reports and first step are told apart from its steps, tolist and synchronize count."""
        report, first, step, at = loop._report, loop._first_step, loop.train_step, Cadence.at
        tolist, synchronize = torch.Tensor.tolist, torch.cuda.synchronize

        def within(name: str, fn: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                outer = self.where
                self._enter(name)
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._enter(outer)
            return wrapped

        def counted_step(*args: Any, **kwargs: Any) -> Any:
            self.steps += 1
            return step(*args, **kwargs)

        def counted_at(cadence: Cadence, number: int) -> Any:
            # What the cadence reads at a report step (rank 0's clock, the drain notice) belongs to that report.
            # (Torch's sync check is off inside: a read here is still counted, as the step's when it is not a report.)
            before, outer = self.counts[self.where], self.where
            self._enter("cadence")
            try:
                due = at(cadence, number)
            finally:
                self._enter(outer)
            if due is not None and self.where == "step":
                self.counts["report"] += self.counts["step"] - before
                self.counts["step"] = before
            self._due.append(due is not None and self.where == "step")
            return due

        def counted_tolist(tensor: torch.Tensor) -> Any:
            self.counts["step" if self.where == "cadence" else self.where] += 1
            return tolist(tensor)

        def counted_synchronize(*args: Any, **kwargs: Any) -> None:
            self.syncs[self.where] += 1
            if torch.cuda.is_available():
                synchronize(*args, **kwargs)

        loop._report, loop._first_step, loop.train_step = (  # type: ignore[assignment]
            within("report", report), within("first", first), counted_step)
        Cadence.at = counted_at  # type: ignore[method-assign]
        torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign]
        torch.cuda.synchronize = counted_synchronize  # type: ignore[assignment]
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        profiler = torch.profiler.profile(activities=activities) if self.profile else contextlib.nullcontext()
        try:
            with profiler, self:
                self._enter("step")
                yield self
                self._enter("report")
                if self.profile:
                    self._range.__exit__(None, None, None)
                    self.profile = False
            if isinstance(profiler, torch.profiler.profile):
                self._count_waits(profiler.events())
        finally:
            self._enter("report")  # torch's default mode again
            loop._report, loop._first_step, loop.train_step = report, first, step  # type: ignore[assignment]
            Cadence.at = at  # type: ignore[method-assign]
            torch.Tensor.tolist = tolist  # type: ignore[method-assign]
            torch.cuda.synchronize = synchronize  # type: ignore[assignment]


def _inside_an_op(event: Any) -> bool:
    """A read made inside another op's kernel (the CPU's fused AdamW reads its step count): that op's own business,
    on a CPU tensor, not the loop's read; on CUDA a kernel that waits shows as one of CUDA_WAITS. Or the same read
    again, as HostReads' dispatch mode passes it on."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::") and parent.name not in READERS:
            return True
        parent = parent.cpu_parent
    return False
