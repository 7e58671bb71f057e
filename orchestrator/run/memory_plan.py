"""Driver-side estimate of what each rank holds for a model's training state, before any worker
starts: how DDP's replicas compare with FSDP's shards. Pure arithmetic (no torch), so the driver can
call it at config time."""

from __future__ import annotations

import math
from typing import Literal

from orchestrator.errors import ConfigError

Parallel = Literal["ddp", "fsdp", "local_sgd"]
# fp32 slots per parameter the optimizer keeps: AdamW's two moments; SGD's momentum buffer (the
# product's sgd has momentum 0.9 unless optim.momentum=0, which is "sgd_plain" here). The per-tensor
# step counters are left out.
OPTIMIZER_SLOTS = {"adamw": 2, "adam": 2, "sgd": 1, "sgd_plain": 0}
_COMPUTE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MASTER_BYTES = 4  # parameters, gradients and optimizer slots stay fp32 under every precision mode


def estimate_bytes_per_rank(n_params: int, world: int, parallel: Parallel, optimizer: str,
                            precision: str, *, block_params: int = 0,
                            defer_sync: bool = False) -> dict[str, int]:
    """Bytes one rank holds for `n_params` trainable parameters at `world` ranks, without
    activations.

    - `params`, `grads`, `optimizer`: fp32 master copies. DDP and local SGD hold all of them on
    every rank; FSDP
      1/world of each (rounded up; FSDP pads each parameter to world equal row blocks, at most one
      row more per parameter on a rank). With `defer_sync` (FSDP accumulating unsharded gradients
      over micro-batches, see training.fsdp.gradient_sync) the gradients are whole-model sized until
      the step's reduce-scatter.
    - `gathered` (FSDP only): the transient unsharded parameters of the largest block
    (`block_params`) in the compute
      dtype, twice: the block computing and the next one prefetched.
    - `total`: their sum.
    """
    if parallel not in ("ddp", "fsdp", "local_sgd"):
        raise ConfigError(f"config key 'train.parallel': {parallel!r} "
                          "is not one of ddp, fsdp, local_sgd")
    if optimizer not in OPTIMIZER_SLOTS:
        raise ConfigError(f"config key 'optim.name': no memory figure for {optimizer!r}; known: "
                          f"{sorted(OPTIMIZER_SLOTS)}")
    if precision not in _COMPUTE_BYTES:
        raise ConfigError(f"config key 'train.precision': {precision!r} is "
                          "not one of bf16, fp16, fp32 (resolve auto first)")
    if world < 1 or n_params < 0:
        raise ValueError(f"world={world} and n_params={n_params}: "
                         "need world >= 1 and n_params >= 0")
    sharded = parallel == "fsdp"
    held = math.ceil(n_params / world) if sharded else n_params
    figures = {
        "params": held * MASTER_BYTES,
        "grads": (n_params if defer_sync and sharded else held) * MASTER_BYTES,
        "optimizer": held * MASTER_BYTES * OPTIMIZER_SLOTS[optimizer],
        "gathered": 2 * block_params * _COMPUTE_BYTES[precision] if sharded and world > 1 else 0,
    }
    return figures | {"total": sum(figures.values())}


GIB = 2**30


def fsdp_advice(n_params: int, block_params: int, world: int, optimizer: str, precision: str,
                budget: tuple[float, str], *, defer_sync: bool = False) -> str | None:
    """One line saying that DDP's model state (parameters, gradients, optimizer state) would not fit
    a worker's `budget` (bytes, and where that figure comes from) while FSDP's shards over `world`
    workers would, naming the setting; None otherwise (DDP fits, or FSDP would not fit either, or
    one worker has nothing to shard over)."""
    limit, basis = budget
    ddp = estimate_bytes_per_rank(n_params, world, "ddp", optimizer, precision)["total"]
    fsdp = estimate_bytes_per_rank(n_params, world, "fsdp", optimizer, precision,
                                   block_params=block_params, defer_sync=defer_sync)["total"]
    if world < 2 or ddp <= limit or fsdp > limit:
        return None
    return (f"memory: with train.parallel=ddp each worker holds {ddp / GIB:.1f} GiB of "
            f"model state ({n_params:,} parameters, their gradients and {optimizer} "
            f"state), more than its {limit / GIB:.1f} GiB ({basis}); sharded over "
            f"{world} workers it holds {fsdp / GIB:.1f} GiB: --set train.parallel=fsdp")
