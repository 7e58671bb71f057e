"""Run a function in a real two-process gloo group (torch.multiprocessing, no Ray) and collect each rank's result."""

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


def _rank_main(rank: int, fn: Callable[[int, Path], Any], out: str, backend: str) -> None:
    # This rank's stderr (C++ included: an abort's "terminate called ..." line) to a file the caller can show.
    os.dup2(os.open(f"{out}/rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # A short timeout: a collective mismatch that hangs instead of failing must not stall the suite.
    dist.init_process_group(backend, init_method=f"file://{out}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    result = fn(rank, Path(out))
    torch.save(result, f"{out}/rank{rank}.pt")
    # Leave together: neither rank closes its sockets while the other may still read them. Through the store, as a
    # `cuda:gloo` group has no CPU barrier.
    store = dist.distributed_c10d._get_default_store()
    store.add("left", 1)
    while store.add("left", 0) < 2:
        time.sleep(0.01)
    dist.destroy_process_group()
    # Leave without the interpreter's shutdown: a DDP model keeps the group's gloo threads alive past destroy, and
    # one of them releasing a finished collective while Python finalizes aborts the process ("terminate called
    # without an active exception", SIGABRT; a race inside torch, 3 exits in 15 when reproduced).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_two_ranks(fn: Callable[[int, Path], Any], tmp: Path, backend: str = "gloo") -> list[Any]:
    """`fn(rank, shared_dir)` on ranks 0 and 1 of one gloo group; returns [result of rank 0, result of rank 1].
    `backend="cuda:gloo"` gives the group NCCL's device map: it serves `cuda` tensors only, so a collective on a CPU
    tensor fails as it would on GPUs.
    A rank that dies fails the test with both ranks' stderr (C++ aborts included)."""
    out = tmp / "ranks"
    out.mkdir(parents=True)
    try:
        mp.spawn(_rank_main, args=(fn, str(out), backend), nprocs=2, join=True)
    except ProcessExitedException as e:
        tails = {r: (out / f"rank{r}.err").read_text(errors="replace")[-2000:] for r in (0, 1)
                 if (out / f"rank{r}.err").exists()}
        raise AssertionError(f"two-rank gloo group: {e}; stderr: {tails}") from None
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
