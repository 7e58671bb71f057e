"""What the driver hands every rank of a run (`WorkerSpec`): built once by the driver
(run/trainer.py `build_inputs`, for `train` and for each Tune trial), read by the worker
(training/worker.py). Light on purpose: the driver imports it, so nothing here imports torch or
Ray."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

    from orchestrator.training.channel import ChannelSender
    from orchestrator.training.fence import Claim
    from pipelines.held import HeldRows
    from pipelines.storage import Storage


@dataclass(frozen=True)
class WorkerSpec:
    """The ranks' hand-off, pickled by Ray to each worker. Frozen: a later addition (the launch's
    stop request and claim, the replicas' datasets) is a `dataclasses.replace` copy. The heavy
    fields stay out of its repr."""

    # the resolved config as a plain dict, rebuilt into the typed one by each rank
    config: dict[str, Any]
    # the classic model's input width (the plan checked it), None for named inputs
    in_features: int | None = None
    # the actor the train reader draws each epoch's shard order from, if any
    epoch_clock: str | None = None
    # How the driver feeds the train data (pipelines.datasets: stream, memory or replay; under
    # replay the workers replay their first pass), saved with every checkpoint's data position.
    cache_decision: str | None = None
    # where rank 0 sends its reports (the driver's channel), if anywhere
    reports: ChannelSender | None = None
    sample: pa.Table | None = field(default=None, repr=False)  # the first rows of the training data
    # ranks that may share a node's memory (micro_batch_size=auto divides by them)
    node_ranks: int | None = None
    train_rows: int | None = None  # failure.mode=replicas: the training split's rows, when known
    # Small data the ranks split themselves ({name: HeldRows}), instead of Ray Train's dataset
    # shards.
    held: Mapping[str, HeldRows] = field(default_factory=dict, repr=False)
    # the user's stop (training/stop.py); None in a Tune trial
    stop_request: tuple[Storage, str] | None = None
    # this attempt's claim on the run (training/fence.py)
    attempt: tuple[Storage, str, Claim] | None = None
    # failure.mode=replicas: the datasets each replica reads whole, instead of Ray Train's shards.
    replica_datasets: Mapping[str, Any] | None = field(default=None, repr=False)
