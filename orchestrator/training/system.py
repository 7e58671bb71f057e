"""Per-node system metrics (CPU, memory, GPU), gathered to rank 0 at report steps."""

from __future__ import annotations

import socket
from typing import Any

import psutil
import torch
import torch.distributed as dist


def local_stats() -> dict[str, float]:
    """This process's node: CPU and memory use, and per-GPU utilisation/memory where NVML is available."""
    memory = psutil.virtual_memory()
    stats = {"cpu_percent": psutil.cpu_percent(interval=None), "memory_used_gb": memory.used / 1024**3,
             "memory_percent": memory.percent}
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            try:
                stats[f"gpu{index}_util_percent"] = float(torch.cuda.utilization(index))
            except Exception:  # NVML (nvidia-ml-py) missing: utilisation is unknown, memory still is
                pass
            free, total = torch.cuda.mem_get_info(index)
            stats[f"gpu{index}_memory_used_gb"] = (total - free) / 1024**3
    return stats


def node_stats(world: int) -> dict[str, float]:
    """`system/<node>/<metric>` for every node, one sample per node (all ranks take part in the gather)."""
    own = (socket.gethostname(), local_stats())
    if world > 1 and dist.is_initialized():
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, own)
    else:
        gathered = [own]
    by_node = dict(gathered)  # one entry per host name: ranks on one node see the same numbers
    return {f"system/{node}/{key}": value for node, stats in by_node.items() for key, value in stats.items()}
