"""What a checkpoint holds (everything for an exact resume) and how it is written and read.

Two layouts. DDP (and local SGD): rank 0 writes `state.pt` into a local directory that Ray Train
copies into run storage. FSDP (`train.parallel=fsdp`): no rank holds the whole model, so every rank
writes its own shards of the model and optimizer with torch.distributed.checkpoint (DCP) straight
into the checkpoint directory in run storage, and the state every rank shares (schedule, progress,
each rank's RNG streams) goes into the same DCP checkpoint. Both are committed by the manifest,
written last by rank 0: a checkpoint without it is never loaded.
"""

from __future__ import annotations

import io
import json
import os
import random
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from orchestrator.errors import ConfigError
from orchestrator.training import fsdp
from orchestrator.training.parts import Parts
from orchestrator.training.position import SEEN, Progress, data_position, holds, rest_of_epoch
from orchestrator.training.ranks import gather_to_rank0, world
from orchestrator.training.unpickle import load_state_file
from pipelines.rest import union_packed

if TYPE_CHECKING:
    # the run's storage; imported where used: a torch-only machine has no Arrow
    import pyarrow.fs as pafs
    import torch.distributed.checkpoint as dcp

STATE_FILE = "state.pt"
# Written last, listing every other file and its size: a checkpoint without it, or whose files do
# not match it, is incomplete (a crash while writing or copying it) and is never loaded.
MANIFEST = "manifest.json"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare module under DDP / torch.compile wrappers, so state_dict keys do not depend on the
    world size."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def capture_rng(device: torch.device | None = None) -> dict[str, Any]:
    """This process's RNG streams; of CUDA's, only the training `device`'s: a restarted rank may see
    other devices, or its device under another index, and a state per visible device would not map
    onto them."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Put `capture_rng`'s streams back; the CUDA one into the training `device`, whichever index it
    has now."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is None or device is None or device.type != "cuda":
        return
    # written before: one state per visible device, restored by index if it exists
    if isinstance(cuda, list):
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= len(cuda):
            return
        cuda = cuda[index]
    torch.cuda.set_rng_state(cuda, device)


def save_state(directory: str | Path, state: dict[str, Any]) -> Path:
    """Write state.pt, then the manifest, each via a temporary name and rename: a crash at any point
    leaves either a complete checkpoint or one that `check_complete` rejects."""
    path = Path(directory) / STATE_FILE
    tmp = path.with_name(f".{STATE_FILE}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    files = {p.name: p.stat().st_size for p in Path(directory).iterdir()
             if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")}
    manifest = Path(directory) / MANIFEST
    tmp = manifest.with_name(f".{MANIFEST}.tmp")
    # The cache decision too: the driver reads it (manifest_cache_decision) before it builds the
    # datasets.
    tmp.write_text(json.dumps({"format": 1, "step": state["progress"]["step"],
                               "cache_decision": state["progress"].get("cache_decision"),
                               "attempt": state["progress"].get("attempt"), "files": files}))
    os.replace(tmp, manifest)
    return path


def check_complete(filesystem: Any, path: str) -> str | None:
    """None if the checkpoint at `path` (on a pyarrow filesystem: local or S3) is complete, else why
    not."""
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


def manifest_attempt(filesystem: Any, path: str) -> str | None:
    """The claim of the attempt that wrote a checkpoint (training/fence.py); None if it records none
    (written before attempts were claimed, or by a Tune trial) or the manifest is unreadable."""
    return _manifest_text(filesystem, path, "attempt")


def manifest_cache_decision(filesystem: Any, path: str) -> str | None:
    """The cache decision a checkpoint's data position counts rows under; None if it records none
    (written before it was saved) or the manifest is unreadable."""
    return _manifest_text(filesystem, path, "cache_decision")


def _manifest_text(filesystem: Any, path: str, key: str) -> str | None:
    try:
        with filesystem.open_input_stream(f"{path}/{MANIFEST}") as f:
            value = json.loads(f.read()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def load_state(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / STATE_FILE
    return load_state_file(str(path), str(path))


def checkpoint_state(parts: Parts, progress: Progress,
                     micro_batch_size: int) -> dict[str, Any] | None:
    """Everything for an exact resume, on rank 0 (None on the others). A collective: every rank
    calls it, and gives what differs per rank (`rank_state`). `micro_batch_size` lets an auto-sized
    run resume with the micro-batch it ran with (the same rounding)."""
    ranks = gather_to_rank0(rank_state(parts, progress))
    if not ranks:
        return None
    state = {
        "model": unwrap(parts.model).state_dict(),
        "scheduler": parts.scheduler.state_dict(),
        "progress": progress.saved(),
        "rng": [r["rng"] for r in ranks],  # one entry per rank
        "micro_batch_size": micro_batch_size,
    }
    if (seen := union_packed([r["seen"] for r in ranks])) is not None:
        state[SEEN] = seen
    if parts.local_sgd is None:  # DDP: one optimizer state, the same on every rank
        return state | {"optimizer": parts.optimizer.state_dict(),
                        "precision": parts.precision.state_dict()}
    # Local SGD: each rank's optimizer moments (and fp16 loss scale) follow its own data; keep them
    # all.
    return state | {"optimizer": [r["optimizer"] for r in ranks],
                    "precision": [r["precision"] for r in ranks],
                    "local_sgd": parts.local_sgd.state_dict()}


def rank_state(parts: Parts, progress: Progress) -> dict[str, Any]:
    """What this rank contributes to a checkpoint beyond the shared model: its RNG streams, the ids
    of the rows it trained on in the epoch, and under local SGD its own optimizer and precision
    state (on the CPU, so any rank can load it)."""
    state: dict[str, Any] = {"rng": capture_rng(parts.device), "seen": progress.seen.packed()}
    if parts.local_sgd is not None:
        state |= {"optimizer": _to_cpu(parts.optimizer.state_dict()),
                  "precision": parts.precision.state_dict()}
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
    """Load a checkpoint written by `checkpoint_state`. At the same world size every rank gets its
    RNG streams, optimizer state (its own under local SGD) and data position back (an exact resume);
    after a resize, or when the data is fed under another `cache_decision` than the checkpoint's
    (another epoch order), the run continues at the next epoch boundary. A sharded checkpoint's
    state (`read_sharded_state`) goes to `restore_sharded`."""
    if SHARDS in state:
        return restore_sharded(parts, state, cache_decision)
    if fsdp.is_sharded(parts.model):
        raise ConfigError("config key 'train.parallel': the checkpoint holds a whole model "
                          "(written with train.parallel=ddp); resume with --set train.parallel=ddp")
    rank, size = world()
    same_world = len(state["rng"]) == size
    unwrap(parts.model).load_state_dict(state["model"])
    optimizer, precision = state["optimizer"], state["precision"]
    if parts.local_sgd is not None:
        # After a resize there is no state of "this rank": every rank starts from rank 0's.
        source_rank = rank if same_world else 0
        optimizer, precision = optimizer[source_rank], precision[source_rank]
    parts.optimizer.load_state_dict(optimizer)
    parts.scheduler.load_state_dict(state["scheduler"])
    parts.precision.load_state_dict(precision)
    if parts.local_sgd is not None:
        parts.local_sgd.load_state_dict(state.get("local_sgd", {}), unwrap(parts.model))
    return _position(state, cache_decision, parts.device)


def _position(state: dict[str, Any], cache_decision: str | None, device: torch.device) -> Progress:
    """The progress of a checkpoint's `state` for this rank (training on `device`): at the same
    world size its RNG streams and data position; after a resize, or under another cache decision,
    the next epoch boundary."""
    rank, size = world()
    progress = Progress(**state["progress"])
    saved, progress.cache_decision = (progress.cache_decision,
                                      cache_decision or progress.cache_decision)
    if len(state["rng"]) == size:
        restore_rng(state["rng"][rank], device)
    else:  # resized: new RNG streams, drawn per (step, rank)
        torch.manual_seed(int(np.random.default_rng([progress.step, rank]).integers(2**62)))
    seen = rest_of_epoch(state, cache_decision, size)
    if rank == 0 and progress.rows_in_epoch and not holds(state, cache_decision, size):
        done = (f"its {len(seen)} rows trained on are left out" if seen is not None
                else "finishing it early")
        print(f"the checkpoint's data position in epoch {progress.epoch} was counted by "
              f"{len(state['rng'])} worker(s) in the '{saved}' epoch order; {size} worker(s) "
              f"in the '{progress.cache_decision}' order finish the epoch: {done}", flush=True)
    progress.epoch, progress.rows_in_epoch = data_position(state, cache_decision, size)
    progress.rest = seen is not None
    if seen is not None:
        progress.seen.add(seen)
    return progress


# ---- sharded checkpoints (train.parallel=fsdp) ---------------------------------------------------


def storage_writer(filesystem: pafs.FileSystem, path: str) -> dcp.FileSystemWriter:
    """A DCP writer into `path` on a pyarrow filesystem (Ray Train's run storage: local or S3)."""
    import pyarrow.fs as pafs
    import torch.distributed.checkpoint as dcp

    if isinstance(filesystem, pafs.LocalFileSystem):
        return dcp.FileSystemWriter(path)
    writer = dcp.FileSystemWriter(path, sync_files=False)  # fsync means nothing to an object store
    writer.fs, writer.path = _arrow_fs(filesystem), path
    return writer


def storage_reader(filesystem: pafs.FileSystem, path: str) -> dcp.FileSystemReader:
    """A DCP reader of the checkpoint at `path` on a pyarrow filesystem; every rank reads only what
    its shards need."""
    import pyarrow.fs as pafs
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(path)
    if not isinstance(filesystem, pafs.LocalFileSystem):
        reader.fs, reader.path = _arrow_fs(filesystem), path
    return reader


def _arrow_fs(filesystem: pafs.FileSystem) -> Any:
    # DCP's fsspec adapter over fsspec's wrapper of the pyarrow filesystem: the same S3 client,
    # endpoint and credential chain as the rest of the run's storage, and no second S3 library.
    from fsspec.implementations.arrow import ArrowFSWrapper
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    adapter = FileSystem()
    adapter.fs = ArrowFSWrapper(filesystem)
    return adapter


def shared_state(parts: Parts, progress: Progress,
                 micro_batch_size: int | str | None) -> dict[str, Any]:
    """What a sharded checkpoint keeps beside the model and optimizer shards, the same on every rank
    (DCP keeps one copy): schedule, loss scale, progress and every rank's RNG streams. A
    collective."""
    mine = (capture_rng(parts.device), progress.seen.packed())
    ranks: list[Any] = [None] * world()[1]
    if world()[1] > 1:
        dist.all_gather_object(ranks, mine)
    else:
        ranks = [mine]
    state = {"scheduler": parts.scheduler.state_dict(), "precision": parts.precision.state_dict(),
             "progress": progress.saved(), "rng": [r[0] for r in ranks],
             "micro_batch_size": micro_batch_size}
    if (seen := union_packed([r[1] for r in ranks])) is not None:
        state[SEEN] = seen
    return state


@dataclass
class PendingCheckpoint:
    """A sharded checkpoint whose shards are being written (`written`: DCP's future, None once
    written). `commit` waits for them and, on rank 0, writes the manifest."""

    filesystem: pafs.FileSystem
    path: str
    step: int
    cache_decision: str | None
    written: Future | None
    attempt: str | None = None  # the claim of the attempt that writes it (training/fence.py)

    def wait(self) -> None:
        """Called from two threads (the loop's next save, Ray's upload thread): read the future
        once."""
        written = self.written
        if written is not None:
            written.result()

    def commit(self) -> None:
        """No collective (it may run in a background thread). On rank 0, DCP's own save ends with
        the coordinator writing `.metadata` after every rank reported its shards written, so once
        rank 0's write is done, all of the checkpoint is in storage and the manifest may name it."""
        self.wait()
        if world()[0] == 0:
            write_manifest(self.filesystem, self.path, self.step, self.cache_decision, self.attempt)


class ShardedSaver:
    """Saves sharded checkpoints one at a time. `asynchronous`: each rank copies its shards to CPU
    memory and returns; a background thread writes them (DCP's async save, on a group of its own so
    that its collectives do not interleave with training's)."""

    def __init__(self, asynchronous: bool) -> None:
        self.asynchronous = asynchronous
        self.group: dist.ProcessGroup | None = None
        self.last: PendingCheckpoint | None = None

    def save(self, filesystem: pafs.FileSystem, path: str, parts: Parts, progress: Progress,
             micro_batch_size: int | str | None) -> PendingCheckpoint:
        """Start writing the checkpoint of `parts` at `progress` into `path` (the same on every
        rank). A collective. Call `commit()` on the result (on every rank) before registering it."""
        self.close()  # one save at a time: DCP's collectives of two saves must not interleave
        extra = shared_state(parts, progress, micro_batch_size)
        writer = storage_writer(filesystem, path)
        written: Future | None = None
        if self.asynchronous:
            if self.group is None:
                self.group = fsdp.checkpoint_group()  # a collective: first checkpoint, every rank
            written = fsdp.async_save_sharded(path, parts.model, parts.optimizer, extra,
                                              group=self.group, storage=writer)
        else:
            fsdp.save_sharded(path, parts.model, parts.optimizer, extra, storage=writer)
        self.last = PendingCheckpoint(filesystem, path, progress.step, progress.cache_decision,
                                      written, progress.attempt)
        return self.last

    def close(self) -> None:
        """Wait for the last save's shards (before the next save, and before the process ends)."""
        if self.last is not None:
            self.last.wait()


def write_manifest(filesystem: pafs.FileSystem, path: str, step: int, cache_decision: str | None,
                   attempt: str | None = None) -> None:
    """The manifest of the checkpoint directory `path` in storage: every file in it (DCP's
    `.metadata` included) with its size. Written under a temporary name and moved, so it appears
    whole or not at all."""
    import pyarrow.fs as pafs

    infos = filesystem.get_file_info(pafs.FileSelector(path))
    files = {i.base_name: i.size for i in infos
             if i.type == pafs.FileType.File and i.base_name != MANIFEST
             and not i.base_name.endswith(".tmp")}
    tmp = f"{path}/.{MANIFEST}.tmp"
    with filesystem.open_output_stream(tmp) as f:
        f.write(json.dumps({"format": 2, "step": step, "cache_decision": cache_decision,
                            "sharded": True, "attempt": attempt, "files": files}).encode())
    filesystem.move(tmp, f"{path}/{MANIFEST}")


def is_sharded_checkpoint(filesystem: pafs.FileSystem, path: str) -> bool:
    """Whether the checkpoint at `path` was written by FSDP's ranks (DCP) rather than as DDP's
    state.pt."""
    import pyarrow.fs as pafs

    return filesystem.get_file_info(f"{path}/.metadata").type == pafs.FileType.File


SHARDS = "shards"  # the key of a sharded checkpoint's location in what read_sharded_state returns


def read_sharded_state(filesystem: pafs.FileSystem, path: str) -> dict[str, Any]:
    """The shared state of the sharded checkpoint at `path` (what `checkpoint_state` gives for DDP,
    less model and optimizer), read by one rank without any collective (its micro-batch and world
    size are known before the model is restored), with the checkpoint's location under SHARDS for
    `restore` to load the shards from."""
    where = fsdp.stored_in(storage_reader(filesystem, path).read_metadata(), fsdp.EXTRA_KEY)
    with filesystem.open_input_file(f"{path}/{where.relative_path}") as f:
        f.seek(where.offset)
        blob = f.read(where.length)
    # As DCP's loader reads it (torch.load of the stored bytes gives the buffer fsdp._to_save
    # wrote), then the state.
    name = f"{path}/{where.relative_path}"
    buffer = load_state_file(io.BytesIO(blob), name)
    buffer.seek(0)
    return load_state_file(buffer, name) | {SHARDS: (filesystem, path)}


def restore_sharded(parts: Parts, state: dict[str, Any],
                    cache_decision: str | None = None) -> Progress:
    """Load what `read_sharded_state` gave: the shards into the freshly sharded model and optimizer
    of `parts` at any world size (the saved shards are cut again for this one), then the shared
    state; as `restore`, RNG streams and the data position come back at the same world size, the
    next epoch boundary after a resize. A collective."""
    if not fsdp.is_sharded(parts.model):
        raise ConfigError("config key 'train.parallel': the checkpoint holds FSDP shards (written "
                          "with train.parallel=fsdp); resume with --set train.parallel=fsdp")
    filesystem, path = state[SHARDS]
    fsdp.load_sharded(path, parts.model, parts.optimizer, storage=storage_reader(filesystem, path))
    schedule, precision = state["scheduler"], state["precision"]
    parts.scheduler.load_state_dict(schedule)
    parts.precision.load_state_dict(precision)
    return _position(state, cache_decision, parts.device)
