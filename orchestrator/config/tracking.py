"""The sections of what is recorded of a run: tracking (the MLflow store and experiment it is
logged to) and cost (the price its cost ledger counts node-hours at)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from orchestrator.config.base import _Section


class TrackingConfig(_Section):
    enabled: bool = Field(True, description="Log the run to MLflow; false: no MLflow run at all.")
    uri: str | None = Field(None, description="MLflow tracking URI (SQLite file or http server); "
                            "null = $MLFLOW_TRACKING_URI, else sqlite:///mlruns.db in the working "
                            "directory.")
    experiment: str = Field("default", min_length=1,
                            description="The MLflow experiment the runs are listed "
                                        "under; runs of several configs can share one.")


class CostConfig(_Section):
    """The cost ledger: node-hours of a run times a price per node-hour (a node type of
    cluster/prices.yaml or a price given here), split into productive training and overheads.
    Unpriced, only node-hours are logged."""

    node_type: str | None = Field(None,
                                  description="A node type of the price table (head, "
                                              "gpu_a100, gpu_h100, gpu_spot); also "
                                              "decides how many nodes the workers occupy.")
    cloud: Literal["aws", "gcp", "azure"] = Field("aws", description="Which cloud's prices to use.")
    spot: bool | None = Field(None, description="Spot price instead of on-demand; null = how the "
                              "launcher YAML starts that node type (gpu_spot: spot).")
    price_per_hour: float | None = Field(None, ge=0,
                                         description="$ per node-hour; overrides the price table.")
    prices_file: str | None = Field(None,
                                    description="Price table YAML; null = "
                                                "cluster/prices.yaml of the checkout (or "
                                                "of the working directory on a cluster).")
    nodes: int | None = Field(None, ge=1,
                              description="Nodes the run occupies; null = the "
                                          "workers' GPUs (or CPUs) over the node "
                                          "type's, rounded up; 1 without a node type.")

    @model_validator(mode="after")
    def _no_dead_options(self) -> CostConfig:
        if self.node_type is None and (self.spot is not None or self.prices_file is not None):
            raise ValueError("cost.spot and cost.prices_file have no effect without "
                             "cost.node_type; set it (e.g. gpu_a100) or give cost.price_per_hour")
        return self

    @property
    def priced(self) -> bool:
        return self.node_type is not None or self.price_per_hour is not None
