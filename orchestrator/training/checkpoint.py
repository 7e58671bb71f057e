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

from orchestrator.training.parts import Parts
from orchestrator.training.ranks import gather_to_rank0, world

STATE_FILE = "state.pt"
# Written last, listing every other file and its size: a checkpoint without it, or whose files do not match it, is
# incomplete (a crash while writing or copying it) and is never loaded.
MANIFEST = "manifest.json"


@dataclass
class Progress:
    """Where training stands. `rows_in_epoch` counts this rank's rows already trained on in `epoch`, in the epoch
    order of `cache_decision` (pipelines.datasets: stream, memory or replay; None when unknown), which a resumed
    run keeps: under another decision the same count names other rows."""

    step: int = 0
    samples_seen: int = 0
    epoch: int = 0
    rows_in_epoch: int = 0
    nonfinite_skipped: int = 0  # steps skipped for a NaN/inf loss or gradient (budget: train.max_nonfinite_steps)
    cache_decision: str | None = None


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
    # The cache decision too: the driver reads it (manifest_cache_decision) before it builds the datasets.
    tmp.write_text(json.dumps({"format": 1, "step": state["progress"]["step"],
                               "cache_decision": state["progress"].get("cache_decision"), "files": files}))
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


def manifest_cache_decision(filesystem: Any, path: str) -> str | None:
    """The cache decision a checkpoint's data position counts rows under; None if it records none (written before
    it was saved) or the manifest is unreadable."""
    try:
        with filesystem.open_input_stream(f"{path}/{MANIFEST}") as f:
            decision = json.loads(f.read()).get("cache_decision")
    except (OSError, ValueError, AttributeError):
        return None
    return decision if isinstance(decision, str) else None


def load_state(directory: str | Path) -> dict[str, Any]:
    # weights_only=False: the state holds RNG tuples and numpy arrays, and the file is our own.
    return torch.load(Path(directory) / STATE_FILE, map_location="cpu", weights_only=False)


def checkpoint_state(parts: Parts, progress: Progress, micro_batch_size: int) -> dict[str, Any] | None:
    """Everything for an exact resume, on rank 0 (None on the others). A collective: every rank calls it, and
    gives what differs per rank (`rank_state`). `micro_batch_size` lets an auto-sized run resume with the
    micro-batch it ran with (the same rounding)."""
    ranks = gather_to_rank0(rank_state(parts))
    if not ranks:
        return None
    state = {
        "model": unwrap(parts.model).state_dict(),
        "scheduler": parts.scheduler.state_dict(),
        "progress": asdict(progress),
        "rng": [r["rng"] for r in ranks],  # one entry per rank
        "micro_batch_size": micro_batch_size,
    }
    if parts.local_sgd is None:  # DDP: one optimizer state, the same on every rank
        return state | {"optimizer": parts.optimizer.state_dict(), "precision": parts.precision.state_dict()}
    # Local SGD: each rank's optimizer moments (and fp16 loss scale) follow its own data; keep them all.
    return state | {"optimizer": [r["optimizer"] for r in ranks], "precision": [r["precision"] for r in ranks],
                    "local_sgd": parts.local_sgd.state_dict()}


def rank_state(parts: Parts) -> dict[str, Any]:
    """What this rank contributes to a checkpoint beyond the shared model: its RNG streams, and under local SGD its
    own optimizer and precision state (on the CPU, so any rank can load it)."""
    state: dict[str, Any] = {"rng": capture_rng()}
    if parts.local_sgd is not None:
        state |= {"optimizer": _to_cpu(parts.optimizer.state_dict()), "precision": parts.precision.state_dict()}
    return state


def _to_cpu(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_to_cpu(v) for v in tree)
    return tree


def restore(parts: Parts, state: dict[str, Any], cache_decision: str | None = None) -> Progress:
    """Load a checkpoint written by `checkpoint_state`. At the same world size every rank gets its RNG streams,
    optimizer state (its own under local SGD) and data position back (an exact resume); after a resize, or when the
    data is fed under another `cache_decision` than the checkpoint's (another epoch order), the run continues at
    the next epoch boundary."""
    rank, size = world()
    same_world = len(state["rng"]) == size
    unwrap(parts.model).load_state_dict(state["model"])
    optimizer, precision = state["optimizer"], state["precision"]
    if parts.local_sgd is not None:
        # After a resize there is no state of "this rank": every rank starts from rank 0's.
        optimizer, precision = optimizer[rank if same_world else 0], precision[rank if same_world else 0]
    parts.optimizer.load_state_dict(optimizer)
    parts.scheduler.load_state_dict(state["scheduler"])
    parts.precision.load_state_dict(precision)
    if parts.local_sgd is not None:
        parts.local_sgd.load_state_dict(state.get("local_sgd", {}), unwrap(parts.model))
    progress = Progress(**state["progress"])
    saved, progress.cache_decision = progress.cache_decision, cache_decision or progress.cache_decision
    # The driver keeps the checkpoint's decision on resume; another one here means it could not read it. A
    # checkpoint that records none (written before the decision was saved) keeps its position, as it always did.
    same_order = saved is None or cache_decision is None or saved == cache_decision
    if same_world:
        restore_rng(state["rng"][rank])
        if same_order:
            return progress
        if rank == 0 and progress.rows_in_epoch:
            print(f"the checkpoint's data position counts rows in the '{saved}' epoch order, but the data comes "
                  f"'{cache_decision}': finishing epoch {progress.epoch} early", flush=True)
    else:
        # Resized: Ray Data splits an epoch's rows into one stream per rank, so the old ranks' positions describe a
        # different split. New RNG streams, drawn per (step, rank).
        torch.manual_seed(int(np.random.default_rng([progress.step, rank]).integers(2**62)))
    # Skipping a position that describes another split or order would miss some rows and repeat others. Finish the
    # interrupted epoch early instead (none of its rows is seen twice) and start the next one.
    if progress.rows_in_epoch:
        progress.epoch, progress.rows_in_epoch = progress.epoch + 1, 0
    return progress
