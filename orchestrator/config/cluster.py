"""The sections of where a run runs: scaling (the Ray Train worker group: how many workers, on
what) and cluster (the local Ray cluster a command starts when it is given none)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from orchestrator.config.base import _Section


class ScalingConfig(_Section):
    num_workers: int | list[int] = Field(2, json_schema_extra={"accepts": "a count or [min, max]"},
                                         description="Ray Train workers (one DDP rank each), or "
                                         "[min, max] for an elastic group that grows and shrinks "
                                         "with the cluster.")
    use_gpu: bool = Field(False, description="One GPU per worker (nccl); false: CPU workers "
                                             "(gloo).")
    accelerator_type: str | None = Field(None,
                                         description="GPU type every worker must run on, "
                                                     "e.g. A100, H100, A10G (Ray's "
                                                     "accelerator_type:<T> node resource; "
                                                     "the cluster YAMLs in cluster/ declare "
                                                     "it per node type). null: any GPU.")
    cpus_per_worker: float = Field(1.0, gt=0,
                                   description="Logical CPUs per worker (also its torch threads).")
    resize_check_s: float | None = Field(None, gt=0,
                                         description="Elastic only: seconds between Ray "
                                                     "Train's checks for room to grow "
                                                     "the group (Ray's default: 60).")

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
            raise ValueError("scaling.resize_check_s has no effect with a fixed num_workers; "
                             "remove it or give num_workers as [min, max]")
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
        """What a cluster with `resources` (ray.cluster_resources()) lacks for the largest worker
        group, or None."""
        need, have = self.max_workers * self.cpus_per_worker, resources.get("CPU", 0.0)
        if need > have:
            return (f"{need:g} CPUs (scaling.num_workers={self.num_workers} x "
                    f"scaling.cpus_per_worker={self.cpus_per_worker:g}) but the Ray cluster has "
                    f"{have:g}: lower scaling.num_workers or scaling.cpus_per_worker, or add nodes")
        if self.use_gpu and self.max_workers > resources.get("GPU", 0.0):
            return (f"{self.max_workers} GPUs (scaling.num_workers with scaling.use_gpu) but the "
                    f"Ray cluster has {resources.get('GPU', 0.0):g}: lower scaling.num_workers or "
                    "add GPU nodes")
        if self.accelerator_type and f"accelerator_type:{self.accelerator_type}" not in resources:
            types = sorted(k.split(":", 1)[1] for k in resources
                           if k.startswith("accelerator_type:"))
            return (f"{self.accelerator_type} GPUs (scaling.accelerator_type) but the Ray cluster "
                    f"has {', '.join(types) or 'no typed GPUs'}: change or remove "
                    "scaling.accelerator_type")
        return None


class ClusterConfig(_Section):
    """The local Ray cluster a command starts when it is given no cluster (no --address, no
    $RAY_ADDRESS)."""

    keep_warm_minutes: float = Field(0.0, ge=0,
                                     description="Leave the local Ray cluster running this many "
                                                 "minutes after the command (and after each later "
                                                 "command that joins it), so that the next train "
                                                 "or tune command in the same environment joins "
                                                 "it instead of starting one: its `ray start` "
                                                 "stage is then only the join. The idle cluster "
                                                 "keeps its processes' memory (`orchestrator "
                                                 "cluster status` shows it) and uses no CPU to "
                                                 "speak of; it is stopped when idle that long, or "
                                                 "now with `orchestrator cluster stop`. 0: each "
                                                 "command starts and stops its own cluster.")
