"""Which checkpoint a (re)started worker group loads, and how rank 0 hands a new one to Ray Train.

Ray Train registers a checkpoint only after its copy into storage returned, and resumes from the
latest registered one, so a worker killed while writing or copying a checkpoint leaves it
unregistered. On top of that every checkpoint carries a manifest written last (`checkpoint.py`); a
registered checkpoint whose files do not match it (storage damaged or pruned behind Ray's back) is
passed over for the newest complete one before it.
"""

from __future__ import annotations

import re
import uuid
import warnings
from typing import Any

import pyarrow.fs as pafs
import ray.train

from orchestrator.training.checkpoint import (
    MANIFEST,
    check_complete,
    is_sharded_checkpoint,
    load_state,
    manifest_attempt,
    manifest_cache_decision,
    manifest_step,
    read_sharded_state,
)
from orchestrator.training.fence import Claim, claims_in

_NAME = re.compile(r"^checkpoint_(\d+)_")
_OURS = re.compile(r"^checkpoint_\d{8}_[0-9a-f]{6}$")  # exactly what checkpoint_dir_name makes


def checkpoint_dir_name(step: int) -> str:
    """'checkpoint_00000120_3fa2c1': sorts by step; unique, so a step redone after a fallback never
    reuses (and Ray's retention never deletes) the directory of another checkpoint."""
    return f"checkpoint_{step:08d}_{uuid.uuid4().hex[:6]}"


def _step(filesystem: Any, path: str) -> int | None:
    match = _NAME.match(path.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else manifest_step(filesystem, path)


def unregistered_checkpoints(filesystem: Any, run_path: str, registered: list[str]) -> list[str]:
    """Checkpoint directories of a finished run that Ray Train never registered (a worker died while
    writing or copying them) and so never deletes: what is left beside the `registered` ones."""
    kept = {p.rstrip("/") for p in registered}
    infos = filesystem.get_file_info(pafs.FileSelector(run_path.rstrip("/"), allow_not_found=True))
    return sorted(i.path for i in infos
                  if i.type == pafs.FileType.Directory and _OURS.match(i.base_name)
                  and i.path.rstrip("/") not in kept)


def checkpointed_cache_decision(filesystem: Any, run_path: str,
                                registered_step: int | None = None) -> str | None:
    """The cache decision of the checkpoint a resumed run at `run_path` loads (read by the driver
    before it builds the datasets): the newest complete one at or before `registered_step` (the
    newest checkpoint Ray Train registered, `RunPlace.registered_step`), as `loadable_checkpoint`
    falls back from a damaged registered one to an older complete one and never to a newer one Ray
    did not register; the newest complete one when no step is known. None for a run without one, or
    whose checkpoint records none (then the current decision applies)."""
    try:
        infos = filesystem.get_file_info(pafs.FileSelector(run_path.rstrip("/"),
                                                           allow_not_found=True))
    except OSError:
        # the workers then check the decision against the checkpoint they load (`restore`)
        return None
    ours = [i.path for i in infos if i.type == pafs.FileType.Directory and _OURS.match(i.base_name)]
    if registered_step is not None:
        ours = [p for p in ours if (_step(filesystem, p) or 0) <= registered_step]
    # names sort by step
    for path in sorted(ours, key=lambda p: p.rsplit("/", 1)[-1], reverse=True):
        if unloadable(filesystem, path) is None:
            return manifest_cache_decision(filesystem, path)
    return None


def loadable_checkpoint(checkpoint: ray.train.Checkpoint | None) -> ray.train.Checkpoint | None:
    """`checkpoint` if complete and its attempt's own, else the newest such checkpoint of the same
    run that is older; None if none."""
    if checkpoint is None:
        return None
    fs, path = checkpoint.filesystem, checkpoint.path.rstrip("/")
    reason = unloadable(fs, path)
    if reason is None:
        return checkpoint
    limit = _step(fs, path)
    parent = path.rsplit("/", 1)[0]
    candidates = []
    for info in fs.get_file_info(pafs.FileSelector(parent, allow_not_found=True)):
        sibling = info.type == pafs.FileType.Directory and info.path != path
        step = _step(fs, info.path) if sibling else None
        if step is not None and (limit is None or step < limit):
            candidates.append((step, info.path))
    for step, candidate in sorted(candidates, reverse=True):
        if unloadable(fs, candidate) is None:
            warnings.warn(f"checkpoint {path} {reason}; resuming from step {step} ({candidate})",
                          stacklevel=2)
            return ray.train.Checkpoint(candidate, filesystem=fs)
    warnings.warn(f"checkpoint {path} {reason} and no loadable "
                  "one precedes it: starting over", stacklevel=2)
    return None


def unloadable(filesystem: Any, path: str) -> str | None:
    """Why the checkpoint at `path` is never loaded, None if it may be: incomplete (a crash while
    writing or copying it), or committed by an attempt of the run after a newer attempt had claimed
    the run (training/fence.py: a driver that lived on beside its successor). Times are the
    storage's own: the manifest's (written last) and the claims' modification times."""
    reason = check_complete(filesystem, path)
    if reason is not None:
        return f"is incomplete ({reason})"
    writer = Claim.parse(manifest_attempt(filesystem, path) or "")
    committed = filesystem.get_file_info(f"{path}/{MANIFEST}").mtime
    if writer is None or committed is None:
        return None
    newer = [c for c in claims_in(filesystem, path.rsplit("/", 1)[0])
             if c > writer and c.at < committed.timestamp()]
    return (f"was committed by attempt {writer.number} after "
            f"attempt {newer[0].number} of the run had claimed it"
            if newer else None)


def read_checkpoint(checkpoint: ray.train.Checkpoint) -> dict[str, Any]:
    """What `restore` (checkpoint.py) takes. A DDP checkpoint is copied to this node and its
    state.pt read; of a sharded one (train.parallel=fsdp) only the shared state is read here: each
    rank reads its own shards from storage when the state is restored, at whatever world size."""
    if is_sharded_checkpoint(checkpoint.filesystem, checkpoint.path):
        return read_sharded_state(checkpoint.filesystem, checkpoint.path)
    with checkpoint.as_directory() as directory:
        return load_state(directory)
