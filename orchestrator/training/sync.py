"""How workers agree on the model: DDP's per-step gradient all-reduce, or local SGD's periodic
parameter average (with an optional DiLoCo-style outer Nesterov step). Also counts the bytes every
rank puts into all-reduces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from orchestrator.training import ranks


def grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of one DDP gradient all-reduce: every trainable parameter's gradient, in the
    parameter's dtype."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


@dataclass
class LocalSGD:
    """Each rank steps alone; every `every` steps the parameters (and floating buffers) are
    averaged.

    With `outer_momentum`, the averaged change since the last sync is treated as an outer gradient
    (anchor - average) and applied to the anchor with Nesterov momentum and `outer_lr` (DiLoCo);
    without it, params = anchor - outer_lr * (anchor - average), which is the plain average at
    outer_lr = 1.
    """

    every: int
    outer_lr: float = 1.0
    outer_momentum: float | None = None
    anchor: list[torch.Tensor] = field(default_factory=list)  # parameters right after the last sync
    momentum: list[torch.Tensor] = field(default_factory=list)
    syncs: int = 0

    def due(self, step: int) -> bool:
        return step % self.every == 0

    @torch.no_grad()
    def average(self, model: torch.nn.Module) -> int:
        """Average across ranks (a collective: every rank calls it at the same step); returns bytes
        all-reduced."""
        params = [p for p in model.parameters() if p.requires_grad]
        sent = average_tensors(params + [b for b in model.buffers() if b.is_floating_point()])
        # first sync: the start point every rank shared (DDP broadcast rank 0's weights)
        if not self.anchor:
            self.anchor = [p.detach().clone() for p in params]
        self._outer_step(params)
        self.anchor = [p.detach().clone() for p in params]
        self.syncs += 1
        return sent

    def _outer_step(self, params: list[torch.Tensor]) -> None:
        if self.outer_momentum is None and self.outer_lr == 1.0:
            return  # the average is the result
        if self.outer_momentum is not None and not self.momentum:
            self.momentum = [torch.zeros_like(p) for p in params]
        for i, (p, anchor) in enumerate(zip(params, self.anchor, strict=True)):
            delta = anchor - p  # the outer "gradient": how far the averaged workers moved, negated
            if self.outer_momentum is not None:
                buf = self.momentum[i].mul_(self.outer_momentum).add_(delta)
                delta = delta + self.outer_momentum * buf  # Nesterov
            p.copy_(anchor - self.outer_lr * delta)

    def start(self, model: torch.nn.Module) -> None:
        """Remember the shared start point (before the first local step)."""
        self.anchor = [p.detach().clone() for p in model.parameters() if p.requires_grad]

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": [m.cpu() for m in self.momentum], "syncs": self.syncs}

    def load_state_dict(self, state: dict[str, Any], model: torch.nn.Module) -> None:
        # Checkpoints are written right after a sync: the restored parameters are the anchor.
        self.start(model)
        device = self.anchor[0].device if self.anchor else torch.device("cpu")
        self.momentum = [m.to(device) for m in state.get("momentum", [])]
        self.syncs = int(state.get("syncs", 0))


@torch.no_grad()
def average_tensors(tensors: list[torch.Tensor]) -> int:
    """Each tensor replaced by its mean across ranks, in one flat all-reduce (a single latency
    instead of one per tensor); returns the bytes all-reduced (0 alone)."""
    world = ranks.world()[1]
    if world == 1 or not tensors:
        return 0
    flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return flat.numel() * flat.element_size()


def average_optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    """The ranks' optimizer states averaged into one (a collective). Local SGD lets each rank's
    moments follow its own gradients; DDP after it steps every rank with one gradient, which keeps
    the replicas one model only if every rank's state is the same. Returns the bytes all-reduced."""
    return average_tensors([v for state in optimizer.state.values() for v in state.values()
                            if isinstance(v, torch.Tensor) and v.is_floating_point()
                            and v.dim() > 0])


def build_local_sgd(sync: str, every: int, outer_lr: float,
                    outer_momentum: float | None) -> LocalSGD | None:
    """The local-SGD state for train.sync=local_sgd, else None (DDP)."""
    return LocalSGD(every, outer_lr, outer_momentum) if sync == "local_sgd" else None
