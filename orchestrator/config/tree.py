"""`Config`, the whole tree: its sections in place (each in the file of its role: model.py,
task.py, train.py, cluster.py, resilience.py, tracking.py; the data's in pipelines/config.py) and
the checks across them, validated before Ray starts. The tune section is here too: its search
space names keys of the whole tree."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from orchestrator.config.base import _key_error, _Section, suggest
from orchestrator.config.batching import common_micro_batch, replica_micro_batches, split_batch
from orchestrator.config.cluster import ClusterConfig, ScalingConfig
from orchestrator.config.model import ModelConfig
from orchestrator.config.resilience import CheckpointConfig, FailureConfig, StorageConfig
from orchestrator.config.space import parse_space
from orchestrator.config.task import TASK_KINDS, USER_TASK, TaskConfig
from orchestrator.config.tracking import CostConfig, TrackingConfig
from orchestrator.config.train import MAX_SEED, AutopilotConfig, OptimConfig, TrainConfig
from pipelines.config import DataConfig


class TuneConfig(_Section):
    """`orchestrator tune`: a search space over dotted config keys; each trial is a full training
    run."""

    space: dict[str, Any] = Field(default_factory=dict,
                                  description="Dotted key -> {loguniform|uniform|randint: "
                                              "[low, high]} or {choice|grid: [values]}, "
                                              "e.g. optim.lr: {loguniform: [1e-4, 0.1]}.")
    metric: str | None = Field(None, description="A metric the training loop reports; its last "
                               "value ranks trials. null: the task's (val_accuracy, val_f1, "
                               "val_rmse, val_loss).")
    mode: Literal["max", "min"] | None = Field(None,
                                               description="null: the task's for its metric; "
                                                           "else max for accuracy, F1, R² "
                                                           "and throughput, min for the rest.")
    num_samples: int = Field(8, ge=1, description="Trials to sample (a grid is expanded once per "
                                                  "sample).")
    scheduler: Literal["asha", "fifo", "none"] = Field("asha",
                                                       description="asha stops weak trials "
                                                                   "early; fifo/none runs "
                                                                   "every trial to the end.")
    grace_period: int | None = Field(None, ge=1,
                                     description="ASHA: steps every trial runs before "
                                                 "it may be stopped; null = 50.")
    reduction_factor: float | None = Field(None, gt=1,
                                           description="ASHA: keep the top 1/reduction_factor "
                                                       "at each rung; null = 3.")
    searcher: Literal["random", "optuna"] = Field("random",
                                                  description="random sampling, or Optuna's TPE.")
    max_concurrent_trials: int | None = Field(None, ge=1,
                                              description="An upper bound; at most what the "
                                                          "cluster holds: (CPUs - 1) / CPUs "
                                                          "per trial, and GPUs / workers "
                                                          "per trial with scaling.use_gpu.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED,
                             description="Seed of the searcher's sampling, for a repeatable study.")
    rank_by: Literal["metric", "metric_per_dollar"] = Field(
        "metric", description="Pick the best trial by its metric, or by metric per dollar of its "
        "run (needs a priced cost section and a metric to maximise).")

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
                            description="Begins each run's name, its directory's and MLflow run's "
                            "(<experiment>-...-<YYYYmmdd-HHMMSS>), and a study's "
                            "(<experiment>-tune); --resume finds its latest run.")
    # The sections' descriptions head their part of docs/config.md and of `show-config --explain`
    # (reference.py).
    model: ModelConfig = Field(default_factory=ModelConfig,
                               description="The model: a built-in one by name, or your "
                                           "own builder; any other key is an option of "
                                           "the builder (e.g. hidden for mlp).")
    task: TaskConfig = Field(default_factory=TaskConfig,  # type: ignore[arg-type]
                             description="What is learned: the loss, the validation metrics, what "
                             "Tune and doctor rank by. `task: regression` is short for `task: "
                             "{name: regression}`.")
    data: DataConfig = Field(default_factory=DataConfig,  # type: ignore[arg-type]
                             description="The Parquet data and how it streams into the workers "
                                         "(docs/data.md).")
    train: TrainConfig = Field(default_factory=TrainConfig,  # type: ignore[arg-type]
                               description="Length of training, batch arithmetic (global = "
                               "micro-batch x accumulation x workers: give any two), precision, "
                               "cadence, parallel mode.")
    optim: OptimConfig = Field(default_factory=OptimConfig,  # type: ignore[arg-type]
                               description="Optimizer and learning-rate schedule: linear warmup, "
                                           "then decay.")
    scaling: ScalingConfig = Field(default_factory=ScalingConfig,  # type: ignore[arg-type]
                                   description="The Ray Train worker group: how many workers, on "
                                               "what.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig,  # type: ignore[arg-type]
                                   description="The local Ray cluster a command starts when given "
                                   "no --address: kept warm for the next command or not.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig,  # type: ignore[arg-type]
                                         description="When checkpoints are written and how many "
                                         "are kept (docs/guarantees.md).")
    storage: StorageConfig = Field(default_factory=StorageConfig,  # type: ignore[arg-type]
                                   description="Where runs, checkpoints and studies are stored.")
    failure: FailureConfig = Field(default_factory=FailureConfig,  # type: ignore[arg-type]
                                   description="Restarts after a worker, a node or a preempted "
                                               "node is lost.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig,  # type: ignore[arg-type]
                                     description="MLflow: where runs are logged (docs/metrics.md).")
    tune: TuneConfig = Field(default_factory=TuneConfig,  # type: ignore[arg-type]
                             description="`orchestrator tune`: the search space over dotted config "
                             "keys and how trials are scheduled and ranked (docs/tune.md).")
    cost: CostConfig = Field(default_factory=CostConfig,  # type: ignore[arg-type]
                             description="The cost ledger's price: a node type of "
                             "cluster/prices.yaml or a price per node-hour; unpriced, only "
                             "node-hours are logged (docs/figures.md).")
    autopilot: AutopilotConfig = Field(default_factory=AutopilotConfig,  # type: ignore[arg-type]
                                       description="Measure the speed settings on the run's first "
                                       "steps and train with the fastest (`orchestrator train "
                                       "--autopilot`).")

    @field_validator("task", mode="before")
    @classmethod
    def _task_shorthand(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value  # task: regression

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        self._resolve_task()
        if self.train.precision == "fp16" and not self.scaling.use_gpu:
            raise ValueError("train.precision=fp16 needs a GPU (scaling.use_gpu=true); on CPU use "
                             "bf16 or fp32")
        if self.train.tf32 and not self.scaling.use_gpu:
            raise _key_error(("train", "tf32"), "train.tf32=true needs a GPU "
                             "(scaling.use_gpu=true): CPUs have no TF32; set it to false", True)
        self.autopilot.check_allowed(self.scaling.use_gpu, self.train.precision)
        warmup, steps = self.optim.warmup_steps, self.train.max_steps
        # With epochs, the step count is known only with the data: launch.resolve_for_data checks it
        # then.
        if steps is not None and warmup >= steps:
            raise _key_error(("optim", "warmup_steps"), f"optim.warmup_steps={warmup} must be "
                            f"below train.max_steps={steps}, or the LR never reaches optim.lr nor "
                            "decays: lower optim.warmup_steps or raise train.max_steps", warmup)
        self._derive_batch()
        if self.failure.mode == "replicas":
            self._check_replicas()
        return self

    def _check_replicas(self) -> None:
        """failure.mode=replicas (torchft replica groups, one worker each): what it cannot run
        with is refused here, before any cluster resource is taken."""
        t, s = self.train, self.scaling
        refused = (
            (s.elastic, "needs a fixed scaling.num_workers (Ray replaces a failed replica at the "
                        f"same size), got {s.num_workers}: set scaling.num_workers to a count or "
                        "failure.mode=restart"),
            (not s.elastic and s.max_workers < 2, "needs scaling.num_workers >= 2 (one replica per "
                                                  "worker; a lone replica has no peer to keep "
                                                  "stepping): raise it or set "
                                                  "failure.mode=restart"),
            (t.parallel == "fsdp", "keeps a whole model in every replica: set train.parallel=ddp "
                                   "or failure.mode=restart"),
            (t.sync == "local_sgd", "commits every step by quorum: set train.sync=ddp or "
                                    "failure.mode=restart"),
            (t.micro_batch_size == "auto", "needs a fixed train.micro_batch_size (a survivor's "
                                           "share of the global batch is counted in "
                                           "micro-batches): set it or failure.mode=restart"),
            (self.autopilot.enabled, "does not combine with the autopilot yet: set "
                                     "autopilot.enabled=false or failure.mode=restart"),
            # checkpoint.every (steps or the default auto) gives way to the last step alone; a time
            # cadence the user asked for is refused rather than silently dropped.
            (self.checkpoint.every_minutes is not None,
             "saves only the last step (the state lives in the live replicas, and a checkpoint is "
             "a barrier every replica must reach): remove checkpoint.every_minutes or set "
             "failure.mode=restart"),
        )
        for bad, why in refused:
            if bad:
                raise _key_error(("failure", "mode"), f"failure.mode=replicas {why}", "replicas")
        for participants in range(1, s.max_workers + 1):
            try:
                micro: int = t.micro_batch_size  # type: ignore[assignment]
                replica_micro_batches(t.global_batch_size, micro, participants)
            except ValueError as exc:
                raise _key_error(("failure", "mode"), str(exc), "replicas") from None

    def _resolve_task(self) -> None:
        task, label = self.task, self.data.label
        if task.name is None:
            object.__setattr__(task, "name", "classification" if label else "causal_lm")
        if task.kind is None and ":" not in task.name:
            raise _key_error(("task", "name"), "unknown task "
                             f"'{task.name}'{suggest(task.name, TASK_KINDS)}; valid: "
                             f"{sorted(TASK_KINDS)} or 'module:Class'", task.name)
        kind = task.kind or USER_TASK
        if self.tune.metric is None:
            object.__setattr__(self.tune, "metric", kind.metric)
            object.__setattr__(self.tune, "mode", self.tune.mode or kind.mode)
        if task.kind is not None and task.kind.label is None and label:
            raise _key_error(("task", "name"), f"{task.name} predicts the next token of the token "
                             f"column, but data.label={label} is set: set data.label to "
                             "null", task.name)
        if kind.label is not None and not label:
            raise _key_error(("data", "label"), f"task {task.name} needs a target column: set "
                                                "data.label",
                             label)
        if kind.label == "classes" and self.model.num_classes == 1:
            raise _key_error(("model", "num_classes"), f"{task.name} needs at least 2 classes", 1)
        if task.loss == "model" and self.model.inputs is None:
            raise _key_error(("task", "loss"), "task.loss=model passes `labels` to the model by "
                             "name: set model.inputs to its other arguments", task.loss)
        missing = [c for c in (self.model.input_map or {}).values()
                   if c not in self.data.features and c != "attention_mask"
                   and not c.endswith("_mask")]
        if missing:
            raise _key_error(("model", "inputs"), f"{missing} are not among data.features "
                             f"{self.data.features}: add the columns to data.features, or fix "
                             "model.inputs", self.model.inputs)

    def _derive_batch(self) -> None:
        """global = micro x accum x workers (batching.py): given global and one of the others,
        derive the third."""
        t, s = self.train, self.scaling
        if ("global_batch_size" not in t.model_fields_set and isinstance(t.micro_batch_size, int)
                and t.grad_accum_steps):
            derived = t.micro_batch_size * t.grad_accum_steps * s.max_workers
            object.__setattr__(t, "global_batch_size", derived)
        for size in s.world_sizes:
            if t.global_batch_size % size:
                raise ValueError(f"train.global_batch_size={t.global_batch_size} is not divisible "
                                 "by "
                                 f"scaling.num_workers={size}" + (" (every world size of an "
                                                                  "elastic group must divide "
                                                                  "it)" if s.elastic else ""))
        if t.micro_batch_size == "auto":
            if t.grad_accum_steps is not None:
                raise ValueError("train.grad_accum_steps is derived when micro_batch_size=auto; "
                                 "remove it")
            # Each worker measures what fits, then derives the accumulation
            # (training/micro_batch.py).
            return
        if t.memory_budget_gb is not None:
            raise ValueError("train.memory_budget_gb has no effect unless "
                             "train.micro_batch_size=auto")
        if not s.elastic:
            micro, accum = split_batch(t.global_batch_size, s.max_workers, t.micro_batch_size,
                                       t.grad_accum_steps)
        else:
            # An elastic group keeps the micro-batch and the global batch; each world size gets its
            # own accumulation (derived again in the worker). The resolved accumulation is the one
            # at max.
            micro = t.micro_batch_size or common_micro_batch(t.global_batch_size, s.world_sizes)
            for size in s.world_sizes:
                if (t.global_batch_size // size) % micro:
                    raise ValueError(f"train.global_batch_size={t.global_batch_size} over {size} "
                                     f"workers is not a multiple of micro_batch_size={micro}: pick "
                                     "a micro-batch dividing the per-worker batch at every size "
                                     f"in scaling.num_workers={s.num_workers}, or leave it unset")
            micro, accum = split_batch(t.global_batch_size, s.max_workers, micro)
            if t.grad_accum_steps is not None and t.grad_accum_steps != accum:
                raise ValueError("train.grad_accum_steps is derived for each world size when "
                                 "scaling.num_workers is [min, max]; remove it")
        # Bypass validate_assignment: the pair is only consistent once both are set.
        object.__setattr__(t, "micro_batch_size", micro)
        object.__setattr__(t, "grad_accum_steps", accum)
