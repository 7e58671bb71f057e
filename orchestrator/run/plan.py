"""The plan of a run, made once before any cluster resource is taken: the config resolved for the
data, the data's facts, the model's and the task's, the memory and price of the run, where it lives
and what it resumes. The run stage (launch.py: Ray, tracking, fit, summary) consumes only this plan;
`orchestrator show-config --plan` prints it, and every tracked run logs it to MLflow as `plan.yaml`.
Each check fails here with one ConfigError or DataError naming the key and the fix, before Ray
starts."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from types import EllipsisType, MappingProxyType
from typing import TYPE_CHECKING, Any

import yaml

from orchestrator.cluster.local import ClusterChoice, choose_cluster
from orchestrator.config import Config
from orchestrator.report.cost import Pricing, resolve_pricing
from orchestrator.run.place import RunPlace, place_in, resume_target
from orchestrator.tracking.context import changed_keys, context_tags
from orchestrator.tracking.store import check_server_listens
from orchestrator.tracking.uri import mask_password, mask_passwords, resolve_uri
from pipelines.datasets import inspect_run
from pipelines.sources import DatasetInfo

if TYPE_CHECKING:
    from orchestrator.report.startup import StartupClock
    from pipelines.batches import Sample


@dataclass(frozen=True)
class ResumePoint:
    """What a `--resume` continues: the run's record (its MLflow run), the newest checkpoint Ray
    Train registered, and the cache decision that checkpoint's data position counts rows in; or, for
    a run that finished, nothing (`finished`: its step, result and final checkpoint, from its
    record). `attempts`: the records of the attempts before this one (report/cost.py
    attempt_record), which the run's bill spans with this attempt's."""

    record: Mapping[str, Any]
    step: int | None
    cache_decision: str | None
    finished: Mapping[str, Any] | None = None
    attempts: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class ConfigPlan:
    """One config decided against the data's facts (`plan_config`): what `train`'s plan holds of its
    config, and what a study plans for each of its trials (tuning/plan.py)."""

    # resolved for the data: the number of classes and, for epochs, the step count filled in
    config: Config
    # the width of the classic model input the workers build with (models.inputs)
    in_features: int | None
    # bytes one worker may use, and where that figure comes from
    memory_budget: tuple[float, str] | None
    advice: str | None  # ddp would not fit a worker while fsdp would (checks.model_state_advice)

    # The price is read from the price table when first asked: `train`'s plan asks at once (an
    # unknown node type fails before Ray starts), a study's driver for each trial it prices, a
    # trial's own actor never.
    @cached_property
    def pricing(self) -> Pricing:
        """At the planned group size (an elastic group's smallest)."""
        return resolve_pricing(self.config)

    @cached_property
    def elastic_prices(self) -> Mapping[int, Pricing]:
        """An elastic group's price at each size it may reach (it is billed at the largest it
        reached)."""
        workers = self.config.scaling.num_workers
        low, high = workers if isinstance(workers, list) else (1, 0)
        return MappingProxyType({world: resolve_pricing(self.config, world)
                                 for world in range(low, high + 1)})


def plan_config(config: Config, datasets: Mapping[str, DatasetInfo],
                sample: Sample | None | EllipsisType = ...) -> ConfigPlan:
    """Check `config` against the data's facts and the model (built once, on the meta device) and
    resolve it for them; raises ConfigError naming the key and the fix. `sample`: the train sample
    as the data's inspection collated it (pipelines.datasets.inspect_run); `...`: collated here from
    the facts' sample rows, as the config reads them (a trial's searched data.* keys may read them
    otherwise)."""
    # The model's checks build it with torch: imported by the plan, not with the command (the
    # `command` stage).
    from orchestrator.run.checks import check_inspected, check_run

    checked = (check_run(config, datasets) if isinstance(sample, EllipsisType)
               else check_inspected(config, datasets, sample))
    return ConfigPlan(checked.config, checked.in_features, checked.memory_budget, checked.advice)


@dataclass(frozen=True)
class RunPlan:
    """One run, decided: nothing after the plan reads the config's raw form or the data's files
    again."""

    # resolved for the data: the number of classes and, for epochs, the step count filled in
    config: Config
    datasets: Mapping[str, DatasetInfo]  # each split's rows, bytes, files, columns and classes
    # the width of the classic model input the workers build with (models.inputs)
    in_features: int | None
    # bytes one worker may use, and where that figure comes from
    memory_budget: tuple[float, str] | None
    advice: str | None  # ddp would not fit a worker while fsdp would (checks.model_state_advice)
    pricing: Pricing  # at the planned group size (an elastic group's smallest)
    # an elastic group's price at each size it may reach (billed at the largest)
    elastic_prices: Mapping[int, Pricing]
    place: RunPlace  # where the run lives in storage: a new one, or the one resumed
    resume: ResumePoint | None
    # the run's one name (runs.run_name): its directory in storage, its MLflow run's name
    run_name: str
    tracking_uri: str | None  # the MLflow store, resolved (None: tracking off)
    # the resumed run's MLflow run, continued when tracked at the same store
    reopen_run_id: str | None
    # the run's context tags (git commit, user, source), taken where the command started
    context: Mapping[str, str]
    # the autopilot's setting: on or off, its budget and the keys it measures (_autopilot)
    autopilot: Mapping[str, Any]
    cluster: ClusterChoice  # the Ray cluster the run joins or starts (connect_ray carries it out)

    def pricing_at(self, world: int | None) -> Pricing:
        """The price of the run at the largest group size it reached (`world`: None before its first
        report)."""
        return self.elastic_prices.get(world, self.pricing) if world else self.pricing

    def describe(self) -> dict[str, Any]:
        """The plan as plain data: what `show-config --plan` prints and `plan.yaml` in MLflow holds
        (through `to_yaml`, which masks the password of every URI in it)."""
        c = self.config
        resume = None if self.resume is None else {
            "from_step": self.resume.step, "cache_decision": self.resume.cache_decision,
            "mlflow_run_id": self.reopen_run_id,
            "finished_at_step": self.resume.finished.get("step") if self.resume.finished else None}
        return {
            "run": {"experiment": c.experiment, "place": self.place.uri,
                    "mlflow_run_name": self.run_name, "resume": resume},
            "data": {split: {"path": info.path, "files": len(info.files), "rows": info.num_rows,
                             "bytes": info.num_bytes, "feature_values_per_row": info.feature_dim,
                             "classes": info.num_classes} for split, info in self.datasets.items()},
            "task": c.task.name,
            "model": {"name": c.model.entrypoint or c.model.name, "in_features": self.in_features,
                      "outputs": c.model.num_classes},
            "training": {"steps": c.train.max_steps, "global_batch_size": c.train.global_batch_size,
                         "micro_batch_size": c.train.micro_batch_size,
                         "precision": planned_precision(c.train.precision, c.scaling.use_gpu),
                         "parallel": c.train.parallel, "sync": c.train.sync,
                         "workers": c.scaling.num_workers if isinstance(c.scaling.num_workers, int)
                         else list(c.scaling.num_workers), "use_gpu": c.scaling.use_gpu},
            "memory": {"worker_budget_gib": None if self.memory_budget is None
                       else round(self.memory_budget[0] / 2**30, 2),
                       "budget_from": None if self.memory_budget is None else self.memory_budget[1],
                       "advice": self.advice},
            "autopilot": dict(self.autopilot),
            "cluster": self.cluster.describe(),
            "data_cache": {"setting": c.data.cache,
                           "kept_from_checkpoint": self.resume.cache_decision if self.resume
                           else None},
            "cost": {"nodes": self.pricing.nodes,
                     "usd_per_node_hour": self.pricing.usd_per_node_hour,
                     "pricing": self.pricing.description},
            # its password masked by to_yaml, with every other URI's
            "tracking": {"uri": self.tracking_uri,
                         "experiment": c.tracking.experiment} if c.tracking.enabled else None,
        }

    def to_yaml(self) -> str:
        """`describe` as YAML, the password of every URI in it masked (it is logged to MLflow)."""
        return yaml.safe_dump(mask_passwords(self.describe()), sort_keys=False,
                              default_flow_style=False)


def planned_precision(requested: str, use_gpu: bool) -> str:
    """train.precision as the workers resolve it (training/precision.py, on their device), resolved
    here on this machine's device of their kind: its CPU for CPU workers (a local cluster's run
    here), its GPU for GPU workers; a GPU run planned on a machine without one gets what `auto`
    would choose there. The first line of the run says what the workers resolved."""
    if requested != "auto":
        return requested
    import torch

    from orchestrator.training.precision import resolve_precision

    if not use_gpu:
        return resolve_precision(requested, torch.device("cpu"))
    if torch.cuda.is_available():
        return resolve_precision(requested, torch.device("cuda"))
    return "bf16 on a GPU that runs it natively (Ampere or newer), else fp16"


def _autopilot(c: Config) -> dict[str, Any]:
    """The autopilot's setting: its budget, and the keys it measures (docs/autopilot.md): those that
    leave the math unchanged (precision only when the user left it auto, threads and flush_denormal
    only on CPU), and those autopilot.allow lists where they can run (sync on 2 workers or more;
    tf32 on a GPU in fp32, which the config checks)."""
    if not c.autopilot.enabled:
        return {"enabled": False}
    searches = ["train.micro_batch_size (at the global batch)", "train.compile"]
    searches += [] if c.scaling.use_gpu else ["train.torch_threads", "train.flush_denormal"]
    searches += ["train.precision"] if c.train.precision == "auto" else []
    # Opted in (autopilot.allow): changes the math, measured with the loss beside the speed.
    searches += (["train.sync (allowed)"]
                 if "sync" in c.autopilot.allow and c.scaling.max_workers > 1 else [])
    # refused without a GPU, in bf16
    searches += ["train.tf32 (allowed)"] if "tf32" in c.autopilot.allow else []
    return {"enabled": True, "budget_share_of_wall_clock": c.autopilot.budget, "searches": searches}


def plan_run(config: Config, resume: bool | str = False, verbose: bool = True,
             address: str | None = None, clock: StartupClock | None = None) -> RunPlan:
    """Check the config against the data, the model, the price table and the tracking store, and
    find the run's place (with `resume`: True, the newest run of the experiment this config trained;
    a run's name; or a run directory's path or s3:// URI); raises UserError subclasses on bad input.
    Prints the memory advice and where a resume continues from when `verbose`. `address`: the Ray
    cluster to join (--address; else $RAY_ADDRESS, else a local one). `clock`: the start-up line's,
    its `data inspection` marked once the data are read (the checks after it are the launch's next
    stage)."""
    # a run directory's path: its parent is storage.path
    config, resume = resume_target(config, resume)
    # Every file the plan reads, once: the data's facts, the sample rows collated, the run's storage
    # opened.
    data = inspect_run(config.data, config.model.inputs is not None, config.storage.path)
    if clock is not None:
        clock.mark("data inspection")
    # the model built once, on the meta device
    checked = plan_config(config, data.datasets, data.sample)
    config = checked.config
    pricing = checked.pricing  # an unknown node type fails now, not after training
    # An elastic group is billed at the largest size it reaches: its price at each size, decided
    # now.
    elastic_prices = checked.elastic_prices
    # the run is opened once Ray runs: a dead server must stop us first
    check_server_listens(config.tracking)
    if checked.advice and verbose:  # ddp would not fit a worker, fsdp would
        print(checked.advice, file=sys.stderr, flush=True)
    # A new run is named by what the command's --set changed.
    place, record = place_in(data.run_storage, config, resume, verbose, changed_keys())
    uri = resolve_uri(config.tracking.uri) if config.tracking.enabled else None
    point = (None if record is None
             else ResumePoint(MappingProxyType(record), place.registered_step(),
                              place.cache_decision(), record.get("finished"),
                              () if record.get("finished") else tuple(place.read_attempts())))
    # The context is read where the command started (its commit): a Ray job's driver then leaves
    # that directory.
    return RunPlan(config=config, datasets=MappingProxyType(data.datasets),
                   in_features=checked.in_features, memory_budget=checked.memory_budget,
                   advice=checked.advice, pricing=pricing, elastic_prices=elastic_prices,
                   place=place, resume=point, run_name=place.name, tracking_uri=uri,
                   reopen_run_id=_reopen_id(uri, record),
                   context=MappingProxyType(context_tags() if uri else {}),
                   autopilot=MappingProxyType(_autopilot(config)),
                   cluster=choose_cluster(address, config))


def _reopen_id(uri: str | None, record: Mapping[str, Any] | None) -> str | None:
    """The MLflow run to continue: the resumed run's, if it was tracked at the same store
    (`uri`)."""
    if not record or not record.get("mlflow_run_id") or uri is None:
        return None
    uri = mask_password(uri)  # as the record keeps it
    if mask_password(record.get("tracking_uri") or "") != uri:
        print(f"the resumed run was tracked at {mask_password(record.get('tracking_uri') or '')}, "
              f"not {uri}: starting a new MLflow run", file=sys.stderr)
        return None
    return str(record["mlflow_run_id"])
