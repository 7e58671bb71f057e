"""The model checked on the driver, before Ray starts, against the config resolved for the data and the data's
sample rows: it builds with its options (on the meta device), the task's call finds its inputs in the batch and the
model's forward takes them, and the sample's sequences fit its learned positions. Each failure is one ConfigError
naming the key and the fix. The plan (orchestrator/run/checks.py) calls it once, after the model's options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from orchestrator.config import Config
from orchestrator.errors import ConfigError
from pipelines.sources import DatasetInfo

if TYPE_CHECKING:
    from pipelines.batches import Sample


@dataclass(frozen=True)
class ModelFacts:
    """What the driver's check found: the model the workers will build (on the meta device; None where the check
    cannot tell) and the width of its classic input (None for named inputs whose columns are not all numbers)."""

    model: Any
    in_features: int | None


def in_features(config: Config, info: DatasetInfo) -> int | None:
    """Width of the classic model input; None for named inputs whose columns are not all fixed-width numbers."""
    if config.model.inputs is None and config.data.label is None:
        return info.feature_dim - 1  # token windows of seq_len + 1: the inputs and the next tokens shifted by one
    return info.feature_dim or None


def check_model(config: Config, info: DatasetInfo, sample: Sample | None) -> ModelFacts:
    """The model builds with its options (on the meta device: no memory, no weights loaded; with model.pretrained,
    in its saved config's architecture), for every model; the sample rows' sequences fit its learned positions;
    with named inputs also: the sample rows convert to tensors, hold every input the model is given, and the
    model's forward takes them by name. `sample`: the train sample collated as the workers collate it, where the
    plan's data inspection did (pipelines.datasets.inspect_run)."""
    # The model's modules (torch) when the plan checks it: `in_features` is read without them.
    from orchestrator.models.tasks import check_forward, task_parts
    from orchestrator.models.zoo import check_model_build

    call, named = None, config.model.inputs is not None
    if named and sample is not None and sample.error is not None:
        raise ConfigError(f"data in {info.path}: {sample.error}")
    batch = sample.batch if sample is not None and (named or config.data.label is None) else None
    if named and batch is not None:
        _, call, _ = task_parts(config)
        missing = [key for key in (call.inputs or {}).values() if key not in batch]
        if missing:
            raise ConfigError(f"config key 'model.inputs': {missing} are not in the batch, which has {sorted(batch)} "
                              "(a mask comes only with a variable-length token column)")
    # What the workers build with (spec["in_features"]), so that the driver's check sees the workers' model.
    width = in_features(config, info)
    model = check_model_build(config.model, width, config.model.num_classes, config.data.s3)
    if model is None:
        return ModelFacts(None, width)
    if call is not None:
        check_forward(model, call, config.model.entrypoint or config.model.name)
    if batch is not None:
        check_positions(config, info, model, batch, sample.masks if named and sample is not None else {})
    return ModelFacts(model, width)


def check_positions(config: Config, info: DatasetInfo, model: Any, batch: dict[str, Any],
                    masks: dict[str, str]) -> None:
    """The sample rows' token sequences fit the model's learned position table (GPT-2's n_positions, BERT's
    max_position_embeddings), padded as the workers pad them (data.pad_to_multiple_of): past it every worker fails
    with 'IndexError: index out of range in self', which Ray does not retry. ConfigError naming the longest real
    row, the table and the fix. `masks`: {token column: its mask's batch key} (named inputs)."""
    from orchestrator.models.zoo import position_limit

    found = position_limit(model)
    if found is None:
        return
    limit, key = found
    # The config key counts rows the table never gives a token (RoBERTa's padding row and the one before it).
    configured = getattr(model.config, "max_position_embeddings", limit)
    # {batch key: its column}: the named inputs' own columns (a mask is as long as its tokens), or forward(x).
    named = config.model.input_map
    columns = ({k: k for k in named.values() if k in config.data.features} if named is not None
               else {"x": config.data.features[0]})
    multiple = config.data.pad_to_multiple_of
    for batch_key, column in columns.items():
        value = batch.get(batch_key)
        if value is None or value.ndim != 2 or value.is_floating_point() or value.shape[1] <= limit:
            continue
        width = value.shape[1]  # the longest row, rounded up to data.pad_to_multiple_of: what the workers feed
        mask = batch.get(masks.get(column, ""))
        length = int(mask.sum(dim=1).max()) if mask is not None else width
        name = config.model.entrypoint or config.model.name
        source = f"{key} in {config.model.pretrained}/config.json" if config.model.pretrained else key
        kind = info.schema.field(column).type if info.schema is not None else None
        if length <= limit:
            fix = (f"data.pad_to_multiple_of={multiple} rounds them up to {width} tokens: set it to a divisor of "
                   f"{limit} or null")
        else:
            fit = limit - limit % multiple if multiple else limit
            fix = f"shorten column '{column}' to at most {fit} tokens"
            if config.data.label is None and kind is not None and pa.types.is_fixed_size_list(kind):
                # `prepare text --seq-len N` writes windows of N + 1 tokens; forward(x) takes the first N of them.
                seq_len = limit - (length - (kind.list_size - 1))
                if seq_len >= 1:
                    fix = f"write shorter windows (`orchestrator prepare text --seq-len {seq_len}`)"
        raise ConfigError(f"data in {info.path}: column '{column}' gives the model sequences of {length} tokens, but "
                          f"model '{name}' ({type(model).__name__}) has {limit} positions ({source}): {fix}, or use "
                          f"a model with {key} >= {width + configured - limit}")
