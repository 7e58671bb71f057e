"""The steps since the last report (`Interval`): their results kept on the device as they came,
added up by the report in the interval's one read of the device."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from orchestrator.training.step import StepResult
from orchestrator.training.timing import PhaseTimer


@dataclass
class Interval:
    """The steps since the last report. Their results stay on the device, kept as they came: adding
    them up is left to the report, which reads everything back at once, so no step waits for the
    device or pays for the sums."""

    timer: PhaseTimer
    results: list[StepResult] = field(default_factory=list)
    samples: int = 0
    micro: int = 0  # micro-batch size actually run (smaller after an out-of-memory retry)
    comm_start: int = 0  # StepState.comm_bytes when the interval began

    def add(self, result: StepResult, micro: int) -> None:
        self.results.append(result)
        self.samples += result.samples
        self.micro = micro

    def sums(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """On the device, in float64 (token counts pass 2**24): the sums every rank adds up (loss
        over the applied steps, targets, samples, targets of the applied steps) and this rank's own
        (gradient norms of the steps that applied an update, how many did, non-finite steps). A
        skipped (non-finite) step adds its targets but no loss or gradient norm; a step the fp16
        scaler skipped adds its loss but not its overflowed norm."""
        if not self.results:
            return (torch.zeros(4, dtype=torch.float64, device=device),
                    torch.zeros(3, dtype=torch.float64, device=device))
        figures = torch.stack([torch.stack([r.loss_sum.double().reshape(()),
                                            r.grad_norm.double().reshape(()),
                                            r.targets.double().reshape(()),
                                            r.skipped.double().reshape(()),
                                            r.overflowed.double().reshape(())])
                               for r in self.results])
        loss, norm, targets, skipped, overflowed = figures.unbind(1)
        applied = skipped == 0
        counted = applied & (overflowed == 0)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        shared = torch.stack([torch.where(applied, loss, zero).sum(), targets.sum(),
                              torch.tensor(float(self.samples), dtype=torch.float64, device=device),
                              (targets * applied).sum()])
        own = torch.stack([torch.where(counted, norm, zero).sum(), counted.sum().double(),
                           skipped.sum()])
        return shared, own
