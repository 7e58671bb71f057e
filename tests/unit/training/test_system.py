"""Per-node system metrics (training/system.py) on a node whose workers share CUDA_VISIBLE_DEVICES (Ray Train's
default), emulated on CPU: two visible devices, this rank trains on cuda:1 (Ray Train makes it the current device).
A call that needs a CUDA context opens one on the device it names, so each such call is recorded with its device."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from orchestrator.training import system

GIB = 1024**3
OWN = 1
# Free and total bytes, and NVML's utilisation, per visible device.
MEMORY = {0: (7 * GIB, 16 * GIB), 1: (4 * GIB, 16 * GIB)}
UTILISATION = {0: 11, 1: 93}


@pytest.fixture
def touched(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(API, device index) of every context-opening CUDA call; NVML reads (utilisation) open none."""
    calls: list[tuple[str, int]] = []

    def index(device: Any) -> int:  # CUDA's rule: no device, or one without an index, is the current one
        if isinstance(device, int):
            return device
        return OWN if device is None or torch.device(device).index is None else torch.device(device).index

    def contextful(name: str, result: Any) -> Any:
        def call(device: Any = None, *args: Any, **kwargs: Any) -> Any:
            calls.append((name, index(device)))
            return result(index(device))
        return call

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: OWN)
    monkeypatch.setattr(torch.cuda, "utilization", lambda device=None: UTILISATION[index(device)])
    for name, result in (("mem_get_info", MEMORY.__getitem__), ("synchronize", lambda i: None),
                         ("set_device", lambda i: None), ("memory_allocated", lambda i: 0),
                         ("memory_reserved", lambda i: 0), ("empty_cache", lambda i: None)):
        monkeypatch.setattr(torch.cuda, name, contextful(name, result))
    return calls


def test_a_rank_reads_only_its_own_gpu_and_opens_no_context_on_the_others(touched: list[tuple[str, int]]) -> None:
    stats = system.node_stats(1)
    assert touched and {device for _, device in touched} == {OWN}
    (node,) = {key.split("/")[1] for key in stats}
    free, total = MEMORY[OWN]
    assert stats[f"system/{node}/gpu{OWN}_memory_used_gb"] == (total - free) / GIB
    assert stats[f"system/{node}/gpu{OWN}_util_percent"] == UTILISATION[OWN]
    assert not any("gpu0" in key for key in stats)  # another rank's device: that rank reports it


def test_the_ranks_of_one_node_report_their_gpus_side_by_side(touched: list[tuple[str, int]],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks on one node: rank 0 trains on cuda:0 (its figures come through the gather), this rank on cuda:1."""
    other = ("node-a", {"cpu_percent": 50.0, "memory_used_gb": 3.0, "memory_percent": 20.0,
                        "gpu0_util_percent": 11.0, "gpu0_memory_used_gb": 9.0})
    monkeypatch.setattr(system.socket, "gethostname", lambda: "node-a")
    monkeypatch.setattr(system.dist, "is_initialized", lambda: True)

    def gather(out: list[Any], obj: Any) -> None:
        out[:] = [other, obj]

    monkeypatch.setattr(system.dist, "all_gather_object", gather)
    stats = system.node_stats(2)
    free, total = MEMORY[OWN]
    assert stats["system/node-a/gpu0_memory_used_gb"] == 9.0
    assert stats["system/node-a/gpu1_memory_used_gb"] == (total - free) / GIB
    assert {device for _, device in touched} == {OWN}
