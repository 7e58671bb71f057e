"""The model checked on the driver, before Ray starts: its options against its builder's
signature (check_model_options), then, against the config resolved for the data and the data's
sample rows, that it builds with them (on the meta device), the task's call finds its inputs in
the batch and the model's forward takes them, and the sample's sequences fit its learned
positions. Each failure is one ConfigError naming the key and the fix. The plan
(orchestrator/run/checks.py) calls them once; the study checks each trial's options."""

from __future__ import annotations

import inspect
import os
import re
import traceback
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import torch
from torch import nn

from orchestrator.config import Config, ModelConfig, either, keys_elsewhere, suggest
from orchestrator.errors import ConfigError, raised_in_model_code
from orchestrator.models.inputs import in_features
from orchestrator.models.tasks import check_forward, task_parts
from orchestrator.models.zoo import (
    build_model,
    check_pretrainable,
    model_builder,
    position_limit,
    pretrained_config,
    with_saved_architecture,
)
from pipelines.sources import DatasetInfo

if TYPE_CHECKING:
    from pipelines.batches import Sample


@dataclass(frozen=True)
class ModelFacts:
    """What the driver's check found: the model the workers will build (on the meta device; None
    where the check cannot tell) and the width of its classic input (None for named inputs whose
    columns are not all numbers)."""

    model: Any
    in_features: int | None


def check_model_options(model: ModelConfig) -> None:
    """The keys under `model:` beside name/entrypoint against the builder's signature; a typo
    fails on the driver, before any resource is taken. Raises ConfigError naming the keys, the
    close match and, for a config from load_config, where each key came from (a file's options
    for another model survive a --set model.entrypoint)."""
    key = "model.entrypoint" if model.entrypoint else "model.name"
    try:
        builder = model_builder(model.name, model.entrypoint)
    except ConfigError as exc:
        raise ConfigError(f"config key '{key}': {exc}") from None
    params = inspect.signature(builder).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    allowed = [p for p in params if p not in ("in_features", "num_classes", "self")]
    unknown = [key for key in model.kwargs if key not in allowed]
    if not unknown:
        return
    origins = model.origins
    files = [key for key in unknown if origins.get(key, "--set") != "--set"]

    def described(key: str) -> str:
        elsewhere = keys_elsewhere(key, "model")  # model.lr -> optim.lr
        hint = suggest(key, allowed)
        if not hint and elsewhere:
            hint = f" (did you mean {either(elsewhere)}?)"
        where = f" (from {origins[key]})" if key in origins else ""
        return f"'{key}'{hint}{where}"

    s = "s" if len(unknown) > 1 else ""
    keys = ", ".join(f"'model.{key}'" for key in unknown)
    message = (f"config key{s} {keys}: model '{model.entrypoint or model.name}' takes no option{s} "
               f"{', '.join(described(key) for key in unknown)}; its options: {allowed}")
    if files:
        message += (f"; remove {'them' if len(files) > 1 else 'it'} from {origins[files[0]]} or "
                    "with "
                    + " ".join(f"--set model.{k}=null" for k in files))
    raise ConfigError(message)


def check_model_build(model: ModelConfig, in_features: int | None, num_classes: int | None,
                      s3: Any = None) -> nn.Module | None:
    """Build the model once on the driver, on the meta device (shapes only: no memory, no
    weights, about a millisecond for the examples), so that options the builder cannot take fail
    before any resource is taken instead of in every worker. With model.pretrained (on S3:
    through `s3`, the data's S3Config), in the architecture of its config.json, which the
    workers' from_pretrained builds. Returns the model, or None where this check cannot tell (the
    workers will)."""
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a builder's warnings are the workers' to show
            built = build_model(model.name, model.entrypoint, in_features, num_classes,
                                model.kwargs)
    except ConfigError:
        raise
    # Any error of the builder blames it or its options, and every worker would raise it again; but
    # not one about the meta device this check builds on, a GPU the driver may lack, or the network
    # (the workers may reach it).
    except Exception as exc:  # noqa: BLE001 - see above
        if (isinstance(exc, (ConnectionError, TimeoutError))
                or re.search(r"meta|cuda|device", str(exc), re.I) or _calls_ray(exc)):
            return None
        raise ConfigError(_cannot_build(model, exc)) from None
    if model.pretrained is None:
        return built
    check_pretrainable(built, model.entrypoint or model.name)
    saved = pretrained_config(model.pretrained, s3)
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return with_saved_architecture(built, saved, model.entrypoint or model.name)
    except ConfigError:
        raise
    # A saved config only from_pretrained understands: the workers will tell.
    except Exception:  # noqa: BLE001
        return None


def _calls_ray(exc: Exception) -> bool:
    """Whether the builder raised inside Ray (ray.train.get_context(), say): an API of the
    workers, not the driver's."""
    return any(f"{os.sep}ray{os.sep}" in frame.filename
               for frame in traceback.extract_tb(exc.__traceback__))


def _cannot_build(model: ModelConfig, exc: Exception) -> str:
    """'config key 'model.hidden': model 'mlp' cannot be built with hidden=512 (TypeError: ...)':
    the options the user gave (every one: which of them is at fault only the builder knows) and
    the builder's own first line."""
    name, given = model.entrypoint or model.name, model.kwargs
    lines = str(exc).strip().splitlines()
    reason = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    where = raised_in_model_code(exc, users_only=True)  # the line in the user's own builder
    reason += f" at {where}" if where else ""
    if not given:
        key = "model.entrypoint" if model.entrypoint else "model.name"
        return f"config key '{key}': model '{name}' cannot be built ({reason})"
    keys = ", ".join(f"'model.{key}'" for key in given)
    options = ", ".join(f"{key}={value!r}" for key, value in given.items())
    s = "s" if len(given) > 1 else ""
    return f"config key{s} {keys}: model '{name}' cannot be built with {options} ({reason})"


def check_model(config: Config, info: DatasetInfo, sample: Sample | None) -> ModelFacts:
    """The model builds with its options (on the meta device: no memory, no weights loaded; with
    model.pretrained, in its saved config's architecture), for every model; the sample rows'
    sequences fit its learned positions; with named inputs also: the sample rows convert to
    tensors, hold every input the model is given, and the model's forward takes them by name.
    `sample`: the train sample collated as the workers collate it, where the plan's data
    inspection did (pipelines.datasets.inspect_run)."""
    call, named = None, config.model.inputs is not None
    if named and sample is not None and sample.error is not None:
        raise ConfigError(f"data in {info.path}: {sample.error}")
    batch = sample.batch if sample is not None and (named or config.data.label is None) else None
    if named and batch is not None:
        _, call, _ = task_parts(config)
        missing = [key for key in (call.inputs or {}).values() if key not in batch]
        if missing:
            raise ConfigError(f"config key 'model.inputs': {missing} are not in the batch, which "
                              f"has {sorted(batch)} (a mask comes only with a variable-length "
                              "token column)")
    # What the workers build with (spec["in_features"]), so that the driver's check sees the
    # workers' model.
    width = in_features(config, info)
    model = check_model_build(config.model, width, config.model.num_classes, config.data.s3)
    if model is None:
        return ModelFacts(None, width)
    if call is not None:
        check_forward(model, call, config.model.entrypoint or config.model.name)
    if batch is not None:
        masks = sample.masks if named and sample is not None else {}
        check_positions(config, info, model, batch, masks)
    return ModelFacts(model, width)


def check_positions(config: Config, info: DatasetInfo, model: Any, batch: dict[str, Any],
                    masks: dict[str, str]) -> None:
    """The sample rows' token sequences fit the model's learned position table (GPT-2's
    n_positions, BERT's max_position_embeddings), padded as the workers pad them
    (data.pad_to_multiple_of): past it every worker fails with 'IndexError: index out of range in
    self', which Ray does not retry. ConfigError naming the longest real row, the table and the
    fix. `masks`: {token column: its mask's batch key} (named inputs)."""
    found = position_limit(model)
    if found is None:
        return
    limit, key = found
    # The config key counts rows the table never gives a token (RoBERTa's padding row and the one
    # before it).
    configured = getattr(model.config, "max_position_embeddings", limit)
    # {batch key: its column}: the named inputs' own columns (a mask is as long as its tokens), or
    # forward(x).
    named = config.model.input_map
    columns = ({k: k for k in named.values() if k in config.data.features} if named is not None
               else {"x": config.data.features[0]})
    multiple = config.data.pad_to_multiple_of
    for batch_key, column in columns.items():
        value = batch.get(batch_key)
        if value is None or value.ndim != 2 or value.is_floating_point() or value.shape[1] <= limit:
            continue
        # the longest row, rounded up to data.pad_to_multiple_of: what the workers feed
        width = value.shape[1]
        mask = batch.get(masks.get(column, ""))
        length = int(mask.sum(dim=1).max()) if mask is not None else width
        name = config.model.entrypoint or config.model.name
        source = (f"{key} in {config.model.pretrained}/config.json" if config.model.pretrained
                  else key)
        kind = info.schema.field(column).type if info.schema is not None else None
        if length <= limit:
            fix = (f"data.pad_to_multiple_of={multiple} rounds them up to {width} tokens: set it "
                   f"to a divisor of {limit} or null")
        else:
            fit = limit - limit % multiple if multiple else limit
            fix = f"shorten column '{column}' to at most {fit} tokens"
            if config.data.label is None and kind is not None and pa.types.is_fixed_size_list(kind):
                # `prepare text --seq-len N` writes windows of N + 1 tokens; forward(x) takes the
                # first N of them.
                seq_len = limit - (length - (kind.list_size - 1))
                if seq_len >= 1:
                    fix = f"write shorter windows (`orchestrator prepare text --seq-len {seq_len}`)"
        raise ConfigError(f"data in {info.path}: column '{column}' gives the model sequences of "
                          f"{length} tokens, but model '{name}' ({type(model).__name__}) has "
                          f"{limit} positions ({source}): {fix}, or use a model with {key} >= "
                          f"{width + configured - limit}")
