"""The config sections of how a run is placed, kept, watched, billed and sped up: scaling, cluster, checkpoint,
storage, failure, tracking, cost and autopilot. What is trained (task, model, train, optim), the search (tune) and
`Config` are in schema.py."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from orchestrator.config.base import _key_error, _Section


class ScalingConfig(_Section):
    num_workers: int | list[int] = Field(2, json_schema_extra={"accepts": "a count or [min, max]"},
                                         description="Ray Train workers (one DDP rank each), or [min, max] for "
                                         "an elastic group that grows and shrinks with the cluster.")
    use_gpu: bool = Field(False, description="One GPU per worker (nccl); false: CPU workers (gloo).")
    accelerator_type: str | None = Field(None, description="GPU type every worker must run on, e.g. A100, H100, "
                                         "A10G (Ray's accelerator_type:<T> node resource; the cluster YAMLs in "
                                         "cluster/ declare it per node type). null: any GPU.")
    cpus_per_worker: float = Field(1.0, gt=0, description="Logical CPUs per worker (also its torch threads).")
    resize_check_s: float | None = Field(None, gt=0, description="Elastic only: seconds between Ray Train's checks "
                                         "for room to grow the group (Ray's default: 60).")

    @field_validator("num_workers")
    @classmethod
    def _worker_range(cls, value: int | list[int]) -> int | list[int]:
        if isinstance(value, int):
            if value < 1:
                raise ValueError(f"must be at least 1, got {value}")
            return value
        if len(value) != 2:
            raise ValueError(f"give a count or [min, max], got {value}")
        low, high = value
        if low < 1 or low > high:
            raise ValueError(f"[min, max] needs 1 <= min <= max, got {value}")
        return low if low == high else [low, high]

    @model_validator(mode="after")
    def _no_dead_options(self) -> ScalingConfig:
        if self.resize_check_s is not None and not self.elastic:
            raise ValueError("scaling.resize_check_s has no effect with a fixed num_workers; remove it or give "
                             "num_workers as [min, max]")
        if self.accelerator_type is not None and not self.use_gpu:
            raise ValueError("scaling.accelerator_type needs scaling.use_gpu=true")
        return self

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, list)

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, list) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, list) else self.num_workers

    @property
    def world_sizes(self) -> range:
        return range(self.min_workers, self.max_workers + 1)

    def shortfall(self, resources: dict[str, float]) -> str | None:
        """What a cluster with `resources` (ray.cluster_resources()) lacks for the largest worker group, or None."""
        need, have = self.max_workers * self.cpus_per_worker, resources.get("CPU", 0.0)
        if need > have:
            return (f"{need:g} CPUs (scaling.num_workers={self.num_workers} x scaling.cpus_per_worker="
                    f"{self.cpus_per_worker:g}) but the Ray cluster has {have:g}: lower scaling.num_workers or "
                    "scaling.cpus_per_worker, or add nodes")
        if self.use_gpu and self.max_workers > resources.get("GPU", 0.0):
            return (f"{self.max_workers} GPUs (scaling.num_workers with scaling.use_gpu) but the Ray cluster has "
                    f"{resources.get('GPU', 0.0):g}: lower scaling.num_workers or add GPU nodes")
        if self.accelerator_type and f"accelerator_type:{self.accelerator_type}" not in resources:
            types = sorted(k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:"))
            return (f"{self.accelerator_type} GPUs (scaling.accelerator_type) but the Ray cluster has "
                    f"{', '.join(types) or 'no typed GPUs'}: change or remove scaling.accelerator_type")
        return None


class ClusterConfig(_Section):
    """The local Ray cluster a command starts when it is given no cluster (no --address, no $RAY_ADDRESS)."""

    keep_warm_minutes: float = Field(0.0, ge=0, description="Leave the local Ray cluster running this many minutes "
                                     "after the command (and after each later command that joins it), so that the "
                                     "next train or tune command in the same environment joins it instead of "
                                     "starting one: its `ray start` stage is then only the join. The idle cluster "
                                     "keeps its processes' memory (`orchestrator cluster status` shows it) and uses "
                                     "no CPU to speak of; it is stopped when idle that long, or now with "
                                     "`orchestrator cluster stop`. 0: each command starts and stops its own cluster.")


class CheckpointConfig(_Section):
    every: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", json_schema_extra={"accepts": "a step count >= 1 or auto"},
        description="Steps between checkpoints; the last step is always saved. auto: the interval that loses least to "
                    "interruptions, about sqrt(2 x a checkpoint's measured blocking seconds x failure.mtbf_minutes "
                    "(unset: 60 minutes until the run's first interruption, then its own seconds per interruption)), "
                    "re-evaluated at every report step, never so often that checkpoints block more than 3% of the "
                    "time; the first report step saves one to measure that cost (docs/training.md).")
    every_minutes: float | None = Field(None, gt=0, description="Also save at the first report step once this many "
                                        "minutes passed since the last checkpoint (by rank 0's clock): a cadence "
                                        "that holds whatever a step costs; with every=auto, the longest interval. "
                                        "null: steps only.")
    keep: int = Field(2, ge=1, description="Checkpoints kept in storage (older ones are deleted only after a newer "
                      "one is complete and registered).")
    upload: Literal["async", "sync"] = Field("async", description="async: training continues while rank 0 copies "
                                             "the checkpoint to storage; sync: the step waits for the copy.")
    on_preemption: bool = Field(True, description="Once Ray announces that a node of the run is being drained (spot "
                                "reclaim, autoscaler scale-down), save a checkpoint at every report until the "
                                "drain's deadline: the node's loss then costs at most one report interval.")
    preemption_poll_s: float | None = Field(None, gt=0, description="How often Ray Train looks for a drain notice; "
                                            "null: Ray's default (5 s). Lower it for short drain deadlines.")


class StorageConfig(_Section):
    path: str = Field("runs", min_length=1, description="Where Ray Train writes checkpoints and results: a "
                      "directory shared by all nodes, or s3://bucket/prefix (endpoint and credentials as for data.s3).")


class FailureConfig(_Section):
    mode: Literal["restart", "replicas"] = Field(
        "restart", description="restart: a failure restarts the whole worker group from the last checkpoint (exact "
        "resume). replicas: each worker is a torchft replica group (the `replicas` extra); the survivors keep "
        "stepping, taking the lost worker's share of the global batch, while the failed one restarts and copies "
        "the state from a live peer (docs/training.md).")
    max_failures: int = Field(3, ge=-1, description="Worker-group restarts from the last checkpoint; -1 = unlimited.")
    max_preemption_failures: int = Field(-1, ge=-1, description="Restarts after a drained (preempted) node went "
                                         "away, counted apart from max_failures; -1 = unlimited.")
    mtbf_minutes: float | None = Field(None, gt=0, description="Mean minutes between interruptions of a run (node "
                                       "failures, spot reclaims), when known: checkpoint.every=auto sets its "
                                       "interval from it. null: 60 minutes stand in until the run is first "
                                       "interrupted (a fixed figure, so identical runs checkpoint alike), then the "
                                       "run's own training seconds per interruption.")
    preemption_grace_s: float = Field(0.0, ge=0, description="Seconds the surviving workers may run past a drain "
                                      "deadline (e.g. to finish a checkpoint upload).")
    worker_start_timeout_s: float | None = Field(None, gt=0, description="How long a (re)started worker group "
                                                 "may wait for its resources before the attempt counts as a failure; "
                                                 "null: Ray's default (60 s). After a node loss the scheduler's view "
                                                 "can lag, and a restart waits this long for a node that is gone.")


class TrackingConfig(_Section):
    enabled: bool = Field(True, description="Log the run to MLflow; false: no MLflow run at all.")
    uri: str | None = Field(None, description="MLflow tracking URI (SQLite file or http server); null = "
                            "$MLFLOW_TRACKING_URI, else sqlite:///mlruns.db in the working directory.")
    experiment: str = Field("default", min_length=1, description="The MLflow experiment the runs are listed "
                            "under; runs of several configs can share one.")


class CostConfig(_Section):
    """The cost ledger: node-hours of a run times a price per node-hour (a node type of cluster/prices.yaml or a
    price given here), split into productive training and overheads. Unpriced, only node-hours are logged."""

    node_type: str | None = Field(None, description="A node type of the price table (head, gpu_a100, gpu_h100, "
                                  "gpu_spot); also decides how many nodes the workers occupy.")
    cloud: Literal["aws", "gcp", "azure"] = Field("aws", description="Which cloud's prices to use.")
    spot: bool | None = Field(None, description="Spot price instead of on-demand; null = how the launcher YAML "
                              "starts that node type (gpu_spot: spot).")
    price_per_hour: float | None = Field(None, ge=0, description="$ per node-hour; overrides the price table.")
    prices_file: str | None = Field(None, description="Price table YAML; null = cluster/prices.yaml of the "
                                    "checkout (or of the working directory on a cluster).")
    nodes: int | None = Field(None, ge=1, description="Nodes the run occupies; null = the workers' GPUs (or CPUs) "
                              "over the node type's, rounded up; 1 without a node type.")

    @model_validator(mode="after")
    def _no_dead_options(self) -> CostConfig:
        if self.node_type is None and (self.spot is not None or self.prices_file is not None):
            raise ValueError("cost.spot and cost.prices_file have no effect without cost.node_type; set it "
                             "(e.g. gpu_a100) or give cost.price_per_hour")
        return self

    @property
    def priced(self) -> bool:
        return self.node_type is not None or self.price_per_hour is not None


class AutopilotConfig(_Section):
    """The autopilot (training/autopilot.py): the run's first steps measure the settings that leave the math of
    training unchanged (micro-batch at the fixed global batch, compile, torch threads, flush_denormal, precision when
    auto), then the rest of the run trains with the fastest. Every measured step is a real step of the run."""

    enabled: bool = Field(False, description="Measure the speed checklist (micro-batch, compile, threads, "
                          "flush_denormal, precision when auto) on the run's first steps, then train with the "
                          "fastest; the choice is saved in the checkpoint and kept on resume.")
    budget: float = Field(0.05, gt=0, le=0.5, description="Most of the run's expected wall clock (max_steps x the "
                          "starting config's step time) the search may spend; a run too short to pay for it trains "
                          "with its config.")
    allow: list[Literal["sync", "tf32"]] = Field(
        default_factory=list, description="Settings that change the math of training, measured too only when "
        "listed here: sync (train.sync local_sgd against ddp, on 2 workers or more; local_sgd's own settings, or "
        "its defaults); tf32 (train.tf32 flipped, on a GPU while the run trains in fp32: train.precision fp32, or "
        "auto once fp32 beat bf16). Their rows show the loss over the measured steps beside the speed.")

    def check_allowed(self, use_gpu: bool, precision: str) -> None:
        """Refuses an allowed setting the run can never measure: TF32 exists on GPUs only, and changes fp32's matrix
        products only (under bf16 or fp16 autocast they already run in the narrower type)."""
        if "tf32" in self.allow and (not use_gpu or precision in ("bf16", "fp16")):
            why = ("needs a GPU (CPUs have no TF32): set scaling.use_gpu=true" if not use_gpu else
                   f"has no effect with train.precision={precision} (TF32 changes fp32's matrix products only): set "
                   "train.precision=fp32 or auto")
            raise _key_error(("autopilot", "allow"), f"autopilot.allow=[tf32] {why}, or remove tf32 from "
                             "autopilot.allow", self.allow)
