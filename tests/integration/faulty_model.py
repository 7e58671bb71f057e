"""A user model (loaded through `model.entrypoint`) that kills its own worker process once, mid-run."""

from __future__ import annotations

import os
from pathlib import Path

import torch


class DiesOnce(torch.nn.Module):
    def __init__(self, in_features: int, num_classes: int, marker: str, after_calls: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(in_features, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, num_classes))
        self.marker = Path(marker)
        self.after_calls = after_calls
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.after_calls and not self.marker.exists():
                self.marker.write_text(str(os.getpid()))
                os._exit(1)  # a hard crash: no exception, no cleanup, like an OOM kill
        return self.net(x)


def build(in_features: int, num_classes: int, marker: str, after_calls: int = 7) -> torch.nn.Module:
    return DiesOnce(in_features, num_classes, marker, after_calls)
