"""Mixed precision in one object: autocast context, GradScaler (fp16 only), backward, unscale, its own state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import torch

from orchestrator.errors import ConfigError

Mode = Literal["bf16", "fp16", "fp32"]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_supports_bf16() -> bool:
    """True where the CPU has native bf16 kernels (avx512_bf16 / AMX); emulated bf16 is slower than fp32."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_precision(requested: str, device: torch.device) -> Mode:
    """`auto` -> bf16 where the device runs it natively, else fp16 on CUDA, else fp32."""
    if requested == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision=fp16 needs a CUDA device; on CPU use bf16 or fp32")
    if requested != "auto":
        return requested  # type: ignore[return-value]
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_supports_bf16() else "fp32"


def flush_denormals(on: bool) -> bool:
    """Treat subnormal floats (below ~1.2e-38) as zero in this thread and in the intra-op threads it starts later.

    Late in training, gradients and Adam's moments drift into that range, and x86 float math on them is several
    times slower (bench/overhead.py's bare loop: 4x slower per step once its loss neared zero). The intra-op pool
    threads copy the setting when they are created, so call this before the thread's first parallel op. False
    where the CPU cannot flush them. GPU kernels are unaffected."""
    return torch.set_flush_denormal(on)


class Precision:
    """Parameters and gradients stay fp32; only the forward runs in the reduced dtype."""

    def __init__(self, mode: Mode, device: torch.device) -> None:
        self.mode = mode
        self.device_type = device.type
        # fp16 has a narrow exponent range: small gradients underflow unless the loss is scaled up first.
        self.scaler = torch.amp.GradScaler(device.type) if mode == "fp16" else None
        self.skipped_steps = 0

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.mode == "fp32":
            yield
        else:
            with torch.autocast(self.device_type, dtype=_DTYPES[self.mode]):
                yield

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        # Clipping must see the true gradient norm, so unscale before clip_grad_norm_.
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Apply the update; False when the scaler skipped it because gradients overflowed."""
        if self.scaler is None:
            optimizer.step()
            return True
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        applied = self.scaler.get_scale() >= scale  # the scale only drops after an inf/nan step
        self.skipped_steps += not applied
        return applied

    def skip(self) -> None:
        """Close a step dropped for a non-finite loss without an update: the scaler has unscaled this step's
        gradients and must be updated (and backs off its scale) before the next one."""
        if self.scaler:
            self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "skipped_steps": self.skipped_steps,
                "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = state.get("skipped_steps", 0)
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
