"""Run a function in a real gloo group of `world` processes (torch.multiprocessing, no Ray) and collect each rank's
result: gloo.py's `run_two_ranks` for any world size (1, 2, 3 ... ranks)."""

from __future__ import annotations

import datetime
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessExitedException


def _rank_main(rank: int, fn: Callable[[int, Path], Any], out: str, world: int, backend: str) -> None:
    # This rank's stderr (C++ included) to a file the caller can show.
    os.dup2(os.open(f"{out}/rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # A short timeout: a collective mismatch that hangs instead of failing must not stall the suite.
    dist.init_process_group(backend, init_method=f"file://{out}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    result = fn(rank, Path(out))
    torch.save(result, f"{out}/rank{rank}.pt")
    # Leave together (through the store), then without the interpreter's shutdown: see gloo.py for the abort a
    # gloo thread alive past destroy_process_group causes while Python finalizes.
    store = dist.distributed_c10d._get_default_store()
    store.add("left", 1)
    while store.add("left", 0) < world:
        time.sleep(0.01)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[[int, Path], Any], tmp: Path, world: int, backend: str = "gloo") -> list[Any]:
    """`fn(rank, shared_dir)` on every rank of one gloo group of `world` processes; returns their results by rank.
    `backend="cuda:gloo"`: the group serves `cuda` tensors only, as NCCL does (gloo.py).
    A rank that dies fails the test with every rank's stderr (C++ aborts included)."""
    out = tmp / f"ranks{world}"
    out.mkdir(parents=True)
    try:
        mp.spawn(_rank_main, args=(fn, str(out), world, backend), nprocs=world, join=True)
    except ProcessExitedException as e:
        tails = {r: (out / f"rank{r}.err").read_text(errors="replace")[-2000:] for r in range(world)
                 if (out / f"rank{r}.err").exists()}
        raise AssertionError(f"{world}-rank gloo group: {e}; stderr: {tails}") from None
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
