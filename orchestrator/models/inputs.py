"""The width of the model's classic input, from the config and the data's facts: what the workers
build the model with (the plan hands it on), what the driver checks it with and what the final
model is rebuilt with. No torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.config import Config
    from pipelines.sources import DatasetInfo


def in_features(config: Config, info: DatasetInfo) -> int | None:
    """Width of the classic model input; None for named inputs whose columns are not all
    fixed-width numbers."""
    if config.model.inputs is None and config.data.label is None:
        # token windows of seq_len + 1: the inputs and the next tokens shifted by one
        return info.feature_dim - 1
    return info.feature_dim or None
