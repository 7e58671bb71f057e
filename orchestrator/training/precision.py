"""Mixed precision in one object: autocast context, GradScaler (fp16 only), backward, unscale, its
own state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import torch

from orchestrator.errors import ConfigError

Mode = Literal["bf16", "fp16", "fp32"]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_supports_bf16() -> bool:
    """True where the CPU has native bf16 kernels (avx512_bf16 / AMX); emulated bf16 is slower than
    fp32."""
    try:
        return bool(torch.backends.mkldnn.is_available()
                    and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_precision(requested: str, device: torch.device) -> Mode:
    """`auto` -> bf16 where the device runs it natively, else fp16 on CUDA, else fp32."""
    if requested == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision=fp16 needs a CUDA device; on CPU use bf16 or fp32")
    if requested != "auto":
        return requested  # type: ignore[return-value]
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    return "bf16" if cpu_supports_bf16() else "fp32"


def flush_denormals(on: bool) -> bool:
    """Treat subnormal floats (below ~1.2e-38) as zero in this thread and in the intra-op threads it
    starts later.

    Late in training, gradients and Adam's moments drift into that range, and x86 float math on them
    is several times slower (bench/overhead.py's bare loop: 4x slower per step once its loss neared
    zero). The intra-op pool threads copy the setting when they are created, so call this before the
    thread's first parallel op. False where the CPU cannot flush them. GPU kernels are
    unaffected."""
    return torch.set_flush_denormal(on)


class Precision:
    """Parameters and gradients stay fp32; only the forward runs in the reduced dtype."""

    def __init__(self, mode: Mode, device: torch.device) -> None:
        self.mode = mode
        self.device = device
        # fp16 has a narrow exponent range: small gradients underflow unless the loss is scaled up
        # first.
        self.scaler = torch.amp.GradScaler(device.type) if mode == "fp16" else None
        # Steps the fp16 scaler skipped, counted on the device (read at reports and checkpoints
        # only).
        self._overflows = torch.zeros((), device=device)

    @property
    def skipped_steps(self) -> int:
        return int(self._overflows)

    @skipped_steps.setter
    def skipped_steps(self, count: int) -> None:
        self._overflows = torch.tensor(float(count), device=self.device)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.mode == "fp32":
            yield
        else:
            with torch.autocast(self.device.type, dtype=_DTYPES[self.mode]):
                yield

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        # Clipping must see the true gradient norm, so unscale before clip_grad_norm_.
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> torch.Tensor:
        """Apply the update unless `skip` (1.0 on the device, the same on every rank) says
        otherwise, without reading it back. Returns, on the device, 1.0 where the fp16 scaler
        skipped the update because the gradients overflowed (and `skip` had not already dropped it),
        else 0.0. A skipped step still counts for the fp16 scale."""
        if self.scaler is None:
            step_unless(optimizer, skip)
            return torch.zeros((), device=skip.device)
        # The scaler's verdict per device, from unscale_: `skip` joins it, so the update is dropped
        # (inside the fused kernel, or by the scaler's own read without one) and update() backs the
        # scale off, as after an overflow.
        found = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        overflow = torch.stack([flag.to(skip.device) for flag in found.values()]).amax()
        for flag in found.values():
            torch.maximum(flag, skip.to(flag.device), out=flag)
        dropped = torch.maximum(overflow, skip)
        with _no_state_from_a_dropped_step(optimizer, dropped) as needs_read:
            # needs_read: GradScaler's own path for an optimizer without a kernel (one host read, on
            # such steps only)
            with (_attribute(optimizer, "_step_supports_amp_scaling", False) if needs_read
                  else contextlib.nullcontext()):
                self.scaler.step(optimizer)
        self.scaler.update()
        overflowed = (overflow > 0) & (skip == 0)
        self._overflows += overflowed
        return overflowed.float()

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "skipped_steps": self.skipped_steps,
                "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = state.get("skipped_steps", 0)
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """`optimizer.step()` unless `skip` is 1.0, decided on the device where the optimizer can
    (torch's fused kernels take a `found_inf` flag and leave parameters, state and step count
    untouched when it is 1). Any other optimizer reads the flag back: one host read per step, the
    price of an optimizer without a fused kernel."""
    # set by torch's fused kernels (and replicas.py)
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        if not bool(skip):
            optimizer.step()
        return
    with _no_state_from_a_dropped_step(optimizer, skip) as needs_read:
        if needs_read:
            if not bool(skip):
                optimizer.step()
            return
        # the attribute GradScaler sets for fused kernels
        with _attribute(optimizer, "found_inf", skip):
            optimizer.step()


@contextlib.contextmanager
def _attribute(obj: object, name: str, value: Any) -> Iterator[None]:
    """`obj.name = value` for the block, then as it was (absent included)."""
    missing = object()
    before = obj.__dict__.get(name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if before is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, before)


@contextlib.contextmanager
def _no_state_from_a_dropped_step(optimizer: torch.optim.Optimizer,
                                  dropped: torch.Tensor) -> Iterator[bool]:
    """Around a step the device may drop (`dropped` 1.0): the optimizer state that step creates is
    left as a fresh optimizer's would be, so the next applied step is the optimizer's true first
    one.

    torch's fused kernels leave parameters and existing state alone on `found_inf`, but the state a
    first step creates is stored all the same: fused SGD makes its momentum buffers with
    `empty_like` before the kernel returns, so a skipped first step (a NaN batch; fp16's first
    overflow) would train on uninitialised memory. Where a fresh state is zeros (torch's Adam and
    AdamW, whose fused step count is taken back on `found_inf`; SGD without dampening, whose first
    buffer, the gradient, is what a zero buffer gives) the new state is zeroed on the device where
    the step dropped. Any other optimizer yields True while it still creates state: its caller
    decides on the host then (one read, on those steps only)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(optimizer.state) >= len(params):  # every parameter has its state: the usual step
        yield False
        return
    fresh = [p for p in params if p not in optimizer.state]
    if not _zeros_are_fresh(optimizer):
        yield True
        return
    yield False
    for p in fresh:
        for value in optimizer.state.get(p, {}).values():
            if isinstance(value, torch.Tensor):
                # an FSDP shard's own tensor
                local = value.to_local() if hasattr(value, "to_local") else value
                local.masked_fill_(dropped.to(local.device, torch.bool), 0)


def _zeros_are_fresh(optimizer: torch.optim.Optimizer) -> bool:
    inner = getattr(optimizer, "optim", optimizer)  # replicas.py's wrapper holds torch's optimizer
    if isinstance(inner, torch.optim.SGD):
        return all(group["dampening"] == 0 for group in inner.param_groups)
    return isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))
