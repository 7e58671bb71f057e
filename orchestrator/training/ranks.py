"""The collectives the worker side uses to keep its ranks in step. Each is a plain value in a single
process (no process group), so the loop runs unchanged in-process and under DDP. The tensor
collectives take the training device explicitly: on GPUs the group is NCCL, which serves `cuda`
tensors only, so a value left on the CPU fails there. The object collectives (gather_*) use the
current CUDA device, which Ray Train sets for each worker."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world size) of this process's group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sums across ranks, in float64."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if world()[1] > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """Element-wise maxima across ranks, in float64: e.g. the slowest rank's step time, the same on
    every rank."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if world()[1] > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def meet(device: torch.device) -> None:
    """Every rank waits here for the others (a one-element all-reduce on `device`, which a group
    serving `cuda` tensors only accepts where a CPU barrier would not)."""
    if world()[1] > 1:
        dist.all_reduce(torch.zeros(1, device=device))


def any_rank(flag: bool | torch.Tensor, device: torch.device) -> bool:
    """True on every rank if `flag` is true on any rank (a MAX all-reduce on `device`)."""
    if world()[1] == 1:
        return bool(flag)
    tensor = torch.as_tensor(flag, dtype=torch.float32, device=device).reshape(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def on_any_rank(flag: torch.Tensor) -> torch.Tensor:
    """1.0 on every rank if `flag` (a float 0/1 on the training device) is 1 on any rank, left on
    the device: a MAX all-reduce, never read back (the step decides with it on the device)."""
    flag = flag.to(torch.float32).reshape(())
    if world()[1] > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def rank0_says(flag: bool, device: torch.device) -> bool:
    """Rank 0's value on every rank: a decision from a local clock must be the same everywhere, or
    the ranks' collective calls (checkpoint gather, report) would no longer line up."""
    if world()[1] == 1:
        return flag
    tensor = torch.tensor([float(flag)], device=device)
    dist.broadcast(tensor, src=0)
    return bool(tensor.item())


def gather_to_rank0(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on rank 0 (an empty list on the others)."""
    rank, size = world()
    if size == 1:
        return [obj]
    gathered: list[Any] | None = [None] * size if rank == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered or []


def gather_keys(keys: list[str]) -> set[str]:
    """The union of every rank's `keys` on every rank (a rank that saw no rows has none of its
    own)."""
    if world()[1] == 1:
        return set(keys)
    everyone: list[list[str] | None] = [None] * world()[1]
    dist.all_gather_object(everyone, keys)
    return {key for ranks_keys in everyone for key in ranks_keys or []}


def rank0_int(value: int, device: torch.device) -> int:
    """Rank 0's integer on every rank (a decision code: see rank0_says)."""
    if world()[1] == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


def rank0_object(obj: Any) -> Any:
    """Rank 0's `obj` (a plain picklable value) on every rank."""
    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
