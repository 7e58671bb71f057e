"""Validation: the task's metrics over each rank's validation shard, their sums added across ranks
(under FSDP with every rank running as many forwards as the others)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from orchestrator.errors import UserError
from orchestrator.training import fsdp, ranks
from orchestrator.training.checkpoint import unwrap
from orchestrator.training.memory import release_if_pressed
from orchestrator.training.parts import Parts
from pipelines.tensors import Batch, to_device


@torch.no_grad()
def evaluate(parts: Parts, batches: Iterable[Batch]) -> dict[str, float]:
    """The task's validation metrics over this rank's validation shard, their sums added across
    ranks."""
    # The bare module: DDP's forward would broadcast buffers, a collective that ranks must not call
    # unevenly.
    model = unwrap(parts.model)
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    for batch, real in (_lockstep(batches, parts) if fsdp.is_sharded(model)
                        else ((b, True) for b in batches)):
        batch = to_device(batch, parts.device)
        with parts.precision.autocast():
            output = parts.call(model, batch)
        if not real:
            continue
        for key, value in parts.task.metric_sums(output, batch).items():
            totals[key] = totals.get(key, 0) + value.double()
    # Every rank reduces the same keys in the same order; a rank without rows learns them from the
    # others.
    keys = sorted(ranks.gather_keys(list(totals)))
    sums = dict(zip(keys,
                    ranks.all_reduce_sum([float(totals.get(k, 0.0)) for k in keys], parts.device),
                    strict=True))
    release_if_pressed(parts.device)  # the cache stays unless the device is short
    if not sums.get("count"):
        raise UserError("the validation split gave no rows to any "
                        "worker: add rows or set data.val to null")
    return parts.task.metrics(sums)


def _lockstep(batches: Iterable[Batch], parts: Parts) -> Iterator[tuple[Batch, bool]]:
    """Under FSDP every forward all-gathers parameters, so every rank must run as many forwards as
    the others: a rank whose validation shard ran out runs empty (zero-row) batches, marked not
    real, until no rank has one left. One flag all-reduce per batch; a rank without any rows gets
    its empty batch's shape from the others."""
    mine = iter(batches)
    empty: Batch | None = None
    while True:
        batch = next(mine, None)
        if not ranks.any_rank(batch is not None, parts.device):
            return
        # once: the first batches' shapes (a collective, on every rank at the same iteration)
        if empty is None:
            empty = _empty_like_others(batch, parts.device)
        yield (batch, True) if batch is not None else (empty, False)


def _empty_like_others(batch: Batch | None, device: torch.device) -> Batch:
    """A zero-row batch on `device` shaped like the first batch of a rank that has one. Only shapes
    and dtypes cross between ranks (plain objects, no tensor): a pickled tensor is unpickled on the
    device it was on, so a CUDA one made every rank open a CUDA context on the sender's GPU."""
    mine = None if batch is None else {k: (tuple(v.shape[1:]), v.dtype) for k, v in batch.items()}
    shapes: list[dict[str, tuple[tuple[int, ...], torch.dtype]] | None] = [None] * ranks.world()[1]
    dist.all_gather_object(shapes, mine)
    first = next(s for s in shapes if s is not None)
    return {k: torch.empty((0, *shape), dtype=dtype, device=device)
            for k, (shape, dtype) in first.items()}
