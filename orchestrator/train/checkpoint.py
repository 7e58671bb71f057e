"""What a checkpoint holds (everything for an exact resume) and how it is written and read."""

from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "state.pt"


@dataclass
class Progress:
    """Where training stands. `batch_in_epoch` counts this rank's micro-batches already consumed in `epoch`."""

    step: int = 0
    samples_seen: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare module under DDP / torch.compile wrappers, so state_dict keys do not depend on the world size."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def capture_rng() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_state(directory: str | Path, state: dict[str, Any]) -> Path:
    """Write state.pt via a temporary name and rename, so a crash never leaves a half-written file."""
    path = Path(directory) / STATE_FILE
    tmp = path.with_name(f".{STATE_FILE}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def load_state(directory: str | Path) -> dict[str, Any]:
    # weights_only=False: the state holds RNG tuples and numpy arrays, and the file is our own.
    return torch.load(Path(directory) / STATE_FILE, map_location="cpu", weights_only=False)


def progress_dict(progress: Progress) -> dict[str, int]:
    return asdict(progress)
