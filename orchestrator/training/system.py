"""Per-node system metrics (CPU, memory, GPU), gathered to rank 0 at report steps."""

from __future__ import annotations

import socket
from typing import Any

import psutil
import torch
import torch.distributed as dist


def local_stats() -> dict[str, float]:
    """This process's node: CPU and memory use, and its own GPU's utilisation/memory. Only the
    rank's own device (CUDA's current device, which Ray Train sets to it): the node's workers share
    CUDA_VISIBLE_DEVICES, and reading another GPU's memory would open a CUDA context on it, in every
    rank (hundreds of MiB each)."""
    memory = psutil.virtual_memory()
    stats = {"cpu_percent": psutil.cpu_percent(interval=None),
             "memory_used_gb": memory.used / 1024**3, "memory_percent": memory.percent}
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        try:
            stats[f"gpu{index}_util_percent"] = float(torch.cuda.utilization(index))
        except Exception:  # NVML (nvidia-ml-py) missing: utilisation is unknown, memory still is
            pass
        free, total = torch.cuda.mem_get_info(index)
        stats[f"gpu{index}_memory_used_gb"] = (total - free) / 1024**3
    return stats


def node_stats(world: int) -> dict[str, float]:
    """`system/<node>/<metric>` for every node, one sample per node (all ranks take part in the
    gather): each rank adds its own GPU's figures; CPU and memory are the node's, the same from any
    of its ranks."""
    own = (socket.gethostname(), local_stats())
    if world > 1 and dist.is_initialized():
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, own)
    else:
        gathered = [own]
    by_node: dict[str, dict[str, float]] = {}
    for node, stats in gathered:
        by_node.setdefault(node, {}).update(stats)
    return {f"system/{node}/{key}": value for node, stats in by_node.items()
            for key, value in stats.items()}
