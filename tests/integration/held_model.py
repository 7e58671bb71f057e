"""A user model (loaded through `model.entrypoint`) that holds training at a known point until the test lets it go,
so a test acts on a run at that point instead of racing it (however slow or fast the machine is):
- `hold_call`: the n-th training forward of every worker waits there (0: never). The loop counts FLOPs with one
  extra forward at its first step, so call n is in step n-1 or n: a test asserts report steps around it;
- `marker`: a directory; each held worker writes `held-<pid>` there as it starts waiting (the test's sign that the
  run is at that point). A file `<marker>/hold_call` there, read as the model is built, moves the hold for the
  workers built from then on (a `--resume` must keep the run's config, and so `hold_call`; a test stops each attempt
  at its own point);
- `release`: what ends the hold: "file" (the test creates <marker>/release, or <marker>/release-<pid> for one
  process only) or "drain" (Ray Train has a drain
  notice for the run: `ray.train.get_preemption_info`, a barrier every worker calls in step, each the same number
  of times, so all leave the hold together);
- `timeout_s`: the hold gives up after about this long and training goes on, so a test whose go-ahead never comes
  fails on its own assertions instead of hanging (counted in polls, not by each worker's clock: the same on every
  rank, which the barrier needs)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

POLL_S = 0.1


class Held(torch.nn.Module):
    def __init__(self, in_features: int, num_classes: int, hold_call: int, marker: str, release: str,
                 timeout_s: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(in_features, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, num_classes))
        self.hold_call, self.marker, self.release, self.timeout_s = hold_call, marker, release, timeout_s
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.hold_call:
                self._hold()
        return self.net(x)

    def _hold(self) -> None:
        Path(self.marker, f"held-{os.getpid()}").write_text("")
        for _ in range(max(1, round(self.timeout_s / POLL_S))):
            if self._released():
                return
            time.sleep(POLL_S)

    def _released(self) -> bool:
        if self.release == "drain":
            import ray.train

            return ray.train.get_preemption_info() is not None
        return Path(self.marker, "release").exists() or Path(self.marker, f"release-{os.getpid()}").exists()


def build(in_features: int, num_classes: int, hold_call: int = 0, marker: str = "", release: str = "file",
          timeout_s: float = 240.0) -> torch.nn.Module:
    if release not in ("file", "drain"):
        raise ValueError(f"release={release!r}: use 'file' or 'drain'")
    if marker and Path(marker, "hold_call").exists():
        hold_call = int(Path(marker, "hold_call").read_text())
    return Held(in_features, num_classes, hold_call, marker, release, timeout_s)
