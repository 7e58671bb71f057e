"""The peak device memory a report logs covers its whole interval, also when the autopilot's search measured
candidates in it (each from a peak of its own): the allocator's counters stubbed on the CPU. The real allocator's
is in test_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from orchestrator.doctor.record import RunRecord
from orchestrator.doctor.rules.speed import memory_headroom
from orchestrator.tracking.view import mlflow_key
from orchestrator.training import autopilot
from orchestrator.training.memory import GIB, cuda_memory_stats
from orchestrator.training.parts import StepState

CUDA = torch.device("cuda", 0)


class Allocator:
    """torch.cuda's allocator counters: the bytes allocated now, and their peak since the last reset."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def run(self, gib: float) -> None:
        """A step that allocates `gib` and frees it."""
        self.peak = max(self.peak, self.now + int(gib * GIB))

    def reset(self, device: object = None) -> None:
        self.peak = self.now


@pytest.fixture
def allocator(monkeypatch: pytest.MonkeyPatch) -> Allocator:
    fake = Allocator()
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: fake.now)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: fake.now)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: fake.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset)
    return fake


def open_candidate() -> None:
    """The autopilot putting its next candidate on a GPU rank (Autopilot._open), its step left out."""
    pilot = SimpleNamespace(knobs=SimpleNamespace(apply=lambda parts, settings: None), fits={}, best=None)
    parts = SimpleNamespace(eager_model=None, device=CUDA, state=StepState())
    trial = autopilot.Trial(SimpleNamespace(precision="bf16"))  # type: ignore[arg-type]
    autopilot.Autopilot._open(pilot, parts, trial, [{"x": torch.zeros(4, 2)}])  # type: ignore[arg-type]


def peak_figures(stats: dict[str, float]) -> dict[str, float]:
    return {key: value for key, value in stats.items() if "peak" in key}


def test_a_reports_peak_covers_the_candidates_measured_in_its_interval(allocator: Allocator) -> None:
    allocator.run(6.0)  # the first candidate's steps
    open_candidate()
    allocator.run(2.0)
    assert torch.cuda.max_memory_allocated(CUDA) == 2 * GIB  # what the search reads: this candidate's own peak
    reported = peak_figures(cuda_memory_stats(CUDA))
    assert list(reported.values()) == [6.0]
    allocator.run(1.0)  # the next interval starts from its own
    assert list(peak_figures(cuda_memory_stats(CUDA)).values()) == [1.0]


def test_the_doctor_reads_the_peak_the_report_logs(allocator: Allocator) -> None:
    """The memory rule finds the figure under the name the report gives it: a run that peaked at 6 of 80 GiB has
    room for a larger micro-batch; one that peaked at 60 does not."""
    allocator.run(6.0)
    (key,) = peak_figures(cuda_memory_stats(CUDA))
    gpu = {"device/cuda": [1.0], "device/memory_total_gb": [80.0], "micro_batch_size": [8.0]}

    def run(peak: float) -> RunRecord:  # as read back from MLflow: under the keys the tracker logs
        return RunRecord({mlflow_key(name): values for name, values in {**gpu, key: [peak]}.items()},
                         {"train.global_batch_size": "64", "scaling.num_workers": "1"})

    assert memory_headroom(run(6.0)) is not None
    assert memory_headroom(run(60.0)) is None
