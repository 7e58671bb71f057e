"""A user's model (`model.entrypoint=env_model:build`, an MLP) that writes, from each process that builds it, the
value of one environment variable to `<out_dir>/<pid>`: what a run's Ray Train workers see of the environment
(tests/integration/test_warm_cluster.py). The driver builds it too (its checks, the final model): tell it by PID."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def build(in_features: int, num_classes: int, hidden: list[int], variable: str, out_dir: str) -> torch.nn.Module:
    Path(out_dir, str(os.getpid())).write_text(os.environ.get(variable, "<unset>"))
    sizes = [in_features, *hidden]
    layers = [layer for a, b in zip(sizes[:-1], sizes[1:], strict=True)
              for layer in (torch.nn.Linear(a, b), torch.nn.ReLU())]
    return torch.nn.Sequential(*layers, torch.nn.Linear(sizes[-1], num_classes))
