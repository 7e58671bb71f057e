"""The task section: what is learned (the loss, the validation metrics, what Tune and doctor rank
by), and what each built-in task means to the driver (TASK_KINDS)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from orchestrator.config.base import _Section


@dataclass(frozen=True)
class TaskKind:
    """What a built-in task (orchestrator/models/tasks.py) means to the driver: the validation
    metrics it reports, the one (with its mode) Tune and doctor rank by unless tune.metric says
    otherwise, and what `data.label` must hold."""

    metrics: tuple[str, ...]
    metric: str
    mode: Literal["max", "min"]
    # None: the next tokens of the token column
    label: Literal["classes", "multi-hot", "numbers"] | None


TASK_KINDS: dict[str, TaskKind] = {
    "classification": TaskKind(("val_loss", "val_accuracy", "val_top5_accuracy"), "val_accuracy",
                               "max", "classes"),
    "multilabel": TaskKind(("val_loss", "val_accuracy", "val_f1"), "val_f1", "max", "multi-hot"),
    "regression": TaskKind(("val_loss", "val_mse", "val_rmse", "val_mae", "val_r2"), "val_rmse",
                           "min", "numbers"),
    "causal_lm": TaskKind(("val_loss", "val_perplexity", "val_accuracy"), "val_loss", "min", None),
}

# A user's task ("module:Class") reports at least val_loss and is ranked by it.
USER_TASK = TaskKind(("val_loss",), "val_loss", "min", None)


class TaskConfig(_Section):
    """What is learned: the loss, the validation metrics and what Tune ranks by
    (orchestrator/models/tasks.py)."""

    name: str | None = Field(None, description="classification | multilabel | regression | "
                             "causal_lm | 'module:Class'; null: classification with data.label, "
                             "causal_lm without.")
    loss: Literal["task", "model"] = Field("task",
                                           description="task: the task's loss on the model's "
                                                       "logits; model: the loss the model returns "
                                                       "when given `labels` (Hugging Face).")

    @property
    def kind(self) -> TaskKind | None:
        """The built-in task's meaning; None for a user's own task (`module:Class`) or before the
        name is resolved."""
        return TASK_KINDS.get(self.name or "")
