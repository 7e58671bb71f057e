"""Distributed PyTorch training on Ray, with the speed-up checklist applied automatically.

The Python API the CLI wraps; attributes are imported on first use so `import orchestrator` stays
light:

    from orchestrator import load_config, train
    result = train(load_config("examples/digits.yaml", ["optim.lr=1e-3"]))
    train(config, resume=True)  # or resume="<run name>" / "<run directory's path or s3:// URI>"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.config import Config, load_config
    from orchestrator.run.launch import train
    from orchestrator.run.result import TrainResult
    from orchestrator.tuning.results import TuneResult
    from orchestrator.tuning.study import tune

__all__ = ["Config", "TrainResult", "TuneResult", "load_config", "train", "tune"]

_HOMES = {"Config": "orchestrator.config", "load_config": "orchestrator.config",
          "TrainResult": "orchestrator.run.result", "train": "orchestrator.run.launch",
          "TuneResult": "orchestrator.tuning.results", "tune": "orchestrator.tuning.study"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'orchestrator' has no attribute '{name}'")
    import importlib

    return getattr(importlib.import_module(_HOMES[name]), name)
