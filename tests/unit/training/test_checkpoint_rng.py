"""A checkpoint's CUDA RNG stream across a change of GPU layout, emulated on CPU: CUDA's RNG calls are stubs that
keep one generator state per visible device and refuse a device that is not visible (as torch's generator lookup
does). Saved by a rank training on cuda:1 of 2, restored by a rank that sees one device after the restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrator.config import load_config
from orchestrator.training.checkpoint import Progress, checkpoint_state, load_state, restore, save_state
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision


class Devices:
    """`count` visible CUDA devices, each with its generator state (a distinct byte tensor), `current` selected."""

    def __init__(self, count: int, current: int) -> None:
        self.count, self.current = count, current
        self.states = [torch.full((8,), 10 + i, dtype=torch.uint8) for i in range(count)]
        self.touched: list[int] = []

    def index(self, device: Any) -> int:
        if isinstance(device, int):
            index = device
        else:
            device = torch.device(device)
            index = self.current if device.index is None else device.index
        self.touched.append(index)
        if not 0 <= index < self.count:
            raise IndexError("tuple index out of range")  # torch.cuda.default_generators[index]
        return index

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def get_rng_state(device: Any = "cuda") -> torch.Tensor:
            return self.states[self.index(device)].clone()

        def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
            self.states[self.index(device)] = new_state.clone()

        def get_rng_state_all() -> list[torch.Tensor]:
            return [get_rng_state(i) for i in range(self.count)]

        def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
            for i, state in enumerate(new_states):
                set_rng_state(state, i)

        cuda = torch.cuda
        for name, value in (("is_available", lambda: True), ("device_count", lambda: self.count),
                            ("current_device", lambda: self.current), ("get_rng_state", get_rng_state),
                            ("set_rng_state", set_rng_state), ("get_rng_state_all", get_rng_state_all),
                            ("set_rng_state_all", set_rng_state_all)):
            monkeypatch.setattr(cuda, name, value)


def _parts(device: torch.device) -> Parts:
    """A model whose training device is `device` (the model itself stays on the CPU: only RNG calls are CUDA's)."""
    model = torch.nn.Linear(2, 2)
    optimizer, scheduler = build_optimizer(model, load_config(None, []).optim, 4)
    return Parts(model, optimizer, scheduler, Precision("fp32", torch.device("cpu")), device)


def test_a_resume_on_fewer_gpus_restores_the_training_devices_stream(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    before = Devices(count=2, current=1)
    before.install(monkeypatch)
    saved_stream = before.states[1].clone()
    state = checkpoint_state(_parts(torch.device("cuda", 1)), Progress(step=3), 8)
    assert state is not None
    save_state(tmp_path, state)

    after = Devices(count=1, current=0)  # the restarted rank sees only the GPU it trains on, as cuda:0
    after.install(monkeypatch)
    torch.manual_seed(0)
    restore(_parts(torch.device("cuda", 0)), load_state(tmp_path))
    assert torch.equal(after.states[0], saved_stream)  # cuda:1's stream, now the training device's
    assert set(before.touched) == {1} and set(after.touched) == {0}  # the training device's generator only


def test_a_checkpoint_that_kept_every_devices_stream_still_loads_on_fewer_gpus(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Written before only the training device's stream was kept: a list, one state per visible device."""
    before = Devices(count=2, current=0)
    before.install(monkeypatch)
    state = checkpoint_state(_parts(torch.device("cuda", 0)), Progress(step=3), 8)
    assert state is not None
    state["rng"][0]["cuda"] = torch.cuda.get_rng_state_all()
    save_state(tmp_path, state)

    after = Devices(count=1, current=0)
    after.install(monkeypatch)
    restore(_parts(torch.device("cuda", 0)), load_state(tmp_path))
    assert torch.equal(after.states[0], before.states[0])  # the same device index's stream, as it was restored
    assert set(after.touched) == {0}
