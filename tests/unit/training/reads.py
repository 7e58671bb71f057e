"""Counting what makes the host wait for the device: every value read back from a tensor (`.item()`, `bool()`,
`float()`, `int()` go through `aten._local_scalar_dense`; `.tolist()` is counted where it is called) and every
device synchronisation, split into the loop's steps and its reports. The real loop runs; only the counting is added
(the counted functions are wrapped, not replaced)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from orchestrator.training import loop
from orchestrator.training.cadence import Cadence


class HostReads(TorchDispatchMode):
    """Counts reads and synchronisations by where the loop is: `step` (a step between reports), `report` (the
    report and what follows it), `first` (this process's first step: FLOPs counted, optimizer state measured)."""

    def __init__(self, sync_debug: bool = False) -> None:
        super().__init__()
        # On CUDA: torch raises on any device synchronisation made while the loop is in its steps.
        self.sync_debug = sync_debug and torch.cuda.is_available()
        self.where = "step"
        self.counts: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.steps = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counts["step" if self.where == "cadence" else self.where] += 1
        return func(*args, **(kwargs or {}))

    def _enter(self, where: str) -> None:
        self.where = where
        if self.sync_debug:
            torch.cuda.set_sync_debug_mode("error" if where == "step" else "default")

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
        try:
            with self:
                self._enter("step")
                yield self
        finally:
            self._enter("report")  # torch's default mode again
            loop._report, loop._first_step, loop.train_step = report, first, step  # type: ignore[assignment]
            Cadence.at = at  # type: ignore[method-assign]
            torch.Tensor.tolist = tolist  # type: ignore[method-assign]
            torch.cuda.synchronize = synchronize  # type: ignore[assignment]
