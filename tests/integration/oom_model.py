"""A user model (loaded through `model.entrypoint`) whose forward runs out of device memory on one rank only, as
one GPU of a group fills up before the others."""

from __future__ import annotations

import torch
import torch.distributed as dist


class FullOnOneRank(torch.nn.Module):
    def __init__(self, in_features: int, num_classes: int, rank: int, call: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(in_features, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, num_classes))
        self.rank, self.call, self.calls = rank, call, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.call and dist.is_initialized() and dist.get_rank() == self.rank:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.net(x)


def build(in_features: int, num_classes: int, rank: int = 1, call: int = 3) -> torch.nn.Module:
    return FullOnOneRank(in_features, num_classes, rank, call)
