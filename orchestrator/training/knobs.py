"""The settings the autopilot searches (training/autopilot.py), as the train.* config keys that give
each from the start, and how a candidate's settings are put on the running model, optimizer and
step."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from orchestrator.training.checkpoint import unwrap
from orchestrator.training.parts import Parts, compile_model
from orchestrator.training.precision import Precision
from orchestrator.training.sync import average_optimizer_state, build_local_sgd

# omp_pause_resource_t: the runtime's threads end (a soft pause may only put them to sleep)
OMP_PAUSE_HARD = 2


@dataclass(frozen=True)
class Settings:
    """One candidate, as the train.* config keys that give it from the start."""

    micro_batch_size: int
    grad_accum_steps: int
    compile: bool
    torch_threads: int
    flush_denormal: bool
    precision: str
    # train.sync, a candidate only when autopilot.allow lists it (it changes the math)
    sync: str = "ddp"
    # train.tf32: fp32's matrix products on TF32 tensor cores; allowed like sync (a GPU's)
    tf32: bool = False

    def line(self) -> str:
        return (f"micro {self.micro_batch_size} x {self.grad_accum_steps} | "
                f"compile {_on(self.compile)} | threads {self.torch_threads} "
                f"| flush {_on(self.flush_denormal)} | {self.precision}"
                + (" | tf32" if self.tf32 else "")
                + (f" | {self.sync}" if self.sync != "ddp" else ""))


def _on(flag: bool) -> str:
    return "on" if flag else "off"


class Knobs:
    """Puts a candidate's settings on the running Parts. `micro`: the micro-batch the data pipeline
    cuts; a larger candidate joins its micro-batches, a smaller one cuts them (step.cut)."""

    def __init__(self, parts: Parts, micro: int, flush: bool,
                 local_sgd: tuple[int, float, float | None]) -> None:
        self.micro, self.flush, self.device, self.local_sgd = micro, flush, parts.device, local_sgd
        # a run configured compiled: its eager fallback
        self.eager = parts.eager_model or parts.model
        self.compiled = parts.model if parts.eager_model is not None else None

    def read(self, parts: Parts, per_worker: int) -> Settings:
        """The settings `parts` runs with now."""
        micro = self.micro * parts.state.join // parts.state.split
        return Settings(micro, per_worker // micro,
                        self.compiled is not None and parts.model is self.compiled,
                        torch.get_num_threads(), self.flush, parts.precision.mode,
                        "local_sgd" if parts.local_sgd is not None else "ddp",
                        torch.backends.cuda.matmul.allow_tf32)

    def apply(self, parts: Parts, s: Settings) -> None:
        if s.micro_batch_size >= self.micro:
            parts.state.join, parts.state.split = s.micro_batch_size // self.micro, 1
        else:
            parts.state.join, parts.state.split = 1, self.micro // s.micro_batch_size
        self._compile(parts, s.compile)
        if s.precision != parts.precision.mode:
            skipped = parts.precision.skipped_steps
            parts.precision = Precision(s.precision, parts.device)  # type: ignore[arg-type]
            parts.precision.skipped_steps = skipped
        if torch.get_num_threads() != s.torch_threads:
            torch.set_num_threads(s.torch_threads)
        if s.flush_denormal != self.flush:
            switch_flush_denormal(s.flush_denormal)
            self.flush = s.flush_denormal
        # Process-wide flags, read by the next kernel launched (and by timing.peak_flops for the
        # MFU's peak). cuDNN's is set with the matmuls': torch turns its TF32 on by default, so fp32
        # stays fp32 only with both.
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = s.tf32
        self._sync(parts, s.sync)

    def _sync(self, parts: Parts, sync: str) -> None:
        """Local SGD on or off (a collective when it goes off: every rank applies a candidate at the
        same step)."""
        if (parts.local_sgd is not None) == (sync == "local_sgd"):
            return
        model = unwrap(parts.model)
        if sync == "local_sgd":
            parts.local_sgd = build_local_sgd("local_sgd", *self.local_sgd)
            parts.local_sgd.start(model)  # the replicas are one model now
        # the replicas and their optimizer states drifted apart: averaged once, then DDP keeps them
        # one
        else:
            parts.state.comm_bytes += parts.local_sgd.average(model)  # type: ignore[union-attr]
            parts.state.comm_bytes += average_optimizer_state(parts.optimizer)
            parts.local_sgd = None

    def _compile(self, parts: Parts, on: bool) -> None:
        if not on:
            parts.model, parts.eager_model = self.eager, None
        elif self.compiled is None:
            parts.model = self.eager
            # the next step compiles it: first_compiled_step, which falls back together
            compile_model(parts)
            self.compiled = parts.model
        elif parts.model is not self.compiled:
            parts.model = self.compiled  # it compiled on an earlier step of the search


def switch_flush_denormal(on: bool) -> bool:
    """Flush subnormal floats (or stop) mid-run on every thread this thread's ops compute on. The
    setting is per thread, and torch's intra-op threads copied it from this thread when it created
    them (precision.flush_denormals), so setting it here alone reached half a two-thread op. The
    OpenMP runtime's threads are therefore ended and the next parallel op starts them again, copying
    the new setting. False, with nothing changed, where that cannot be done (see `flush_switchable`)
    or the CPU cannot flush."""
    pause = _omp_pause()
    if pause is None or not torch.set_flush_denormal(on):
        return False
    threads = torch.get_num_threads()
    ended = pause(OMP_PAUSE_HARD) == 0
    # a runtime that reset its settings with its threads gets torch's count back
    torch.set_num_threads(threads)
    return ended


def flush_switchable() -> bool:
    """Whether `switch_flush_denormal` reaches torch's intra-op threads: they are OpenMP's, in a
    runtime found."""
    return _omp_pause() is not None


@functools.cache
def _omp_pause() -> Callable[[int], int] | None:
    """omp_pause_resource_all (OpenMP 5) of the runtime torch's intra-op threads run on, else None:
    torch's own copy (a wheel's torch/lib), else one already loaded into the process."""
    if not torch.backends.openmp.is_available():
        return None
    lib = Path(torch.__file__).parent / "lib"
    bundled = [str(p) for pattern in ("libgomp*", "libomp*", "libiomp*")
               for p in sorted(lib.glob(pattern))]
    for name in [*bundled, None]:
        try:
            pause = ctypes.CDLL(name).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause  # type: ignore[no-any-return]
    return None
