"""A user model (loaded through `model.entrypoint`) with fault-injection knobs for the reliability tests:
- `step_s`: sleep per training forward, so a run lasts long enough to be killed from outside mid-run;
- `nan_call`/`nan_rank`: NaN logits on that rank's n-th training forward (one rank only: the skip must be agreed);
- `raise_call`: a RuntimeError (a shape bug in the user's forward) on every rank's n-th training forward, each
  recorded as a file in the `marker` directory, so a test counts the attempts;
- `die_in_checkpoint`: SIGKILL the worker halfway through writing its n-th checkpoint (while torch.save pickles
  state.pt; counted by picklings, since state_dict() is also called elsewhere), once (a marker file remembers it);
- `late_build_s`: a process that builds the model after `late_after` other processes did (each records its pid in
  the `marker` directory: the driver's check, then the workers) sleeps this long first: a replaced worker comes back
  late, however fast Ray replaces it.
The weights are an ordinary MLP; the extra state is an empty marker, so runs with and without faults compare."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import ray.train
import torch


class _KillWhilePickled:
    """Pickled inside torch.save: on the n-th pickling kills this process there, halfway through the file."""

    pickled = 0

    def __init__(self, marker: str, at: int) -> None:
        self.marker, self.at = marker, at

    def __reduce__(self) -> Any:
        _KillWhilePickled.pickled += 1
        if _KillWhilePickled.pickled == self.at and not Path(self.marker).exists():
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # never reached
        return (dict, ())


class Faulty(torch.nn.Module):
    def __init__(self, in_features: int, num_classes: int, step_s: float, nan_call: int, nan_rank: int,
                 die_in_checkpoint: int, marker: str, raise_call: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(in_features, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, num_classes))
        self.step_s, self.nan_call, self.nan_rank = step_s, nan_call, nan_rank
        self.die_in_checkpoint, self.marker, self.raise_call = die_in_checkpoint, marker, raise_call
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if self.training:
            self.calls += 1
            time.sleep(self.step_s)
            if self.calls == self.nan_call and ray.train.get_context().get_world_rank() == self.nan_rank:
                out = out * float("nan")
            if self.calls == self.raise_call:
                Path(self.marker, f"raised-{os.getpid()}").write_text("")
                return self.net[0](out)  # the commonest model bug: RuntimeError, mat1 and mat2 shapes ...
        return out

    def get_extra_state(self) -> Any:
        return {"boom": _KillWhilePickled(self.marker, self.die_in_checkpoint)} if self.die_in_checkpoint else {}

    def set_extra_state(self, state: Any) -> None:
        pass


def build(in_features: int, num_classes: int, step_s: float = 0.0, nan_call: int = 0, nan_rank: int = 0,
          die_in_checkpoint: int = 0, marker: str = "", raise_call: int = 0, late_build_s: float = 0.0,
          late_after: int = 3) -> torch.nn.Module:
    if late_build_s and marker:
        Path(marker, f"built-{os.getpid()}").write_text("")
        if len(list(Path(marker).glob("built-*"))) > late_after:
            time.sleep(late_build_s)
    return Faulty(in_features, num_classes, step_s, nan_call, nan_rank, die_in_checkpoint, marker, raise_call)
