"""The model side, imported by the workers: zoo.py (the built-in models), tasks.py (what a task
means: loss, metrics, counts), registry.py (names -> builders) and inputs.py (the width of the
model's classic input). No MLflow module: the final MLflow Model and the checkpoints' models are
tracking's (orchestrator/tracking/flavour.py, pyfunc.py, checkpoint_models.py), the driver's
checks of a model the plan's (orchestrator/run/model_checks.py).

Nothing is imported here until asked: the zoo's classes keep `orchestrator.models` as their home
(their `__module__`), the path a pickled model logged before the zoo moved into this package
names, so such a model still loads; the attribute is looked up in zoo.py on first use."""

from __future__ import annotations

from typing import Any

# what a pickled model may name
PERSISTED = ("SmallCNN", "CausalSelfAttention", "Block", "GPT", "mlp")


def __getattr__(name: str) -> Any:
    if name not in PERSISTED:
        raise AttributeError(f"module 'orchestrator.models' has no attribute '{name}'")
    import orchestrator.models.zoo as zoo

    return getattr(zoo, name)
