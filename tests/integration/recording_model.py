"""A user model (loaded through `model.entrypoint`) that records the row ids it trains on, one line per training
micro-batch in `<out_dir>/rank<r>.txt`, and can kill its own worker once (like faulty_model). The id is the first
feature; the network ignores it. Only forward passes of exactly `rows` rows count (the loop may run the model on
a slice of a batch, e.g. to count FLOPs). `kill_at` ({world size: call}) kills it at that call in a group of that
size, once per size (`<marker>-<size>`), instead of `after_calls`."""

from __future__ import annotations

import os
from pathlib import Path

import ray.train
import torch


class Recorder(torch.nn.Module):
    def __init__(self, in_features: int, num_classes: int, out_dir: str, marker: str | None, after_calls: int,
                 rows: int, kill_at: dict[str, int] | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(in_features - 1, 16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, num_classes))
        self.file = Path(out_dir, f"rank{ray.train.get_context().get_world_rank()}.txt")
        with open(self.file, "a") as out:
            out.write("start\n")
        self.marker = Path(marker) if marker else None
        self.after_calls = after_calls
        if kill_at is not None:  # config keys may arrive as strings (the workers' config is JSON)
            world = ray.train.get_context().get_world_size()
            self.after_calls = {int(k): v for k, v in kill_at.items()}.get(world, 0)
            self.marker = Path(f"{marker}-{world}")
        self.rows = rows
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and len(x) == self.rows:
            self.calls += 1
            if self.marker and self.calls == self.after_calls and not self.marker.exists():
                self.marker.write_text(str(os.getpid()))
                os._exit(1)  # a hard crash before this micro-batch is trained on
            with open(self.file, "a") as out:
                out.write(" ".join(str(int(v)) for v in x[:, 0].tolist()) + "\n")
        return self.net(x[:, 1:])


def build(in_features: int, num_classes: int, out_dir: str, rows: int, marker: str | None = None,
          after_calls: int = 0, kill_at: dict[str, int] | None = None) -> torch.nn.Module:
    return Recorder(in_features, num_classes, out_dir, marker, after_calls, rows, kill_at)


def read_runs(out_dir: str, rank: int) -> list[list[list[int]]]:
    """Per worker start, the id lists of each training micro-batch. The loop counts FLOPs once per start with a
    forward on its first micro-batch, which the next step trains on: that first repeat is dropped."""
    runs: list[list[list[int]]] = []
    for line in Path(out_dir, f"rank{rank}.txt").read_text().splitlines():
        if line == "start":
            runs.append([])
            continue
        batch = [int(v) for v in line.split()]
        if not (len(runs[-1]) == 1 and runs[-1][0] == batch):
            runs[-1].append(batch)
    return runs
