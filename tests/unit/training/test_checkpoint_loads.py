"""No code from storage: a checkpoint is read with torch's weights-only unpickler (tensors, numbers, strings,
containers, and the few types the product's own state holds: numpy's RNG array, a byte buffer), so whoever can write
the run's storage (often a shared bucket) cannot run code in the workers that resume from it. A planted `__reduce__`
payload, in a DDP checkpoint's state.pt or in a sharded checkpoint's training state, is refused naming the file,
without running; the product's own state still round-trips."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch
from gloo_world import run_ranks

from orchestrator.config import load_config
from orchestrator.errors import UserError
from orchestrator.models.zoo import build_model
from orchestrator.training import fsdp
from orchestrator.training.checkpoint import capture_rng, load_state, read_sharded_state, save_state
from orchestrator.training.optim import build_optimizer


class Planted:
    """What an attacker with write access to the bucket would put in a checkpoint: unpickling it runs a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.marker}",)


def own_state() -> dict[str, Any]:
    """What the product saves: weights, AdamW's state, the LR schedule, the RNG streams (numpy's as an array), the
    progress."""
    model = build_model("mlp", None, 4, 3, {"hidden": [8]})
    optimizer, scheduler = build_optimizer(model, load_config(None, []).optim, 10)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "rng": capture_rng(), "progress": {"step": 1, "epoch": 0, "cache_decision": "memory", "rows": [1, 2]},
            "extra": {"built": AsDict(), "names": {"a", "b"}, "frozen": frozenset({1})}}


class AsDict:
    """A model's extra state as some pickle it: Python's own `dict` called by name (a container, no code)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, ((("k", 1),),)


def test_a_ddp_checkpoint_with_a_planted_payload_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    good = tmp_path / "good"
    good.mkdir()
    saved = own_state()
    save_state(good, saved)
    loaded = load_state(good)
    assert loaded["progress"] == saved["progress"] and loaded["rng"]["python"] == saved["rng"]["python"]
    assert (loaded["rng"]["numpy"][1] == saved["rng"]["numpy"][1]).all()
    assert loaded["extra"] == {"built": {"k": 1}, "names": {"a", "b"}, "frozen": frozenset({1})}
    bad = tmp_path / "bad"
    bad.mkdir()
    save_state(bad, {**saved, "progress": {**saved["progress"], "note": Planted(marker)}})
    with pytest.raises(UserError) as refused:
        load_state(bad)
    message = str(refused.value)
    assert message.startswith(f"checkpoint file {bad / 'state.pt'} refused: it holds posix.system"), message
    assert "\n" not in message and not marker.exists()


def _sharded(rank: int, shared: Path, path: str, plant: Path | None = None) -> None:
    # The payload made here: handed to the rank's process, it would run as that process unpickles its arguments.
    extra = {"progress": {"step": 3}, "rng": capture_rng(), **({"x": Planted(plant)} if plant else {})}
    model = fsdp.shard_model(build_model("mlp", None, 4, 3, {"hidden": [8]}),
                             mesh=fsdp.mesh_of_all_ranks(torch.device("cpu")), blocks=["Linear"])
    optimizer, _ = build_optimizer(model, load_config(None, []).optim, 10)
    fsdp.save_sharded(path, model, optimizer, extra=extra)


def _load_sharded(rank: int, shared: Path, path: str) -> str:
    model = fsdp.shard_model(build_model("mlp", None, 4, 3, {"hidden": [8]}),
                             mesh=fsdp.mesh_of_all_ranks(torch.device("cpu")), blocks=["Linear"])
    optimizer, _ = build_optimizer(model, load_config(None, []).optim, 10)
    try:
        fsdp.load_sharded(path, model, optimizer)
    except UserError as exc:
        return str(exc)
    return "loaded"


def test_a_sharded_checkpoint_with_a_planted_payload_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    run_ranks(functools.partial(_sharded, path=good), tmp_path / "save-good", 1)
    run_ranks(functools.partial(_sharded, path=bad, plant=marker), tmp_path / "save-bad", 1)
    local = pafs.LocalFileSystem()
    assert read_sharded_state(local, good)["progress"] == {"step": 3}
    with pytest.raises(UserError, match=rf"^checkpoint file {bad}/\S+ refused: it holds posix.system"):
        read_sharded_state(local, bad)  # the driver-side read of the shared state
    (answer,) = run_ranks(functools.partial(_load_sharded, path=bad), tmp_path / "load-bad", 1)
    assert answer.startswith(f"checkpoint file {bad}/") and "refused: it holds posix.system" in answer, answer
    assert not marker.exists()
