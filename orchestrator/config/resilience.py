"""The sections of what keeps a run's work through a failure: checkpoint (when checkpoints are
written and how many are kept), storage (where they and the run's results live) and failure (the
restarts after a lost worker or node)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from orchestrator.config.base import _Section


class CheckpointConfig(_Section):
    every: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", json_schema_extra={"accepts": "a step count >= 1 or auto"},
        description="Steps between checkpoints; the last step is always saved. auto: the interval "
                    "that loses least to interruptions, about sqrt(2 x a checkpoint's measured "
                    "blocking seconds x failure.mtbf_minutes (unset: 60 minutes until the run's "
                    "first interruption, then its own seconds per interruption)), re-evaluated at "
                    "every report step, never so often that checkpoints block more than 3% of the "
                    "time; the first report step saves one to measure that cost "
                    "(docs/training.md).")
    every_minutes: float | None = Field(None, gt=0,
                                        description="Also save at the first report step "
                                                    "once this many minutes passed since "
                                                    "the last checkpoint (by rank 0's "
                                                    "clock): a cadence that holds whatever "
                                                    "a step costs; with every=auto, the "
                                                    "longest interval. null: steps only.")
    keep: int = Field(2, ge=1, description="Checkpoints kept in storage (older ones are deleted "
                      "only after a newer one is complete and registered).")
    upload: Literal["async", "sync"] = Field("async",
                                             description="async: training continues while rank "
                                                         "0 copies the checkpoint to storage; "
                                                         "sync: the step waits for the copy.")
    on_preemption: bool = Field(True, description="Once Ray announces that a node of the run is "
                                "being drained (spot reclaim, autoscaler scale-down), save a "
                                "checkpoint at every report until the drain's deadline: the node's "
                                "loss then costs at most one report interval.")
    preemption_poll_s: float | None = Field(None, gt=0,
                                            description="How often Ray Train looks for a drain "
                                                        "notice; null: Ray's default (5 s). "
                                                        "Lower it for short drain deadlines.")


class StorageConfig(_Section):
    path: str = Field("runs", min_length=1,
                      description="Where Ray Train writes checkpoints and results: a "
                                  "directory shared by all nodes, or s3://bucket/prefix "
                                  "(endpoint and credentials as for data.s3).")


class FailureConfig(_Section):
    mode: Literal["restart", "replicas"] = Field(
        "restart", description="restart: a failure restarts the whole worker group from the last "
        "checkpoint (exact resume). replicas: each worker is a torchft replica group (the "
        "`replicas` extra); the survivors keep stepping, taking the lost worker's share of the "
        "global batch, while the failed one restarts and copies the state from a live peer "
        "(docs/training.md).")
    max_failures: int = Field(3, ge=-1,
                              description="Worker-group restarts from the "
                                          "last checkpoint; -1 = unlimited.")
    max_preemption_failures: int = Field(-1, ge=-1,
                                         description="Restarts after a drained (preempted) "
                                                     "node went away, counted apart from "
                                                     "max_failures; -1 = unlimited.")
    mtbf_minutes: float | None = Field(None, gt=0,
                                       description="Mean minutes between interruptions of a run "
                                                   "(node failures, spot reclaims), when known: "
                                                   "checkpoint.every=auto sets its interval from "
                                                   "it. null: 60 minutes stand in until the run "
                                                   "is first interrupted (a fixed figure, so "
                                                   "identical runs checkpoint alike), then the "
                                                   "run's own training seconds per interruption.")
    preemption_grace_s: float = Field(0.0, ge=0,
                                      description="Seconds the surviving workers may "
                                                  "run past a drain deadline (e.g. "
                                                  "to finish a checkpoint upload).")
    worker_start_timeout_s: float | None = Field(None, gt=0,
                                                 description="How long a (re)started worker group "
                                                             "may wait for its resources before "
                                                             "the attempt counts as a failure; "
                                                             "null: Ray's default (60 s). After a "
                                                             "node loss the scheduler's view can "
                                                             "lag, and a restart waits this long "
                                                             "for a node that is gone.")
