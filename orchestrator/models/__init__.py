"""The model side: zoo.py (the built-in models and the driver's build checks), tasks.py (what a task means: loss,
metrics, counts), registry.py (names -> builders), and, driver side only, checks.py (the model checked against the
data's sample rows before Ray starts), flavour.py (the final MLflow Model), pyfunc.py (its `python_function`
flavour) and checkpoints.py (each checkpoint as an MLflow LoggedModel). The worker side imports zoo, tasks and
registry only, never an MLflow module.

Nothing is imported here until asked: the zoo's classes keep `orchestrator.models` as their home (their
`__module__`), the path a pickled model logged before the zoo moved into this package names, so such a model still
loads; the attribute is looked up in zoo.py on first use."""

from __future__ import annotations

from typing import Any

PERSISTED = ("SmallCNN", "CausalSelfAttention", "Block", "GPT", "mlp")  # what a pickled model may name


def __getattr__(name: str) -> Any:
    if name not in PERSISTED:
        raise AttributeError(f"module 'orchestrator.models' has no attribute '{name}'")
    import orchestrator.models.zoo as zoo

    return getattr(zoo, name)
