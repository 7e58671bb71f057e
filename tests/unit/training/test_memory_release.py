"""When cached device memory is handed back (training/memory.py): after an out-of-memory error always, after an
evaluation only under memory pressure. The CUDA side of it is in test_gpu.py."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch
from test_loop import config, dataset, make_parts, xy

from orchestrator.training import memory
from orchestrator.training.evaluation import evaluate
from orchestrator.training.step import train_step

GIB = 1024**3


@pytest.fixture
def collections(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """gc.collect as memory.py calls it, still collecting, each call counted."""
    calls: list[int] = []
    collect = gc.collect

    def counted(*args: int) -> int:
        calls.append(1)
        return collect(*args)

    monkeypatch.setattr(memory.gc, "collect", counted)
    return calls


def test_an_evaluation_on_the_cpu_runs_no_garbage_collection(collections: list[int]) -> None:
    """A collection of a big model's Python heap costs tens of milliseconds, and on the CPU there is no cache to
    hand back: evaluating never collects."""
    parts = make_parts(config())
    x, y = dataset(64)
    metrics = evaluate(parts, [xy(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)])
    assert metrics["val_loss"] > 0
    assert collections == []


def test_an_out_of_memory_step_still_releases_on_the_cpu(collections: list[int]) -> None:
    """The out-of-memory path keeps releasing (its step is redone in smaller pieces)."""
    parts = make_parts(config())
    forward: Callable[..., torch.Tensor] = parts.model.forward
    failed: list[int] = []

    def hungry(x: torch.Tensor) -> torch.Tensor:
        if len(x) > 8 and not failed:
            failed.append(1)
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(x)

    parts.model.forward = hungry  # type: ignore[method-assign]
    x, y = dataset(16)
    with pytest.warns(UserWarning, match="out of memory"):
        train_step(parts, [xy(x, y)])
    assert parts.state.oom_retries == 1 and len(collections) >= 1


@pytest.mark.parametrize(("free_gib", "pressed"), [(0.0, True), (7.9, True), (8.0, False), (40.0, False),
                                                    (80.0, False)])
def test_pressure_is_less_than_a_tenth_of_the_device_free(free_gib: float, pressed: bool) -> None:
    assert memory.under_pressure(int(free_gib * GIB), 80 * GIB) is pressed


def test_the_share_that_counts_as_pressure_can_be_set() -> None:
    assert memory.under_pressure(30 * GIB, 80 * GIB, share=0.5)
    assert not memory.under_pressure(30 * GIB, 80 * GIB, share=0.25)


def test_the_after_evaluation_release_keeps_the_cache_unless_the_device_is_short(
        monkeypatch: pytest.MonkeyPatch, collections: list[int]) -> None:
    """On a (stubbed) GPU: with plenty free, nothing is released; with under a tenth free, the cache is emptied."""
    emptied: list[int] = []
    free = [40 * GIB]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 80 * GIB))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    cuda = torch.device("cuda", 0)
    assert not memory.release_if_pressed(cuda)
    assert (emptied, collections) == ([], [])
    free[0] = 2 * GIB
    assert memory.release_if_pressed(cuda)
    assert (emptied, collections) == ([1], [1])
