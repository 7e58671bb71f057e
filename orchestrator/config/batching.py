"""Batch arithmetic in one place: global batch = micro-batch x accumulation x world size.

The config checks it for every world size a run may have, and each worker derives its accumulation again at the
size its group really has (an elastic group keeps its micro-batch and global batch across resizes) and after it
measured an `auto` micro-batch. Pure Python: the config imports it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def split_batch(global_batch: int, world: int, micro: int | None = None, accum: int | None = None) -> tuple[int, int]:
    """(micro-batch, accumulation) with micro x accum x world == global_batch. Give the micro-batch, the
    accumulation, or neither (accumulation 1). Raises ValueError naming the keys when no such split exists."""
    per_worker, rest = divmod(global_batch, world)
    if rest:
        raise ValueError(f"train.global_batch_size={global_batch} is not divisible by scaling.num_workers={world}")
    if micro is None:
        accum = accum or 1
        if per_worker % accum:
            raise ValueError(f"train.global_batch_size={global_batch} is not divisible by grad_accum_steps={accum} "
                             f"x num_workers={world}")
        return per_worker // accum, accum
    derived, rest = divmod(per_worker, micro)
    if rest or derived == 0 or (accum is not None and accum != derived):
        raise ValueError(f"train.global_batch_size={global_batch} must equal micro_batch_size={micro} x "
                         f"grad_accum_steps={accum or 'N'} x num_workers={world}")
    return micro, derived


def common_micro_batch(global_batch: int, worlds: Iterable[int]) -> int:
    """The largest micro-batch that divides the per-worker batch at every world size (an elastic group's)."""
    return math.gcd(*(global_batch // world for world in worlds))
