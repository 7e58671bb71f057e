"""A user model (loaded through `model.entrypoint`) that records, when it is built, the process-global state a Tune
trial inherits from the trial that ran before it in the same actor, then changes that state as a user's builder (or
another trial's settings) may: one JSON line per build in `log`. What it records:
- `clocks`: the epoch-clock actors alive (each run's train reader has one; the trial's own must be the only one);
- `flushed`: the share of subnormal inputs a parallel op (several intra-op threads) flushed to zero: 1.0 with
  train.flush_denormal=true, 0.0 without, anything else when the threads disagree;
- `dtype`, `threads`: torch's default dtype and intra-op thread count;
- `compiles`: whether torch.compile still compiles a new shape of a function (not silently eager past dynamo's
  recompile limit, which a previous trial may have used up; the code object is shared, as a model class's is)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import ray
import torch
import torch._dynamo


def _probe(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _compiles(size: int) -> bool:
    before = _graphs()
    torch.compile(_probe, backend="eager", dynamic=False)(torch.ones(size))
    return _graphs() > before


def _flushed() -> float:
    x = torch.full((1 << 22,), 1e-40)  # subnormal float32; large enough to be split over the intra-op threads
    return float(((x * 1.0) == 0).float().mean())


def _clocks() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("orchestrator-epoch-"))


def build(in_features: int, num_classes: int, log: str = "") -> torch.nn.Module:
    from ray import tune

    record = {"pid": os.getpid(), "trial": tune.get_context().get_trial_id(), "clocks": _clocks(),
              "flushed": _flushed(), "dtype": str(torch.get_default_dtype()), "threads": torch.get_num_threads(),
              "compiles": _compiles(3)}
    with open(Path(log), "a") as out:
        out.write(json.dumps(record) + "\n")
    model = torch.nn.Sequential(torch.nn.Linear(in_features, 32), torch.nn.ReLU(), torch.nn.Linear(32, num_classes))
    # What the next trial in this process must not inherit. The parameters above are float32 already, and the rest
    # leaves this trial's own figures alone (the loop's tensors follow the model's dtype).
    limit = torch._dynamo.config.recompile_limit
    for size in range(4, 4 + limit + 1):  # one compile per shape, past the limit: later shapes would run eager
        _compiles(size)
    torch.set_num_threads(torch.get_num_threads() + 1)
    torch.set_default_dtype(torch.float64)
    torch.set_flush_denormal(True)  # whatever the config said
    _flushed()  # ... in the intra-op threads too (they exist now, with this thread's setting)
    return model
