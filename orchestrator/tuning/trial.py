"""A study's trial, run in its Tune trial's actor (`run_trial`, the study's trainable). A one-worker
trial trains in that process: no Ray Train run, so no worker group to start per trial (about 10 s on
a small machine, for trials that often train for seconds).

The rank is set up and trained by the same code a Ray Train worker runs
(`training.worker.train_rank`): same config, seed, device, data order and loop, so the trial reports
the figures a 1-worker `orchestrator train` run reports. Its reports go to Tune directly,
checkpoints included (Tune persists them into the trial's directory, keeps `checkpoint.keep` of them
and hands the newest back when the trial restarts); trials wider than one worker keep their own Ray
Train run (`run_trial`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from orchestrator.cluster.local import report_channel, train_environment
from orchestrator.config import Config
from orchestrator.report.cost import REPORTED_AT
from orchestrator.run.place import RunPlace
from orchestrator.run.plan import ConfigPlan
from orchestrator.run.trainer import RunFailedError, build_run, root_cause, trial_inputs
from orchestrator.training.checkpoint import manifest_cache_decision
from orchestrator.training.resume import loadable_checkpoint
from orchestrator.training.worker import Seat, Shards, rank_config, rank_shard, state_of, train_rank
from orchestrator.tuning.autopilot import find_board, post_choice, trial_config_with_choice
from orchestrator.tuning.plan import TrialPlanner, plan_trial
from pipelines.order import release_epoch_clock
from pipelines.sources import DatasetInfo
from pipelines.storage import Storage


def in_trial_process(config: Config) -> bool:
    """Whether a trial with this (resolved) config trains in its own process: one worker, never
    more, and not sharded (train.parallel=fsdp writes its checkpoints through Ray Train's
    reporting)."""
    return config.scaling.max_workers == 1 and config.train.parallel == "ddp"


def trial_resources(config: Config) -> dict[str, float]:
    """What the trial's actor holds: its one worker's CPUs (and GPU) when it trains itself; else
    next to nothing, as it only waits on its Ray Train run, whose workers hold their own."""
    s = config.scaling
    if not in_trial_process(config):
        return {"CPU": 0.01}  # {"CPU": 0} is refused
    held = {"CPU": float(s.cpus_per_worker)} | ({"GPU": 1.0} if s.use_gpu else {})
    if s.accelerator_type:  # as Ray Train's ScalingConfig asks for it
        held[f"accelerator_type:{s.accelerator_type}"] = 0.001
    return held


class TrialReporter:
    """The loop's `Reporter` in a Tune trial: every report goes to `ray.tune.report`, a checkpoint
    step's once, with its checkpoint (Tune copies the directory into the trial's storage before
    report returns)."""

    def __init__(self, on_report: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.checkpointed: dict[str, Any] | None = None
        self.on_report = on_report  # sees each report first (the study's shared autopilot search)

    def publish(self, metrics: dict[str, Any]) -> None:
        from ray import tune

        if self.on_report is not None:
            self.on_report(metrics)
        if metrics is self.checkpointed:  # already reported with its checkpoint
            self.checkpointed = None
            return
        tune.report(stamped(metrics))

    def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        from ray import tune

        assert checkpoint_dir is not None  # one rank: it writes every checkpoint
        if self.on_report is not None:
            self.on_report(metrics)
        tune.report(stamped(metrics), checkpoint=tune.Checkpoint.from_directory(checkpoint_dir))
        self.checkpointed = metrics


def stamped(metrics: dict[str, Any]) -> dict[str, Any]:
    """A report with when it was made (epoch seconds): the trial's cost ledger places it on a clock
    that a restart does not rewind (trials.trial_ledger), as Tune's time_total_s is."""
    return dict(metrics) | {REPORTED_AT: time.time()}


def trial_device(config: Config) -> torch.device:
    """The trial's device: the GPU Ray gave its actor (the only one it sees), else the CPU; what
    ray.train.torch.get_device names for a worker."""
    if not config.scaling.use_gpu:
        return torch.device("cpu")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device


def train_in_trial(plan: ConfigPlan, infos: dict[str, DatasetInfo], name: str,
                   node_ranks: int | None = None,
                   on_report: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Train one trial, as planned, here, resuming from the checkpoint Tune restarts it from, if
    any. `name`: the trial's id; `node_ranks`: the study's ranks that may share this node's memory
    (trainer.build_inputs); `on_report`: sees each report before Tune does.
    The trial owns what it starts in this process, which outlives it (Tune reuses it for the next
    trial): it starts from the process state a fresh process has, and its epoch clock ends with it,
    also when it fails or is stopped."""
    from ray import tune

    entered = time.time()
    start_as_fresh_process()
    checkpoint = loadable_checkpoint(tune.get_checkpoint())
    # A resumed trial is fed as its checkpoint counted its data position
    # (trainer.resumed_cache_decision).
    saved = (manifest_cache_decision(checkpoint.filesystem, checkpoint.path)
             if checkpoint is not None else None)
    spec, datasets = trial_inputs(plan, infos, name, saved, node_ranks)
    try:
        cfg = rank_config(spec, world=1)
        seat = Seat(1, 0, trial_device(cfg), entered)

        def whole(name: str) -> Any:
            return datasets[name].iterator()

        val = rank_shard(spec, "val", seat, whole) if cfg.data.val is not None else None
        train = rank_shard(spec, "train", seat, whole)  # one rank: its shard is the whole data
        train_rank(spec, cfg, seat, lambda: state_of(checkpoint), Shards(train, val, lambda: train),
                   TrialReporter(on_report), notices=None)
    finally:  # Tune stops a trial in a reused actor by raising SystemExit in its thread at a report
        if spec.epoch_clock:
            release_epoch_clock(spec.epoch_clock)


_FRESH: dict[str, Any] = {}  # the process-global torch settings this process started with


def start_as_fresh_process() -> None:
    """Give this trial the process-global state its process had before any trial ran in it: a
    previous trial (its model builder, its settings) may have changed torch's default dtype, thread
    count, float32 matmul precision or deterministic mode, and used up dynamo's recompile limit on
    code objects trials share (a model class's forward: past the limit torch.compile silently runs
    eager). The first trial records that state. The denormal setting needs nothing here: each trial
    runs in a new thread, whose intra-op threads are its own (rank_config sets it)."""
    state = {"dtype": torch.get_default_dtype(), "threads": torch.get_num_threads(),
             "matmul": torch.get_float32_matmul_precision(),
             "deterministic": torch.are_deterministic_algorithms_enabled()}
    if not _FRESH:
        _FRESH.update(state)
        return
    torch.set_default_dtype(_FRESH["dtype"])
    torch.set_num_threads(_FRESH["threads"])
    torch.set_float32_matmul_precision(_FRESH["matmul"])
    torch.use_deterministic_algorithms(_FRESH["deterministic"])
    if "torch._dynamo" in sys.modules:  # imported by an earlier trial's compile (or its model)
        torch._dynamo.reset()


def run_trial(params: dict[str, Any], *, planner: TrialPlanner, trials: Storage,
              private_cluster: bool, node_ranks: int | None = None,
              shared_search: str | None = None) -> None:
    """The Tune trainable, run in the trial's actor. A one-worker trial trains right here
    (trial.py). A wider one fits its own TorchTrainer in a thread while this one hands rank 0's
    metrics to Tune as they arrive (they come straight from rank 0, not through Ray Train's report).
    `planner`: what the study plans its trials from, the data's full facts included (the trial
    trains on them).

    Its Train run is named by the trial id under `trials`, so a trial restarted by a resumed study
    continues from its own latest checkpoint. `node_ranks`: how many ranks of the study's trials may
    share a node's memory (memory_plan.ranks_per_node), for `train.micro_batch_size=auto` on CPU.
    `shared_search`: the study whose one autopilot search this trial runs or applies
    (tuning/autopilot.py)."""
    from ray import tune as ray_tune

    # the trial planned as `train` is
    plan = plan_trial(planner, {**params, "storage.path": trials.uri})
    infos = dict(planner.datasets or {})
    trial_id = ray_tune.get_context().get_trial_id()
    board = find_board(shared_search) if shared_search else None
    if board is None:
        _train_trial(plan, infos, trial_id, private_cluster, trials, node_ranks, None)
        return
    config, searching = trial_config_with_choice(board, trial_id, plan.config)
    try:
        posting = (lambda metrics: post_choice(board, trial_id, metrics)) if searching else None
        _train_trial(replace(plan, config=config), infos, trial_id, private_cluster, trials,
                     node_ranks, posting)
    finally:
        # ended before its choice was posted (failed, stopped): another trial searches
        if searching:
            board.release.remote(trial_id)


def _train_trial(plan: ConfigPlan, infos: dict[str, DatasetInfo], trial_id: str,
                 private_cluster: bool, trials: Storage, node_ranks: int | None,
                 on_report: Callable[[dict[str, Any]], None] | None) -> None:
    """Train the trial as planned: here, or through its own TorchTrainer. `on_report` sees each
    report before Tune does."""
    import threading

    import ray.train
    from ray import tune as ray_tune

    config = plan.config
    # one worker: trained right here, without a worker group of its own
    if in_trial_process(config):
        train_in_trial(plan, infos, trial_id, node_ranks, on_report)
        return
    channel = report_channel()
    failed: list[BaseException] = []

    def fit() -> None:
        try:
            build_run(plan, infos, RunPlace(trials, trial_id), channel.sender, node_ranks).fit()
        except BaseException as exc:  # handed to the trial's thread, which raises it
            failed.append(exc)
        finally:
            # after the workers' last metrics (each was in the channel before they returned)
            channel.close()

    # This actor fits the trial's TorchTrainer: Ray passes the settings on from here.
    with train_environment(config, private_cluster):
        thread = threading.Thread(target=fit, name="orchestrator-trial-fit", daemon=True)
        thread.start()
        # Until fit() is done and its last metrics are in (the workers send theirs before they
        # return).
        while (metrics := channel.get()) is not channel.END:
            if on_report is not None:
                on_report(metrics)
            ray_tune.report(metrics)
    if failed:
        if isinstance(failed[0], ray.train.TrainingFailedError):
            raise RunFailedError(f"trial {trial_id} failed: {root_cause(failed[0])}") from None
        raise failed[0]
