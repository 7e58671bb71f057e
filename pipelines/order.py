"""Which shard order an epoch reads: a permutation drawn from (seed, epoch), and the small actor
that tells the Ray Data read planner which epoch the workers are on.

Ray Train fixes the datasets when the TorchTrainer is built and re-executes them each epoch, so the
epoch cannot be baked into the dataset. Instead each worker writes its epoch to a named `EpochClock`
before it starts iterating; Ray Data asks the datasource for read tasks once per execution, when
`streaming_split` starts the epoch, which is after every rank has arrived (its epoch barrier). So
every execution reads exactly one epoch's permutation, and a restarted run gets the permutation of
the epoch in its checkpoint, not of a hidden execution counter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


@dataclass(frozen=True)
class ShardOrder:
    """Which shard order each execution of a dataset reads: permuted by (`seed`, epoch) when
    `shuffle`, the epoch read from the `epoch_clock` actor (None: epoch 0's order every time); the
    shards' own order otherwise."""

    seed: int = 0
    shuffle: bool = False
    epoch_clock: str | None = None


def shard_order(items: list[T], seed: int, epoch: int, shuffle: bool = True) -> list[T]:
    """`items` permuted by (seed, epoch); unchanged when `shuffle` is false. Same inputs, same
    order."""
    if not shuffle:
        return list(items)
    permutation = np.random.default_rng([seed, epoch]).permutation(len(items))
    return [items[i] for i in permutation]


def local_shuffle_seed(seed: int, epoch: int, rank: int) -> int:
    """Seed of one rank's local shuffle buffer in one epoch (so a re-streamed epoch shuffles
    identically)."""
    return int(np.random.default_rng([seed, epoch, rank, 7]).integers(2**31 - 1))


class _Clock:
    def __init__(self) -> None:
        self.epoch = 0

    def set(self, epoch: int) -> None:
        self.epoch = epoch

    def get(self) -> int:
        return self.epoch


_handles: dict[str, Any] = {}


def create_epoch_clock(name: str) -> Any:
    """Start the named clock actor (call on the driver; keep the returned handle alive for the
    run)."""
    import ray

    handle = ray.remote(num_cpus=0)(_Clock).options(name=name, get_if_exists=True).remote()
    _handles[name] = handle
    return handle


def release_epoch_clock(name: str, wait_s: float = 10.0) -> None:
    """Stop the named clock once its run is over, and wait (at most `wait_s`) until it is gone. Its
    owner's end stops it too, but a Tune trial's actor outlives the trial (reuse_actors): without
    this every trial's clock, one Ray worker process each, would stay alive until the study ends."""
    import time

    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    handle = _handles.pop(name, None)
    if handle is None:
        return
    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:  # ray.kill returns before the actor (and its name) is gone
        try:
            ray.get(handle.get.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except (RayActorError, GetTimeoutError):
            return
        time.sleep(0.05)


def _clock(name: str) -> Any:
    import ray

    if name not in _handles:
        _handles[name] = ray.get_actor(name)
    return _handles[name]


def set_epoch(name: str, epoch: int) -> None:
    """Called by every rank before it iterates `epoch` (all ranks write the same value)."""
    import ray

    ray.get(_clock(name).set.remote(epoch))


def current_epoch(name: str | None) -> int:
    import ray

    return 0 if name is None else int(ray.get(_clock(name).get.remote()))
