"""What a checkpoint holds (everything for an exact resume) and how it is written and read."""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "state.pt"
# Written last, listing every other file and its size: a checkpoint without it, or whose files do not match it, is
# incomplete (a crash while writing or copying it) and is never loaded.
MANIFEST = "manifest.json"


@dataclass
class Progress:
    """Where training stands. `rows_in_epoch` counts this rank's rows already trained on in `epoch`."""

    step: int = 0
    samples_seen: int = 0
    epoch: int = 0
    rows_in_epoch: int = 0
    nonfinite_skipped: int = 0  # steps skipped for a NaN/inf loss or gradient (budget: train.max_nonfinite_steps)


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
    """Write state.pt, then the manifest, each via a temporary name and rename: a crash at any point leaves either
    a complete checkpoint or one that `check_complete` rejects."""
    path = Path(directory) / STATE_FILE
    tmp = path.with_name(f".{STATE_FILE}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    files = {p.name: p.stat().st_size for p in Path(directory).iterdir() if p.is_file() and p.name != MANIFEST
             and not p.name.startswith(".")}
    manifest = Path(directory) / MANIFEST
    tmp = manifest.with_name(f".{MANIFEST}.tmp")
    tmp.write_text(json.dumps({"format": 1, "step": state["progress"]["step"], "files": files}))
    os.replace(tmp, manifest)
    return path


def check_complete(filesystem: Any, path: str) -> str | None:
    """None if the checkpoint at `path` (on a pyarrow filesystem: local or S3) is complete, else why not."""
    import pyarrow.fs as pafs

    try:
        with filesystem.open_input_stream(f"{path}/{MANIFEST}") as f:
            manifest = json.loads(f.read())
        infos = filesystem.get_file_info([f"{path}/{name}" for name in manifest["files"]])
    except (OSError, ValueError, KeyError) as exc:
        return f"no readable {MANIFEST} ({type(exc).__name__})"
    for info, (name, size) in zip(infos, manifest["files"].items(), strict=True):
        if info.type != pafs.FileType.File:
            return f"{name} is missing"
        if info.size != size:
            return f"{name} has {info.size} of {size} bytes"
    return None


def manifest_step(filesystem: Any, path: str) -> int | None:
    try:
        with filesystem.open_input_stream(f"{path}/{MANIFEST}") as f:
            return int(json.loads(f.read())["step"])
    except (OSError, ValueError, KeyError):
        return None


def load_state(directory: str | Path) -> dict[str, Any]:
    # weights_only=False: the state holds RNG tuples and numpy arrays, and the file is our own.
    return torch.load(Path(directory) / STATE_FILE, map_location="cpu", weights_only=False)


def progress_dict(progress: Progress) -> dict[str, int]:
    return asdict(progress)
