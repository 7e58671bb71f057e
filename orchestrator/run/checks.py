"""The driver's checks of the data and the model against the config, before Ray starts: what the data decides
(classes, steps for epochs), the label's type for the task, the model's build and call on the sample rows, and the
sequences against the model's positions. Each failure is one ConfigError naming the key and the fix."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from orchestrator.config import Config, with_values
from orchestrator.errors import ConfigError
from orchestrator.models.tasks import check_forward, task_parts
from orchestrator.models.zoo import check_model_build, check_model_options, position_limit
from orchestrator.run.memory_plan import GIB, estimate_bytes_per_rank, fsdp_advice
from pipelines.batches import collate_sample, padding_of
from pipelines.sources import DatasetInfo


@dataclass(frozen=True)
class RunChecks:
    """What the checks of one run found (plan.py keeps it): the config resolved for the data, the model input's
    width, one worker's memory budget and, when ddp would not fit it while fsdp would, the line saying so."""

    config: Config
    in_features: int | None
    memory_budget: tuple[float, str] | None
    advice: str | None


def check_run(config: Config, infos: Mapping[str, DatasetInfo]) -> RunChecks:
    """`resolve_for_data`, and the model's facts from the same build (on the meta device, built once)."""
    resolved, model = _resolve(config, infos)
    info = infos["train"]
    return RunChecks(resolved, in_features(resolved, info), worker_memory_budget(resolved),
                     model_state_advice(resolved, info, model))


def resolve_for_data(config: Config, infos: Mapping[str, DatasetInfo]) -> Config:
    """Fill in what the data decides: the number of classes and, when epochs are given, the step count. Also checks
    the model's options against its builder (the first driver step that may import the model zoo)."""
    return _resolve(config, infos)[0]


def _resolve(config: Config, infos: Mapping[str, DatasetInfo]) -> tuple[Config, Any]:
    """resolve_for_data's config, and the model the check built (None when it builds none: see check_model_call)."""
    check_model_options(config.model)
    train = infos["train"]
    if "val" in infos and infos["val"].feature_dim != train.feature_dim:
        raise ConfigError(f"data.val has {infos['val'].feature_dim} feature values per row but data.train has "
                          f"{train.feature_dim}: both splits must have the same columns")
    check_label(config, train)
    changes: dict[str, Any] = {}  # what the data decides, set at once below
    if config.model.num_classes is None:
        label = config.task.kind.label if config.task.kind else None
        outputs = 1 if label == "numbers" else train.num_classes
        if label == "numbers" and train.schema is not None:
            label_type = train.schema.field(config.data.label).type
            outputs = label_type.list_size if pa.types.is_fixed_size_list(label_type) else 1
        # A model given named inputs builds its own head (a Hugging Face config says num_labels, vocab_size).
        needed = config.model.inputs is None or label == "classes"
        if outputs < (2 if label == "classes" else 1) and needed:
            source = (f"'{config.data.label}' statistics" if config.data.label
                      else "the token column's vocab_size metadata")
            raise ConfigError(f"cannot infer the number of classes from {source}: set model.num_classes")
        changes["model.num_classes"] = outputs or None
    t = config.train
    rows_per_worker = train.num_rows // config.scaling.max_workers
    smallest = t.micro_batch_size if isinstance(t.micro_batch_size, int) else 1
    if rows_per_worker < smallest:
        raise ConfigError(f"data.train has {train.num_rows} rows, fewer than one micro-batch "
                          f"({smallest}) per worker: lower train.global_batch_size")
    if t.epochs is not None:
        per_worker_step = t.global_batch_size // config.scaling.max_workers
        steps = max(1, math.ceil(t.epochs * rows_per_worker / per_worker_step))
        # Config validation could not check the warmup against a step count only the data decides.
        if config.optim.warmup_steps >= steps:
            raise ConfigError(f"config key 'optim.warmup_steps': optim.warmup_steps={config.optim.warmup_steps} "
                              f"must be below the run's {steps} optimizer steps (train.epochs={t.epochs:g} over "
                              f"{train.num_rows} rows at global batch {t.global_batch_size}): lower "
                              "optim.warmup_steps or train longer")
        changes |= {"train.max_steps": steps, "train.epochs": None}
    resolved = with_values(config, changes)
    return resolved, check_model_call(resolved, train)


def check_label(config: Config, info: DatasetInfo) -> None:
    """The target column suits the task: integer classes, a fixed-size list of 0/1 labels, numbers to regress."""
    label, task = config.data.label, config.task
    if label is None or info.schema is None or task.kind is None or task.kind.label is None:
        return
    kind = info.schema.field(label).type
    value = kind.value_type if pa.types.is_fixed_size_list(kind) else kind
    numeric = pa.types.is_integer(value) or pa.types.is_floating(value) or pa.types.is_boolean(value)
    wanted = {"classes": pa.types.is_integer(kind),
              "multi-hot": pa.types.is_fixed_size_list(kind) and numeric,
              "numbers": numeric}[task.kind.label]
    if not wanted:
        need = {"classes": "integer class ids (for float targets use task.name=regression)",
                "multi-hot": "a fixed-size list of 0/1 values per row",
                "numbers": "numbers (or a fixed-size list of numbers)"}[task.kind.label]
        raise ConfigError(f"data.label '{label}' in {info.path} has type {kind}, but task {task.name} needs {need}")


def check_model_call(config: Config, info: DatasetInfo) -> Any:
    """The model builds with its options (on the meta device: no memory, no weights loaded; with model.pretrained,
    in its saved config's architecture), for every model; the sample rows' sequences fit its learned positions;
    with named inputs also: the sample rows convert to tensors, hold every input the model is given, and the
    model's forward takes them by name. Returns the model built (None when check_model_build builds none)."""
    call, named = None, config.model.inputs is not None
    batch = _sample_batch(config, info) if named or config.data.label is None else None
    if named and batch is not None:
        _, call, _ = task_parts(config)
        missing = [key for key in (call.inputs or {}).values() if key not in batch]
        if missing:
            raise ConfigError(f"config key 'model.inputs': {missing} are not in the batch, which has {sorted(batch)} "
                              "(a mask comes only with a variable-length token column)")
    # What the workers build with (spec["in_features"]), so that the driver's check sees the workers' model.
    model = check_model_build(config.model, in_features(config, info), config.model.num_classes, config.data.s3)
    if model is None:
        return None
    if call is not None:
        check_forward(model, call, config.model.entrypoint or config.model.name)
    if batch is not None:
        check_positions(config, info, model, batch)
    return model


def _sample_batch(config: Config, info: DatasetInfo) -> dict[str, Any] | None:
    """The sample rows collated as the workers collate them: by name for named inputs (a ConfigError naming the data
    when they cannot be), else token windows for forward(x) (None when they cannot be: the workers will say why)."""
    if info.sample is None:
        return None
    named = config.model.inputs is not None
    try:
        return collate_sample(info.sample, config.data, named=named)
    except ValueError as exc:
        if named:
            raise ConfigError(f"data in {info.path}: {exc}") from None
        return None


def check_positions(config: Config, info: DatasetInfo, model: Any, batch: dict[str, Any]) -> None:
    """The sample rows' token sequences fit the model's learned position table (GPT-2's n_positions, BERT's
    max_position_embeddings), padded as the workers pad them (data.pad_to_multiple_of): past it every worker fails
    with 'IndexError: index out of range in self', which Ray does not retry. ConfigError naming the longest real
    row, the table and the fix."""
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
    masks = ({g.column: g.mask for g in padding_of(info.sample.schema, config.data.features, config.data.label,
                                                   True).groups if g.mask is not None}
             if named is not None and info.sample is not None else {})
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


def in_features(config: Config, info: DatasetInfo) -> int | None:
    """Width of the classic model input; None for named inputs whose columns are not all fixed-width numbers."""
    if config.model.inputs is None and config.data.label is None:
        return info.feature_dim - 1  # token windows of seq_len + 1: the inputs and the next tokens shifted by one
    return info.feature_dim or None


def model_state_advice(config: Config, info: DatasetInfo, model: Any = None) -> str | None:
    """Before Ray starts: the line saying that `train.parallel=ddp` would not fit the model's state (parameters,
    gradients, optimizer state) in a worker while fsdp would (memory_plan.fsdp_advice), for the model the workers
    will build, counted on the meta device. None when ddp fits, fsdp would not help, or the budget is unknown."""
    if config.train.parallel != "ddp":
        return None
    budget = worker_memory_budget(config)
    if model is None:  # the one check_model_call built, when given
        model = check_model_build(config.model, in_features(config, info), config.model.num_classes, config.data.s3)
    if budget is None or model is None:
        return None
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer = "sgd_plain" if config.optim.name == "sgd" and config.optim.momentum == 0 else config.optim.name
    # auto: bf16 where the device supports it; fp32 is the larger of the transient gathered blocks.
    precision = "fp32" if config.train.precision == "auto" else config.train.precision
    world = config.scaling.min_workers  # the smallest group an elastic run may have must fit too
    if estimate_bytes_per_rank(n, world, "ddp", optimizer, precision)["total"] <= budget[0]:
        return None  # the usual case: no need to look for blocks
    from orchestrator.training.fsdp import find_blocks

    # Without blocks fsdp shards the whole model as one unit, which is gathered whole in compute.
    block = max((sum(p.numel() for p in b.parameters()) for b in find_blocks(model)), default=n)
    line = fsdp_advice(n, block, world, optimizer, precision, budget, defer_sync=config.train.fsdp.defer_sync)
    if line and config.train.micro_batch_size == "auto":  # refused with fsdp: say what replaces it
        line += (" --set train.micro_batch_size=<rows per worker>"
                 + (" --set train.memory_budget_gb=null" if config.train.memory_budget_gb is not None else "")
                 + " (auto cannot probe memory under fsdp)")
    return line


def worker_memory_budget(config: Config) -> tuple[float, str] | None:
    """(bytes, where the figure comes from) one worker may use: train.memory_budget_gb, else the driver's GPU memory
    (scaling.use_gpu; a driver without one cannot tell), else half this machine's RAM over the run's workers (the
    workers' own default, for workers that share one node as a local run's do)."""
    if config.train.memory_budget_gb is not None:
        return config.train.memory_budget_gb * GIB, f"train.memory_budget_gb={config.train.memory_budget_gb:g}"
    if config.scaling.use_gpu:
        import torch

        if not torch.cuda.is_available():
            return None
        return float(torch.cuda.get_device_properties(0).total_memory), "the GPU's memory"
    import psutil

    workers = config.scaling.max_workers
    return psutil.virtual_memory().total / 2 / workers, f"half this machine's RAM over {workers} workers"
