"""The driver's memory estimate (orchestrator.memory_plan) against the worker's own DDP figure and plain arithmetic.
The FSDP figures are checked against bytes measured on real ranks in tests/unit/training/test_fsdp.py."""

from __future__ import annotations

import pytest
import torch

from orchestrator.errors import ConfigError
from orchestrator.memory_plan import estimate_bytes_per_rank
from orchestrator.training.memory import state_bytes


def test_ddp_estimate_is_the_workers_state_bytes() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(30, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    n = sum(p.numel() for p in model.parameters())
    for optimizer, slots in (("adamw", 2), ("sgd", 1)):
        for world in (1, 4):  # DDP replicates: the world size changes nothing per rank
            e = estimate_bytes_per_rank(n, world, "ddp", optimizer, "bf16")
            assert e["total"] == e["params"] + e["grads"] + e["optimizer"] == state_bytes(model, slots)
            assert e["gathered"] == 0


def test_fsdp_shards_everything_but_deferred_gradients_and_gathers_a_block() -> None:
    n, world = 1_000_003, 4
    ddp = estimate_bytes_per_rank(n, world, "ddp", "adamw", "bf16")
    fsdp = estimate_bytes_per_rank(n, world, "fsdp", "adamw", "bf16", block_params=50_000)
    for key in ("params", "grads", "optimizer"):
        assert fsdp[key] == -(-n // world) * ddp[key] // n  # 1/world, rounded up to whole parameters
    assert fsdp["gathered"] == 2 * 50_000 * 2  # two bf16 blocks in flight
    deferred = estimate_bytes_per_rank(n, world, "fsdp", "adamw", "bf16", defer_sync=True)
    assert deferred["grads"] == ddp["grads"] and deferred["params"] == fsdp["params"]
    assert estimate_bytes_per_rank(n, 1, "fsdp", "adamw", "fp32", block_params=50_000)["gathered"] == 0


@pytest.mark.parametrize(("args", "key"), [((10, 2, "zero", "adamw", "fp32"), "train.parallel"),
                                           ((10, 2, "fsdp", "lion", "fp32"), "optim.name"),
                                           ((10, 2, "fsdp", "adamw", "auto"), "train.precision")])
def test_unknown_values_name_their_key(args: tuple, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        estimate_bytes_per_rank(*args)
