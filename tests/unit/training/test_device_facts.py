"""The device facts a run reports once (training/memory.py `device_facts`), on a GPU emulated on CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from orchestrator.training.memory import GIB, device_facts


def test_bf16_is_reported_supported_only_where_the_gpu_runs_it_natively(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pre-Ampere GPU (compute capability 7.5): torch makes bf16 tensors there, emulated and slower than fp16,
    so `torch.cuda.is_bf16_supported()` says True by default; the doctor's advice to switch to bf16 must not."""
    turing = SimpleNamespace(major=7, minor=5, total_memory=16 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: turing)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: turing.major >= 8 or including_emulation)
    facts = device_facts(torch.device("cuda", 0))
    assert facts["device/bf16_supported"] == 0.0
    assert facts["device/memory_total_gb"] == 16.0
