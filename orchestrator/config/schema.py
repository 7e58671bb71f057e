"""The config schema: the sections of what is trained (task, model, train, optim) and of the search (tune), and
`Config` with its cross-field checks, validated before Ray starts. The sections of how a run is placed, kept,
watched and billed are in run_sections.py; what every section is built on in base.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from orchestrator.config.base import _key_error, _Section, suggest
from orchestrator.config.batching import common_micro_batch, replica_micro_batches, split_batch
from orchestrator.config.run_sections import (
    AutopilotConfig,
    CheckpointConfig,
    ClusterConfig,
    CostConfig,
    FailureConfig,
    ScalingConfig,
    StorageConfig,
    TrackingConfig,
)
from orchestrator.config.space import parse_space
from pipelines.config import DataConfig

Precision = Literal["auto", "bf16", "fp16", "fp32"]


@dataclass(frozen=True)
class TaskKind:
    """What a built-in task (orchestrator/models/tasks.py) means to the driver: the validation metrics it reports, the
    one (with its mode) Tune and doctor rank by unless tune.metric says otherwise, and what `data.label` must hold."""

    metrics: tuple[str, ...]
    metric: str
    mode: Literal["max", "min"]
    label: Literal["classes", "multi-hot", "numbers"] | None  # None: the next tokens of the token column


TASK_KINDS: dict[str, TaskKind] = {
    "classification": TaskKind(("val_loss", "val_accuracy", "val_top5_accuracy"), "val_accuracy", "max", "classes"),
    "multilabel": TaskKind(("val_loss", "val_accuracy", "val_f1"), "val_f1", "max", "multi-hot"),
    "regression": TaskKind(("val_loss", "val_mse", "val_rmse", "val_mae", "val_r2"), "val_rmse", "min", "numbers"),
    "causal_lm": TaskKind(("val_loss", "val_perplexity", "val_accuracy"), "val_loss", "min", None),
}
# A user's task ("module:Class") reports at least val_loss and is ranked by it.
USER_TASK = TaskKind(("val_loss",), "val_loss", "min", None)
MAX_SEED = 2**32 - 1  # numpy's global seed (set on every worker) takes no more


class ModelConfig(BaseModel):
    """A registered model by `name`, or a user's `entrypoint: "module:function"`; other keys are its kwargs. A kwarg
    set to null is left out (the builder's default applies): `--set model.hidden=null` drops a file's option."""

    model_config = ConfigDict(extra="allow")
    # kwarg -> where load_config found it: the config file's path or "--set" (for error messages only).
    _origins: dict[str, str] = PrivateAttr(default_factory=dict)

    name: str = Field("mlp", description="Registered model: mlp, cnn, gpt.")
    entrypoint: str | None = Field(None, description="'module:function' building a torch Module (a Hugging Face "
                                   "`transformers` model too); overrides name. It is called with the options "
                                   "below, plus in_features and num_classes where its signature takes them.")
    num_classes: int | None = Field(None, ge=1, description="Outputs: classes (null = from the label column's "
                                    "max), labels (multilabel), targets (regression: 1 per target column).")
    inputs: list[str] | dict[str, str] | None = Field(
        None, json_schema_extra={"accepts": "a list of argument names, {argument: column}, or null"},
        description="The model's forward arguments, filled by name from the batch: [input_ids, "
        "attention_mask] (argument = column), or {argument: column}. A variable-length token column also gives "
        "`attention_mask`. null: forward(x) with the feature columns concatenated into one float vector.")
    pretrained: str | None = Field(None, description="Directory or s3://prefix saved with save_pretrained: the "
                                   "built Hugging Face model's weights are loaded from it (fetched once per node).")

    @property
    def input_map(self) -> dict[str, str] | None:
        """{forward argument: batch key}, or None for the classic forward(x)."""
        if self.inputs is None:
            return None
        return dict(self.inputs) if isinstance(self.inputs, dict) else {name: name for name in self.inputs}

    @property
    def kwargs(self) -> dict[str, Any]:
        """The model's own options, checked against its builder's signature by the driver (models.py), so that
        loading a config imports neither torch nor the model zoo."""
        return {key: value for key, value in (self.model_extra or {}).items() if value is not None}

    def __eq__(self, other: object) -> bool:
        # pydantic's, less _origins: a config rebuilt from its dict (in a worker, a trial) is the same config.
        if not isinstance(other, BaseModel):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__ and self.model_extra == other.model_extra

    @property
    def origins(self) -> dict[str, str]:
        """{kwarg: its config file, or "--set"} for a config from load_config; {} otherwise."""
        return dict(self._origins)


class TaskConfig(_Section):
    """What is learned: the loss, the validation metrics and what Tune ranks by (orchestrator/models/tasks.py)."""

    name: str | None = Field(None, description="classification | multilabel | regression | causal_lm | "
                             "'module:Class'; null: classification with data.label, causal_lm without.")
    loss: Literal["task", "model"] = Field("task", description="task: the task's loss on the model's logits; "
                                           "model: the loss the model returns when given `labels` (Hugging Face).")

    @property
    def kind(self) -> TaskKind | None:
        """The built-in task's meaning; None for a user's own task (`module:Class`) or before the name is resolved."""
        return TASK_KINDS.get(self.name or "")


class FSDPConfig(_Section):
    """train.parallel=fsdp: how the model is cut into sharded units (training/fsdp.py)."""

    blocks: list[str] | None = Field(None, description="Class names of the blocks sharded one by one (e.g. "
                                     "[MyBlock]); null: a Hugging Face model's _no_split_modules or the built-in "
                                     "gpt's Block, else the whole model as one unit (no memory saved in compute).")
    defer_sync: bool = Field(False, description="With grad_accum_steps > 1, reduce-scatter gradients once per "
                             "optimizer step instead of once per micro-batch: less communication, but each rank "
                             "holds unsharded gradients (the whole model's size) until the step.")


class TrainConfig(_Section):
    """Length of training, batch arithmetic, precision and cadence of logging/eval."""

    max_steps: int | None = Field(300, ge=1, description="Optimizer steps; or set epochs instead.")
    epochs: float | None = Field(None, gt=0, description="Passes over the training set (converted to steps).")
    global_batch_size: int = Field(128, ge=1, description="Samples per optimizer step, summed over all workers.")
    micro_batch_size: int | Literal["auto"] | None = Field(
        None, json_schema_extra={"accepts": "a count, auto, or null to derive it"},
        description="Samples per forward pass per worker; derived, or `auto`: the largest that fits memory.",
    )
    grad_accum_steps: int | None = Field(None, ge=1, description="Micro-batches per optimizer step; derived.")
    precision: Precision = Field("auto", description="auto picks bf16 where the device supports it.")
    compile: bool = Field(False, description="Wrap the model in torch.compile (falls back to eager on failure).")
    flush_denormal: bool = Field(True, description="On CPU, treat subnormal floats as zero: late in training tiny "
                                 "gradients and optimizer moments make float math on them several times slower.")
    torch_threads: int | None = Field(None, ge=1, description="torch's intra-op threads per worker; null: Ray's "
                                      "default, the worker's CPUs (scaling.cpus_per_worker).")
    memory_budget_gb: float | None = Field(
        None, gt=0, description="CPU only, with micro_batch_size=auto: memory one worker may use for the model, "
        "its gradients, optimizer state and activations (default: half the node's RAM over its workers)."
    )
    peak_tflops: float | None = Field(None, gt=0, description="Peak TFLOP/s of one device in the precision the "
                                      "run uses, for MFU on devices missing from the built-in tables (CPUs, new "
                                      "GPUs).")
    tf32: bool = Field(False, description="GPU only: fp32 matrix products and convolutions on TF32 tensor cores "
                       "(Ampere and later: about 8x fp32's peak, a 10-bit mantissa, so slightly different math). "
                       "Off: fp32 stays fp32 (cuDNN's convolutions included, which torch otherwise runs in TF32).")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seeds the model init, the data order and the workers' RNGs.")
    max_nonfinite_steps: int = Field(10, ge=0, description="Steps with a NaN/inf loss or gradient that are skipped "
                                     "(no update) before training stops with an error.")
    log_every: int = Field(25, ge=1, description="Steps between reports (each report is a barrier; keep it >= 10).")
    eval_every: int | None = Field(100, ge=1, description="Steps between validation passes; also at the end.")
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: every worker holds the whole model, its gradients and optimizer state; fsdp: "
        "they are sharded across the workers (FSDP2), for models bigger than one device.")
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig,  # type: ignore[arg-type]
                             description="With parallel=fsdp: how the model is cut into sharded units.")
    sync: Literal["ddp", "local_sgd"] = Field(
        "ddp", description="ddp: all-reduce gradients every step; local_sgd: each worker takes sync_every "
        "optimizer steps alone, then the workers average their parameters (~sync_every x less communication)."
    )
    sync_every: int | None = Field(None, ge=1, description="local_sgd: optimizer steps between parameter "
                                   "averages (null = 8). Only these steps and the last average the replicas: "
                                   "evaluation and checkpoints between two see their average and leave each replica "
                                   "as it was.")
    outer_lr: float | None = Field(None, gt=0, description="local_sgd: step size on the averaged change since the "
                                   "last sync (null = 1.0, plain averaging; 0.7 with outer_momentum, DiLoCo's).")
    outer_momentum: float | None = Field(None, gt=0, lt=1, description="local_sgd: Nesterov momentum of the outer "
                                         "step on the averaged change (DiLoCo uses 0.9); null = none.")

    @field_validator("micro_batch_size")
    @classmethod
    def _positive_micro_batch(cls, value: int | str | None) -> int | str | None:
        # Checked here, not by Field(ge=1): the bound would apply to the union and report against its members.
        if isinstance(value, int) and value < 1:
            raise ValueError(f"must be at least 1, got {value}: set a positive size, auto, or null to derive it")
        return value

    @model_validator(mode="before")
    @classmethod
    def _epochs_replace_steps(cls, data: Any) -> Any:
        # Asking for epochs means "not the default max_steps"; both given explicitly is a contradiction.
        if isinstance(data, dict) and data.get("epochs") is not None and "max_steps" not in data:
            data = {**data, "max_steps": None}
        return data

    @model_validator(mode="after")
    def _one_length(self) -> TrainConfig:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of train.max_steps and train.epochs")
        # By value, not by fields_set: a saved full config (nulls included) must load again.
        dead = [k for k in ("sync_every", "outer_lr", "outer_momentum") if getattr(self, k) is not None]
        if self.sync == "ddp" and dead:
            raise ValueError(f"train.{dead[0]} has no effect with train.sync=ddp; remove it or set "
                             "train.sync=local_sgd")
        if self.parallel == "fsdp" and self.sync == "local_sgd":
            raise ValueError("train.sync=local_sgd averages whole replicas and cannot run on sharded parameters: "
                             "use train.parallel=ddp with local_sgd, or train.sync=ddp with fsdp")
        if self.parallel == "fsdp" and self.compile:
            raise ValueError("train.compile=true does not combine with train.parallel=fsdp yet: set "
                             "train.compile=false (or train.parallel=ddp)")
        if self.parallel == "fsdp" and self.micro_batch_size == "auto":
            raise ValueError("train.micro_batch_size=auto cannot probe memory under train.parallel=fsdp: set "
                             "train.micro_batch_size to a number (or train.parallel=ddp)")
        if self.parallel == "ddp" and self.fsdp != FSDPConfig():
            raise ValueError("train.fsdp has no effect with train.parallel=ddp; remove it or set train.parallel=fsdp")
        return self

    @property
    def local_sgd(self) -> tuple[int, float, float | None]:
        """(sync_every, outer_lr, outer_momentum) with their defaults."""
        outer_lr = self.outer_lr if self.outer_lr is not None else (0.7 if self.outer_momentum else 1.0)
        return self.sync_every or 8, outer_lr, self.outer_momentum


class OptimConfig(_Section):
    name: Literal["adamw", "sgd"] = Field("adamw", description="adamw, or sgd (Nesterov momentum).")
    lr: float = Field(3.0e-3, gt=0, description="Peak learning rate, reached at the end of the warmup.")
    weight_decay: float = Field(0.01, ge=0, description="Weight decay, given to the optimizer as is.")
    momentum: float | None = Field(None, ge=0, lt=1, description="SGD only (default 0.9).")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup from 0 to lr.")
    schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay after the warmup, indexed by optimizer step at a fixed global batch (i.e. by "
        "samples), so a resize or another micro-batch does not bend it.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final lr as a fraction of lr (cosine/linear).")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the global gradient norm; null = no clip.")

    @model_validator(mode="after")
    def _no_dead_options(self) -> OptimConfig:
        if self.name != "sgd" and self.momentum is not None:
            raise ValueError(f"optim.momentum has no effect with optim.name={self.name}; remove it or use sgd")
        if self.schedule == "constant" and self.min_lr_ratio:
            raise ValueError("optim.min_lr_ratio has no effect with optim.schedule=constant; remove it")
        return self


class TuneConfig(_Section):
    """`orchestrator tune`: a search space over dotted config keys; each trial is a full training run."""

    space: dict[str, Any] = Field(default_factory=dict, description="Dotted key -> {loguniform|uniform|randint: "
                                  "[low, high]} or {choice|grid: [values]}, e.g. optim.lr: {loguniform: [1e-4, 0.1]}.")
    metric: str | None = Field(None, description="A metric the training loop reports; its last value ranks "
                               "trials. null: the task's (val_accuracy, val_f1, val_rmse, val_loss).")
    mode: Literal["max", "min"] | None = Field(None, description="null: the task's for its metric; else max for "
                                               "accuracy, F1, R² and throughput, min for the rest.")
    num_samples: int = Field(8, ge=1, description="Trials to sample (a grid is expanded once per sample).")
    scheduler: Literal["asha", "fifo", "none"] = Field("asha", description="asha stops weak trials early; "
                                                       "fifo/none runs every trial to the end.")
    grace_period: int | None = Field(None, ge=1, description="ASHA: steps every trial runs before it may be "
                                     "stopped; null = 50.")
    reduction_factor: float | None = Field(None, gt=1, description="ASHA: keep the top 1/reduction_factor at "
                                           "each rung; null = 3.")
    searcher: Literal["random", "optuna"] = Field("random", description="random sampling, or Optuna's TPE.")
    max_concurrent_trials: int | None = Field(None, ge=1, description="An upper bound; at most what the "
                                         "cluster holds: (CPUs - 1) / CPUs per trial, and GPUs / workers per trial "
                                         "with scaling.use_gpu.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Seed of the searcher's sampling, for a "
                             "repeatable study.")
    rank_by: Literal["metric", "metric_per_dollar"] = Field(
        "metric", description="Pick the best trial by its metric, or by metric per dollar of its run (needs a "
        "priced cost section and a metric to maximise).")

    @field_validator("space", mode="before")
    @classmethod
    def _parse_space(cls, value: Any) -> Any:
        return parse_space(value, Config) if isinstance(value, dict) else value

    @property
    def asha(self) -> tuple[int, float]:
        """(grace_period, reduction_factor) with their defaults."""
        return self.grace_period or 50, self.reduction_factor or 3.0

    @model_validator(mode="after")
    def _no_dead_options(self) -> TuneConfig:
        # By value, not by fields_set: a saved full config (nulls included) must load again.
        dead = [k for k in ("grace_period", "reduction_factor") if getattr(self, k) is not None]
        if self.scheduler != "asha" and dead:
            raise ValueError(f"tune.{dead[0]} has no effect with tune.scheduler={self.scheduler}; "
                             "remove it or use asha")
        return self


class Config(_Section):
    """Everything one experiment needs; see examples/*.yaml."""

    experiment: str = Field("digits-mlp", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
                            description="Begins each run's name, its directory's and MLflow run's (<experiment>-"
                            "...-<YYYYmmdd-HHMMSS>), and a study's (<experiment>-tune); --resume finds its latest run.")
    # The sections' descriptions head their part of docs/config.md and of `show-config --explain` (reference.py).
    model: ModelConfig = Field(default_factory=ModelConfig, description="The model: a built-in one by name, or your "
                               "own builder; any other key is an option of the builder (e.g. hidden for mlp).")
    task: TaskConfig = Field(default_factory=TaskConfig,  # type: ignore[arg-type]
                             description="What is learned: the loss, the validation metrics, what Tune and doctor "
                             "rank by. `task: regression` is short for `task: {name: regression}`.")
    data: DataConfig = Field(default_factory=DataConfig,  # type: ignore[arg-type]
                             description="The Parquet data and how it streams into the workers (docs/data.md).")
    train: TrainConfig = Field(default_factory=TrainConfig,  # type: ignore[arg-type]
                               description="Length of training, batch arithmetic (global = micro-batch x "
                               "accumulation x workers: give any two), precision, cadence, parallel mode.")
    optim: OptimConfig = Field(default_factory=OptimConfig,  # type: ignore[arg-type]
                               description="Optimizer and learning-rate schedule: linear warmup, then decay.")
    scaling: ScalingConfig = Field(default_factory=ScalingConfig,  # type: ignore[arg-type]
                                   description="The Ray Train worker group: how many workers, on what.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig,  # type: ignore[arg-type]
                                   description="The local Ray cluster a command starts when given no --address: "
                                   "kept warm for the next command or not.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig,  # type: ignore[arg-type]
                                         description="When checkpoints are written and how many are kept "
                                         "(docs/guarantees.md).")
    storage: StorageConfig = Field(default_factory=StorageConfig,  # type: ignore[arg-type]
                                   description="Where runs, checkpoints and studies are stored.")
    failure: FailureConfig = Field(default_factory=FailureConfig,  # type: ignore[arg-type]
                                   description="Restarts after a worker, a node or a preempted node is lost.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig,  # type: ignore[arg-type]
                                     description="MLflow: where runs are logged (docs/metrics.md).")
    tune: TuneConfig = Field(default_factory=TuneConfig,  # type: ignore[arg-type]
                             description="`orchestrator tune`: the search space over dotted config keys and how "
                             "trials are scheduled and ranked (docs/tune.md).")
    cost: CostConfig = Field(default_factory=CostConfig,  # type: ignore[arg-type]
                             description="The cost ledger's price: a node type of cluster/prices.yaml or a price "
                             "per node-hour; unpriced, only node-hours are logged (docs/figures.md).")
    autopilot: AutopilotConfig = Field(default_factory=AutopilotConfig,  # type: ignore[arg-type]
                                       description="Measure the speed settings on the run's first steps and "
                                       "train with the fastest (`orchestrator train --autopilot`).")

    @field_validator("task", mode="before")
    @classmethod
    def _task_shorthand(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value  # task: regression

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        self._resolve_task()
        if self.train.precision == "fp16" and not self.scaling.use_gpu:
            raise ValueError("train.precision=fp16 needs a GPU (scaling.use_gpu=true); on CPU use bf16 or fp32")
        if self.train.tf32 and not self.scaling.use_gpu:
            raise _key_error(("train", "tf32"), "train.tf32=true needs a GPU (scaling.use_gpu=true): CPUs have no "
                             "TF32; set it to false", True)
        self.autopilot.check_allowed(self.scaling.use_gpu, self.train.precision)
        warmup, steps = self.optim.warmup_steps, self.train.max_steps
        # With epochs, the step count is known only with the data: launch.resolve_for_data checks it then.
        if steps is not None and warmup >= steps:
            raise _key_error(("optim", "warmup_steps"), f"optim.warmup_steps={warmup} must be below train.max_steps="
                            f"{steps}, or the LR never reaches optim.lr nor decays: lower optim.warmup_steps or "
                            "raise train.max_steps", warmup)
        self._derive_batch()
        if self.failure.mode == "replicas":
            self._check_replicas()
        return self

    def _check_replicas(self) -> None:
        """failure.mode=replicas (torchft replica groups, one worker each): what it cannot run with is refused here,
        before any cluster resource is taken."""
        t, s = self.train, self.scaling
        refused = (
            (s.elastic, f"needs a fixed scaling.num_workers (Ray replaces a failed replica at the same size), got "
                        f"{s.num_workers}: set scaling.num_workers to a count or failure.mode=restart"),
            (not s.elastic and s.max_workers < 2, "needs scaling.num_workers >= 2 (one replica per worker; a lone "
                                                  "replica has no peer to keep stepping): raise it or set "
                                                  "failure.mode=restart"),
            (t.parallel == "fsdp", "keeps a whole model in every replica: set train.parallel=ddp or "
                                   "failure.mode=restart"),
            (t.sync == "local_sgd", "commits every step by quorum: set train.sync=ddp or failure.mode=restart"),
            (t.micro_batch_size == "auto", "needs a fixed train.micro_batch_size (a survivor's share of the global "
                                           "batch is counted in micro-batches): set it or failure.mode=restart"),
            (self.autopilot.enabled, "does not combine with the autopilot yet: set autopilot.enabled=false or "
                                     "failure.mode=restart"),
            # checkpoint.every (steps or the default auto) gives way to the last step alone; a time cadence the
            # user asked for is refused rather than silently dropped.
            (self.checkpoint.every_minutes is not None,
             "saves only the last step (the state lives in the live replicas, and a checkpoint is a barrier every "
             "replica must reach): remove checkpoint.every_minutes or set failure.mode=restart"),
        )
        for bad, why in refused:
            if bad:
                raise _key_error(("failure", "mode"), f"failure.mode=replicas {why}", "replicas")
        for participants in range(1, s.max_workers + 1):
            try:
                replica_micro_batches(t.global_batch_size, t.micro_batch_size, participants)  # type: ignore[arg-type]
            except ValueError as exc:
                raise _key_error(("failure", "mode"), str(exc), "replicas") from None

    def _resolve_task(self) -> None:
        task, label = self.task, self.data.label
        if task.name is None:
            object.__setattr__(task, "name", "classification" if label else "causal_lm")
        if task.kind is None and ":" not in task.name:
            raise _key_error(("task", "name"), f"unknown task '{task.name}'{suggest(task.name, TASK_KINDS)}; "
                             f"valid: {sorted(TASK_KINDS)} or 'module:Class'", task.name)
        kind = task.kind or USER_TASK
        if self.tune.metric is None:
            object.__setattr__(self.tune, "metric", kind.metric)
            object.__setattr__(self.tune, "mode", self.tune.mode or kind.mode)
        if task.kind is not None and task.kind.label is None and label:
            raise _key_error(("task", "name"), f"{task.name} predicts the next token of the token column, but "
                             f"data.label={label} is set: set data.label to null", task.name)
        if kind.label is not None and not label:
            raise _key_error(("data", "label"), f"task {task.name} needs a target column: set data.label",
                             label)
        if kind.label == "classes" and self.model.num_classes == 1:
            raise _key_error(("model", "num_classes"), f"{task.name} needs at least 2 classes", 1)
        if task.loss == "model" and self.model.inputs is None:
            raise _key_error(("task", "loss"), "task.loss=model passes `labels` to the model by name: set "
                             "model.inputs to its other arguments", task.loss)
        missing = [c for c in (self.model.input_map or {}).values()
                   if c not in self.data.features and c != "attention_mask" and not c.endswith("_mask")]
        if missing:
            raise _key_error(("model", "inputs"), f"{missing} are not among data.features {self.data.features}: "
                             "add the columns to data.features, or fix model.inputs", self.model.inputs)

    def _derive_batch(self) -> None:
        """global = micro x accum x workers (batching.py): given global and one of the others, derive the third."""
        t, s = self.train, self.scaling
        if ("global_batch_size" not in t.model_fields_set and isinstance(t.micro_batch_size, int)
                and t.grad_accum_steps):
            object.__setattr__(t, "global_batch_size", t.micro_batch_size * t.grad_accum_steps * s.max_workers)
        for size in s.world_sizes:
            if t.global_batch_size % size:
                raise ValueError(f"train.global_batch_size={t.global_batch_size} is not divisible by "
                                 f"scaling.num_workers={size}" + (" (every world size of an elastic group must "
                                                                  "divide it)" if s.elastic else ""))
        if t.micro_batch_size == "auto":
            if t.grad_accum_steps is not None:
                raise ValueError("train.grad_accum_steps is derived when micro_batch_size=auto; remove it")
            return  # each worker measures what fits, then derives the accumulation (training/micro_batch.py)
        if t.memory_budget_gb is not None:
            raise ValueError("train.memory_budget_gb has no effect unless train.micro_batch_size=auto")
        if not s.elastic:
            micro, accum = split_batch(t.global_batch_size, s.max_workers, t.micro_batch_size, t.grad_accum_steps)
        else:
            # An elastic group keeps the micro-batch and the global batch; each world size gets its own accumulation
            # (derived again in the worker). The resolved accumulation is the one at max.
            micro = t.micro_batch_size or common_micro_batch(t.global_batch_size, s.world_sizes)
            for size in s.world_sizes:
                if (t.global_batch_size // size) % micro:
                    raise ValueError(f"train.global_batch_size={t.global_batch_size} over {size} workers is not a "
                                     f"multiple of micro_batch_size={micro}: pick a micro-batch dividing the "
                                     f"per-worker batch at every size in scaling.num_workers={s.num_workers}, or "
                                     "leave it unset")
            micro, accum = split_batch(t.global_batch_size, s.max_workers, micro)
            if t.grad_accum_steps is not None and t.grad_accum_steps != accum:
                raise ValueError("train.grad_accum_steps is derived for each world size when scaling.num_workers "
                                 "is [min, max]; remove it")
        # Bypass validate_assignment: the pair is only consistent once both are set.
        object.__setattr__(t, "micro_batch_size", micro)
        object.__setattr__(t, "grad_accum_steps", accum)
