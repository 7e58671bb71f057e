"""The driver's checks of the data and the model against the config, before Ray starts: the
model's options, what the data decide (classes, steps for epochs), the label's type for the task,
the model's build, call and positions on the sample rows (model_checks.py), and whether ddp fits
a worker. Each failure is one ConfigError naming the key and the fix. The plan runs them once, on
its data inspection."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from orchestrator.config import Config, with_values
from orchestrator.errors import ConfigError
from orchestrator.models.inputs import in_features
from orchestrator.run.memory_plan import GIB, estimate_bytes_per_rank, fsdp_advice
from orchestrator.run.model_checks import check_model, check_model_build, check_model_options
from pipelines.batches import Sample, inspect_sample
from pipelines.sources import DatasetInfo


@dataclass(frozen=True)
class RunChecks:
    """What the checks of one run found (plan.py keeps it): the config resolved for the data, the
    model input's width, one worker's memory budget and, when ddp would not fit it while fsdp
    would, the line saying so."""

    config: Config
    in_features: int | None
    memory_budget: tuple[float, str] | None
    advice: str | None


def check_run(config: Config, infos: Mapping[str, DatasetInfo]) -> RunChecks:
    """`resolve_for_data`, and the model's facts from the same build (on the meta device, built
    once)."""
    return check_inspected(config, infos, _sample(config, infos))


def check_inspected(config: Config, infos: Mapping[str, DatasetInfo],
                    sample: Sample | None) -> RunChecks:
    """check_run on the plan's data inspection (`sample`: the train sample as
    pipelines.datasets.inspect_run collated it)."""
    resolved, facts = _resolve(config, infos, sample)
    return RunChecks(resolved, facts.in_features, worker_memory_budget(resolved),
                     _state_advice(resolved, facts.model))


def resolve_for_data(config: Config, infos: Mapping[str, DatasetInfo]) -> Config:
    """Fill in what the data decides: the number of classes and, when epochs are given, the step
    count. Also checks the model's options against its builder (the first driver step that may
    import the model zoo)."""
    return _resolve(config, infos, _sample(config, infos))[0]


def _sample(config: Config, infos: Mapping[str, DatasetInfo]) -> Sample | None:
    """The train sample collated where the model's checks read it, as inspect_run collates it for
    the plan."""
    named, rows = config.model.inputs is not None, infos["train"].sample
    wanted = rows is not None and (named or config.data.label is None)
    return inspect_sample(rows, config.data, named) if wanted else None


def _resolve(config: Config, infos: Mapping[str, DatasetInfo],
             sample: Sample | None) -> tuple[Config, Any]:
    """resolve_for_data's config, and the model's facts from the check
    (model_checks.check_model)."""
    check_model_options(config.model)
    train = infos["train"]
    if "val" in infos and infos["val"].feature_dim != train.feature_dim:
        raise ConfigError(f"data.val has {infos['val'].feature_dim} feature values per row but "
                          f"data.train has {train.feature_dim}: both splits must have the same "
                          "columns")
    check_label(config, train)
    changes: dict[str, Any] = {}  # what the data decides, set at once below
    if config.model.num_classes is None:
        label = config.task.kind.label if config.task.kind else None
        outputs = 1 if label == "numbers" else train.num_classes
        if label == "numbers" and train.schema is not None:
            label_type = train.schema.field(config.data.label).type
            outputs = label_type.list_size if pa.types.is_fixed_size_list(label_type) else 1
        # A model given named inputs builds its own head (a Hugging Face config says num_labels,
        # vocab_size).
        needed = config.model.inputs is None or label == "classes"
        if outputs < (2 if label == "classes" else 1) and needed:
            source = (f"'{config.data.label}' statistics" if config.data.label
                      else "the token column's vocab_size metadata")
            raise ConfigError(f"cannot infer the number of classes from {source}: set "
                              "model.num_classes")
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
            raise ConfigError("config key 'optim.warmup_steps': "
                              f"optim.warmup_steps={config.optim.warmup_steps} must be below the "
                              f"run's {steps} optimizer steps (train.epochs={t.epochs:g} over "
                              f"{train.num_rows} rows at global batch {t.global_batch_size}): "
                              "lower optim.warmup_steps or train longer")
        changes |= {"train.max_steps": steps, "train.epochs": None}
    resolved = with_values(config, changes)
    return resolved, check_model(resolved, train, sample)


def check_label(config: Config, info: DatasetInfo) -> None:
    """The target column suits the task: integer classes, a fixed-size list of 0/1 labels,
    numbers to regress."""
    label, task = config.data.label, config.task
    if label is None or info.schema is None or task.kind is None or task.kind.label is None:
        return
    kind = info.schema.field(label).type
    value = kind.value_type if pa.types.is_fixed_size_list(kind) else kind
    numeric = (pa.types.is_integer(value) or pa.types.is_floating(value)
               or pa.types.is_boolean(value))
    wanted = {"classes": pa.types.is_integer(kind),
              "multi-hot": pa.types.is_fixed_size_list(kind) and numeric,
              "numbers": numeric}[task.kind.label]
    if not wanted:
        need = {"classes": "integer class ids (for float targets use task.name=regression)",
                "multi-hot": "a fixed-size list of 0/1 values per row",
                "numbers": "numbers (or a fixed-size list of numbers)"}[task.kind.label]
        raise ConfigError(f"data.label '{label}' in {info.path} has type {kind}, but task "
                          f"{task.name} needs {need}")


def model_state_advice(config: Config, info: DatasetInfo, model: Any = None) -> str | None:
    """Before Ray starts: the line saying that `train.parallel=ddp` would not fit the model's
    state (parameters, gradients, optimizer state) in a worker while fsdp would
    (memory_plan.fsdp_advice), for the model the workers will build, counted on the meta device.
    None when ddp fits, fsdp would not help, or the budget is unknown."""
    if config.train.parallel != "ddp":
        return None
    if model is None:  # the one check_model built, when given
        model = check_model_build(config.model, in_features(config, info), config.model.num_classes,
                                  config.data.s3)
    return _state_advice(config, model)


def _state_advice(config: Config, model: Any) -> str | None:
    """model_state_advice for the model the check built (None: it built none, and no advice is
    given)."""
    if config.train.parallel != "ddp":
        return None
    budget = worker_memory_budget(config)
    if budget is None or model is None:
        return None
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    plain_sgd = config.optim.name == "sgd" and config.optim.momentum == 0
    optimizer = "sgd_plain" if plain_sgd else config.optim.name
    # auto: bf16 where the device supports it; fp32 is the larger of the transient gathered blocks.
    precision = "fp32" if config.train.precision == "auto" else config.train.precision
    world = config.scaling.min_workers  # the smallest group an elastic run may have must fit too
    if estimate_bytes_per_rank(n, world, "ddp", optimizer, precision)["total"] <= budget[0]:
        return None  # the usual case: no need to look for blocks
    from orchestrator.training.fsdp import find_blocks

    # Without blocks fsdp shards the whole model as one unit, which is gathered whole in compute.
    block = max((sum(p.numel() for p in b.parameters()) for b in find_blocks(model)), default=n)
    line = fsdp_advice(n, block, world, optimizer, precision, budget,
                       defer_sync=config.train.fsdp.defer_sync)
    if line and config.train.micro_batch_size == "auto":  # refused with fsdp: say what replaces it
        line += (" --set train.micro_batch_size=<rows per worker>"
                 + (" --set train.memory_budget_gb=null"
                    if config.train.memory_budget_gb is not None else "")
                 + " (auto cannot probe memory under fsdp)")
    return line


def worker_memory_budget(config: Config) -> tuple[float, str] | None:
    """(bytes, where the figure comes from) one worker may use: train.memory_budget_gb, else the
    driver's GPU memory (scaling.use_gpu; a driver without one cannot tell), else half this
    machine's RAM over the run's workers (the workers' own default, for workers that share one
    node as a local run's do)."""
    if config.train.memory_budget_gb is not None:
        budget = config.train.memory_budget_gb
        return budget * GIB, f"train.memory_budget_gb={budget:g}"
    if config.scaling.use_gpu:
        import torch

        if not torch.cuda.is_available():
            return None
        return float(torch.cuda.get_device_properties(0).total_memory), "the GPU's memory"
    import psutil

    workers = config.scaling.max_workers
    half = psutil.virtual_memory().total / 2
    return half / workers, f"half this machine's RAM over {workers} workers"
