"""Batch arithmetic in one place: global batch = micro-batch x accumulation x world size.

The config checks it for every world size a run may have, and each worker derives its
accumulation again at the size its group really has (an elastic group keeps its micro-batch and
global batch across resizes) and after it measured an `auto` micro-batch. Pure Python: the config
imports it."""

from __future__ import annotations

import math
from collections.abc import Iterable


def split_batch(global_batch: int, world: int, micro: int | None = None,
                accum: int | None = None) -> tuple[int, int]:
    """(micro-batch, accumulation) with micro x accum x world == global_batch. Give the
    micro-batch, the accumulation, or neither (accumulation 1). Raises ValueError naming the keys
    when no such split exists."""
    per_worker, rest = divmod(global_batch, world)
    if rest:
        raise ValueError(f"train.global_batch_size={global_batch} is not divisible by "
                         f"scaling.num_workers={world}")
    if micro is None:
        accum = accum or 1
        if per_worker % accum:
            raise ValueError(f"train.global_batch_size={global_batch} is not divisible by "
                             f"grad_accum_steps={accum} x num_workers={world}")
        return per_worker // accum, accum
    derived, rest = divmod(per_worker, micro)
    if rest or derived == 0:
        fits = ", ".join(str(n) for n in range(1, per_worker + 1) if per_worker % n == 0)
        raise ValueError(f"train.global_batch_size={global_batch} must equal "
                         f"micro_batch_size={micro} x grad_accum_steps={accum or 'N'} x "
                         f"num_workers={world}: micro_batch_size={micro} does not divide the "
                         f"{per_worker} rows each of the {world} workers takes a step: pick one "
                         f"that does ({fits})")
    if accum is not None and accum != derived:
        raise ValueError(f"train.global_batch_size={global_batch} must equal "
                         f"micro_batch_size={micro} x grad_accum_steps={accum} x "
                         f"num_workers={world}: set train.grad_accum_steps={derived}, or null to "
                         "derive it")
    return micro, derived


def common_micro_batch(global_batch: int, worlds: Iterable[int]) -> int:
    """The largest micro-batch that divides the per-worker batch at every world size (an elastic
    group's)."""
    return math.gcd(*(global_batch // world for world in worlds))


def replica_micro_batches(global_batch: int, micro: int, participants: int) -> int:
    """failure.mode=replicas: the micro-batches each of `participants` live replicas runs in one
    step so that the step still covers `global_batch` samples (the survivors take a lost
    replica's share). Raises ValueError naming the keys when the share is not a whole number of
    micro-batches."""
    share, rest = divmod(global_batch, participants)
    if rest or share % micro:
        raise ValueError(f"train.global_batch_size={global_batch} over {participants} live "
                         f"replica(s) is not a multiple of micro_batch_size={micro}: with "
                         "failure.mode=replicas every count of live replicas from 1 to "
                         "scaling.num_workers must divide the global batch into whole "
                         "micro-batches; pick a global batch divisible by micro_batch_size x each "
                         "count")
    return share // micro
