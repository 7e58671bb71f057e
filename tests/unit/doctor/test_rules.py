"""`orchestrator doctor`: each rule against hand-made metric histories, the order of findings, the output."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from orchestrator.doctor.engine import diagnose
from orchestrator.doctor.record import HIGH, MEDIUM, Finding, RunRecord, settings, training_share
from orchestrator.doctor.report import format_findings
from orchestrator.doctor.rules.autopilot import autopilot_gain
from orchestrator.doctor.rules.run_health import (
    bookkeeping,
    checkpoint_interval,
    evaluation,
    nonfinite_steps,
    report_blocking,
    startup,
)
from orchestrator.doctor.rules.speed import (
    WORKER_RATE,
    compile_small_kernels,
    data_pipeline,
    gradient_sync,
    memory_headroom,
    model_state,
    precision,
    uneven_workers,
)
from orchestrator.doctor.rules.study import search_space_edge, study_size
from orchestrator.tracking.view import mlflow_key

# A healthy 2-worker CPU run as the loop reports it (names as the loop reports them; record() maps them to MLflow
# keys): most of every interval in compute, a little of everything else, both workers at the same pace.
HEALTHY = {"step": [25.0, 50.0, 75.0, 100.0], "time/data_wait_frac": [0.02, 0.01, 0.02, 0.01],
           "time/compute_frac": [0.8] * 4, "time/sync_frac": [0.05] * 4, "time/eval_frac": [0.0, 0.0, 0.0, 0.12],
           "time/checkpoint_frac": [0.0, 0.0, 0.0, 0.01], "time/report_frac": [0.01] * 4,
           "time/other_frac": [0.06] * 4, "interval_s": [2.0] * 4, "world_size": [2.0] * 4,
           "comm_bytes_per_sample": [2700.0] * 4, "micro_batch_size": [64.0] * 4, "skipped_steps": [0.0] * 4,
           WORKER_RATE.format(rank=0): [10_000.0, 10_300.0], WORKER_RATE.format(rank=1): [9_700.0, 10_100.0],
           "cost/startup_frac": [0.12]}
PARAMS = {"data.prefetch_batches": "2", "data.read_parallelism": "None", "data.cache": "auto",
          "data.train": "data/digits/train", "data.transforms": "[]", "optim.lr": "0.003",
          "optim.warmup_steps": "20", "optim.max_grad_norm": "1.0", "train.compile": "False",
          "train.grad_accum_steps": "1", "train.precision": "auto", "train.global_batch_size": "128",
          "train.max_steps": "100", "train.log_every": "25", "train.eval_every": "100", "train.sync": "ddp",
          "scaling.num_workers": "2", "scaling.cpus_per_worker": "1.0"}

# An autopilot run as MLflow holds it (autopilot_report.py): the search's figures in the summary table, the chosen
# settings as `autopilot.<key>` params beside the config's own `autopilot.enabled` / `autopilot.budget`.
AUTOPILOT_RUN = {"autopilot/predicted_speedup": [1.3], "autopilot/achieved_speedup": [1.25],
                 "autopilot/search_s": [8.25]}
AUTOPILOT_PARAMS = {"autopilot.enabled": "True", "autopilot.budget": "0.05", "autopilot.micro_batch_size": "32",
                    "autopilot.grad_accum_steps": "1", "autopilot.compile": "False", "autopilot.torch_threads": "None",
                    "autopilot.flush_denormal": "True", "autopilot.precision": "fp32"}


def keyed(metrics: dict[str, list[float]]) -> dict[str, list[float]]:
    """Histories under their MLflow keys, as load_run reads them back."""
    return {mlflow_key(name): values for name, values in metrics.items()}


def record(metrics: dict[str, list[float]] | None = None, params: dict[str, str] | None = None,
           tags: dict[str, str] | None = None) -> RunRecord:
    return RunRecord(keyed({**HEALTHY, **(metrics or {})}), {**PARAMS, **(params or {})}, tags or {})


def test_a_healthy_cpu_run_has_no_findings() -> None:
    run = record()
    assert diagnose(run) == []
    assert "no findings" in format_findings("abc", run, [])


def test_data_wait_names_prefetch_parallelism_and_cache() -> None:
    finding = data_pipeline(record({"time/data_wait_frac": [0.5, 0.6, 0.4]}, {"data.prefetch_batches": "0"}))
    assert finding is not None and finding.severity == HIGH
    assert "50%" in finding.title
    # Local shards, read_parallelism null: as many reads at once as Ray has CPUs already; the cache is what helps.
    assert finding.changes == ("data.prefetch_batches=4", "data.cache=memory")
    remote = data_pipeline(record({"time/data_wait_frac": [0.2]}, {"data.train": "s3://b/train",
                                                                   "data.read_parallelism": "4"}))
    assert remote is not None and remote.severity == MEDIUM
    assert "data.read_parallelism=8" in remote.changes and any("cache" in c and "remote" in c for c in remote.changes)
    # From object storage with read_parallelism null: reads wait on the network, four per CPU of the run (2 here).
    network = data_pipeline(record({"time/data_wait_frac": [0.2]}, {"data.train": "s3://b/train"}))
    assert network is not None and network.changes[1].startswith("data.read_parallelism=8 (reads from object")
    assert data_pipeline(record({"time/data_wait_frac": [0.1]})) is None


def test_free_device_memory_suggests_a_larger_micro_batch() -> None:
    gpu = {"device/cuda": [1.0], "device/memory_total_gb": [80.0], "memory/peak_allocated_gb": [6.0, 7.5]}
    finding = memory_headroom(record(gpu))
    assert finding is not None and "7.5 of 80 GiB" in finding.title
    # 128 = 64 x 1 x 2 workers: no accumulation to trade, so a doubled micro-batch comes with a doubled batch.
    # auto derives the accumulation (a config that pins it refuses auto without null); a doubled micro-batch comes
    # with the accumulation and the global batch it needs.
    assert finding.changes == (
        "train.micro_batch_size=auto --set train.grad_accum_steps=null (the largest micro-batch that fits, measured "
        "on the device)", "train.global_batch_size=256 --set train.micro_batch_size=128 --set train.grad_accum_steps=1 "
        "(no accumulation left to trade: twice the samples per step changes the optimisation, so retune optim.lr and "
        "compare the loss)")
    accumulating = memory_headroom(record(gpu, {"train.global_batch_size": "512"}))  # 4 accumulation steps
    assert accumulating is not None
    assert accumulating.changes[1] == ("train.micro_batch_size=128 --set train.grad_accum_steps=2 (half the "
                                       "accumulation steps)")
    fsdp = memory_headroom(record(gpu, {"train.parallel": "fsdp"}))  # fsdp refuses auto: a number only
    assert fsdp is not None and not [c for c in fsdp.changes if "=auto" in c], fsdp.changes
    assert memory_headroom(record({**gpu, "memory/peak_allocated_gb": [60.0]})) is None
    assert memory_headroom(record()) is None  # CPU: no device memory figures


def test_a_ddp_run_whose_model_state_fills_the_device_is_told_to_shard_it() -> None:
    gib = 2**30
    # 1B parameters under AdamW on 4 workers of 24 GiB: 4 GB of parameters, 4 of gradients, 8 of optimizer state
    # on every worker (the worker's facts), 62% of the device; sharded, a quarter of it.
    gpu = {"device/cuda": [1.0], "device/memory_total_gb": [24.0], "world_size": [4.0] * 4,
           "param_bytes_per_rank": [4e9], "optimizer_bytes_per_rank": [8e9]}
    finding = model_state(record(gpu))
    assert finding is not None and finding.changes == ("train.parallel=fsdp",) and finding.severity == MEDIUM
    assert f"{16e9 / gib:.1f} GiB" in finding.title and f"{4e9 / gib:.1f} GiB" in finding.title, finding.title
    assert "4 workers" in finding.title and f"{16e9 / (24 * gib):.0%}" in finding.title
    # Out of memory once (the auto micro-batch retried): high, whatever the share.
    oom = model_state(record({**gpu, "device/memory_total_gb": [80.0], "oom_retries": [1.0]}))
    assert oom is not None and oom.severity == HIGH and "out of memory" in oom.title
    # The budget the user set counts instead of the device's memory.
    assert model_state(record({**gpu, "device/memory_total_gb": [80.0]}, {"train.memory_budget_gb": "20"}))
    assert model_state(record({**gpu, "device/memory_total_gb": [80.0]})) is None  # a fifth of the device
    assert model_state(record(gpu, {"train.parallel": "fsdp"})) is None  # sharded already
    assert model_state(record({**gpu, "world_size": [1.0]})) is None  # one worker: nothing to shard over
    assert model_state(record({**gpu, "device/memory_total_gb": [6.0]})) is None  # sharded: over half of it
    assert model_state(record()) is None  # no memory figures


def test_fp32_on_a_bf16_gpu_suggests_bf16() -> None:
    gpu = {"device/cuda": [1.0], "device/bf16_supported": [1.0]}
    finding = precision(record(gpu, tags={"orchestrator.precision": "fp32"}))
    assert finding is not None and finding.changes == (
        "train.precision=bf16", "`--autopilot` measures this (bf16 against fp32 on this device) when train.precision "
        "is left auto")
    assert precision(record(gpu, tags={"orchestrator.precision": "bf16"})) is None
    assert precision(record({**gpu, "device/bf16_supported": [0.0]}, tags={"orchestrator.precision": "fp32"})) is None
    assert precision(record(tags={"orchestrator.precision": "fp32"})) is None  # CPU


def test_low_mfu_with_small_kernels_suggests_compile() -> None:
    small = {"mfu": [0.04, 0.05], "flops_per_sample": [2e6]}
    finding = compile_small_kernels(record(small))
    assert finding is not None and finding.changes == (
        "train.compile=true", "`--autopilot` measures this: compiled against eager, its compile time counted")
    assert "4.5%" in finding.title
    assert compile_small_kernels(record(small, {"train.compile": "True"})) is None
    assert compile_small_kernels(record({"mfu": [0.05], "flops_per_sample": [1e10]})) is None  # big kernels
    assert compile_small_kernels(record({"mfu": [0.45], "flops_per_sample": [2e6]})) is None


def test_many_nonfinite_steps_suggest_lower_lr_and_longer_warmup() -> None:
    finding = nonfinite_steps(record({"nonfinite_skipped": [0.0, 3.0, 6.0, 8.0]}))
    assert finding is not None and finding.severity == HIGH and "8 of 100 steps" in finding.title
    assert finding.changes == ("optim.lr=0.001", "optim.warmup_steps=40")
    assert nonfinite_steps(record({"nonfinite_skipped": [0.0, 0.0, 0.0, 1.0]})) is None


def test_best_lr_at_the_edge_of_the_space_suggests_widening() -> None:
    tags = {"orchestrator.search_space": json.dumps({"optim.lr": {"loguniform": [1e-4, 1e-1]},
                                                    "optim.warmup_steps": {"choice": [0, 50]}}),
            "orchestrator.best_params": json.dumps({"optim.lr": 0.09, "optim.warmup_steps": 0})}
    finding = search_space_edge(RunRecord({}, {}, tags))
    assert finding is not None and finding.changes == ("tune.space.optim.lr: {loguniform: [0.0001, 1]}",)
    low = {**tags, "orchestrator.best_params": json.dumps({"optim.lr": 1.2e-4})}
    assert search_space_edge(RunRecord({}, {}, low)).changes == (  # type: ignore[union-attr]
        "tune.space.optim.lr: {loguniform: [1e-05, 0.1]}",)
    middle = {**tags, "orchestrator.best_params": json.dumps({"optim.lr": 3e-3})}
    assert search_space_edge(RunRecord({}, {}, middle)) is None


def test_findings_are_sorted_by_severity_then_strength_and_printed_as_set_flags() -> None:
    run = record({"time/data_wait_frac": [0.45], "mfu": [0.05], "flops_per_sample": [2e6],
                  "device/cuda": [1.0], "device/bf16_supported": [1.0], "device/memory_total_gb": [80.0],
                  "memory/peak_allocated_gb": [4.0]}, tags={"orchestrator.precision": "fp32"})
    findings = diagnose(run)
    assert [f.rule for f in findings] == ["precision", "data pipeline", "memory headroom", "compile"]
    text = format_findings("r1", run, findings)
    # Not started by `orchestrator train` (no command to complete): the --set values alone, said so once.
    assert text.splitlines()[1].startswith("(the run was not started by `orchestrator train` or `tune`")
    assert text.splitlines()[2] == "1. [high] precision: trained in fp32 on a GPU that supports bf16"
    assert "     --set train.precision=bf16" in text and "     --set data.prefetch_batches=4" in text
    # Started by it: the run's own command with the changes after its flags, the why on a line of its own.
    run.tags["mlflow.source.name"] = "orchestrator train --config examples/digits.yaml --resume --set train.seed=1"
    text = format_findings("r1", run, findings)
    assert text.splitlines()[1] == "1. [high] precision: trained in fp32 on a GPU that supports bf16"
    assert ("     orchestrator train --config examples/digits.yaml --set train.seed=1 --set train.precision=bf16"
            in text.splitlines())
    assert ("     orchestrator train --config examples/digits.yaml --set train.seed=1 --set "
            "'data.cache=~/.cache/orchestrator/shards'" not in text)  # local data: the memory cache
    memory = text.splitlines().index("     orchestrator train --config examples/digits.yaml --set train.seed=1 --set "
                                     "train.micro_batch_size=auto --set train.grad_accum_steps=null")
    assert text.splitlines()[memory + 1] == "       # the largest micro-batch that fits, measured on the device"
    # Under a finding, a line is a command that runs as printed or a shell comment (advice that is not a command, a
    # command's why): a block pasted whole runs the commands and nothing else.
    advice = Finding("evaluation", MEDIUM, 1.0, "evaluation took 52% of the training time",
                     ("train.eval_every=20", "a smaller validation split: each pass reads all of data.val"))
    text = format_findings("r1", run, [advice])
    assert text.splitlines()[2:] == [
        "     orchestrator train --config examples/digits.yaml --set train.seed=1 --set train.eval_every=20",
        "     # a smaller validation split: each pass reads all of data.val"], text
    # A run of an earlier version, whose Source showed the command's slashes as U+2215: the command completed is the
    # exact one, its `orchestrator.command`.
    run.tags["mlflow.source.name"] = "orchestrator train --config examples\u2215digits.yaml --set train.seed=1"
    run.tags["orchestrator.command"] = "orchestrator train --config examples/digits.yaml --set train.seed=1"
    assert ("     orchestrator train --config examples/digits.yaml --set train.seed=1 --set train.precision=bf16"
            in format_findings("r1", run, findings).splitlines())


@pytest.mark.parametrize("rule", [data_pipeline, memory_headroom, precision, compile_small_kernels,
                                  nonfinite_steps, search_space_edge, startup, report_blocking, evaluation,
                                  bookkeeping, gradient_sync, uneven_workers, study_size])
def test_rules_stay_quiet_on_an_empty_record(rule) -> None:  # type: ignore[no-untyped-def]
    assert rule(RunRecord()) is None


def space_tags(space: dict[str, object], best: dict[str, object]) -> dict[str, str]:
    return {"orchestrator.search_space": json.dumps(space), "orchestrator.best_params": json.dumps(best)}


def test_widening_stops_at_the_fields_own_bounds() -> None:
    # optim.momentum is in [0, 1): a best 0.95 at the top of [0.5, 0.95] may widen toward 1, never to or past it.
    momentum = search_space_edge(RunRecord({}, {}, space_tags({"optim.momentum": {"uniform": [0.5, 0.95]}},
                                                              {"optim.momentum": 0.95})))
    assert momentum is not None and len(momentum.changes) == 1
    upper = float(momentum.changes[0].rsplit(", ", 1)[1].rstrip("]}"))
    assert 0.95 < upper < 1.0, momentum.changes
    # optim.min_lr_ratio is in [0, 1]: widening stops at 1.
    ratio = search_space_edge(RunRecord({}, {}, space_tags({"optim.min_lr_ratio": {"uniform": [0.1, 0.6]}},
                                                           {"optim.min_lr_ratio": 0.6})))
    assert ratio is not None and ratio.changes == ("tune.space.optim.min_lr_ratio: {uniform: [0.1, 1]}",)


def test_no_widening_past_a_bound_the_range_already_touches() -> None:
    # weight_decay >= 0 and warmup_steps >= 0: a best value at 0 has nowhere lower to look.
    space = {"optim.weight_decay": {"uniform": [0.0, 0.1]}, "optim.warmup_steps": {"randint": [0, 50]},
             "optim.min_lr_ratio": {"uniform": [0.5, 1.0]}}
    best = {"optim.weight_decay": 0.0, "optim.warmup_steps": 0, "optim.min_lr_ratio": 1.0}
    assert search_space_edge(RunRecord({}, {}, space_tags(space, best))) is None
    # An unbounded side still widens. A model kwarg has no bounds in the config: a range of non-negative
    # values (sizes, dropout) is not widened into negatives.
    top = search_space_edge(RunRecord({}, {}, space_tags(
        {"optim.weight_decay": {"uniform": [0.0, 0.1]}, "model.dropout": {"uniform": [0.1, 0.3]}},
        {"optim.weight_decay": 0.1, "model.dropout": 0.1})))
    assert top is not None and top.changes == ("tune.space.optim.weight_decay: {uniform: [0, 0.2]}",
                                               "tune.space.model.dropout: {uniform: [0, 0.3]}")


def test_fp16_loss_scale_calibration_skips_are_not_divergence() -> None:
    # GradScaler skips a step whenever it lowers the loss scale: at the start and every ~2000 steps. Healthy.
    fp16 = record({"skipped_steps": [1.0, 2.0, 3.0, 3.0], "nonfinite_skipped": [0.0] * 4},
                  {"train.precision": "fp16"})
    assert nonfinite_steps(fp16) is None
    assert diagnose(fp16) == []
    diverging = record({"skipped_steps": [1.0, 2.0, 3.0, 3.0], "nonfinite_skipped": [0.0, 2.0, 4.0, 6.0]},
                       {"train.precision": "fp16"})
    finding = nonfinite_steps(diverging)
    assert finding is not None and "6 of 100 steps" in finding.title


def test_a_start_up_heavy_run_names_its_slowest_stage() -> None:
    # MLflow's opening (9 s, a slow server) ran beside the worker group's start: not what held the first step.
    stages = {"startup/ray_start_s": [4.4], "startup/worker_group_s": [7.9], "startup/datasets_s": [2.0],
              "startup/tracking_s": [9.0], "startup/total_s": [21.0]}
    finding = startup(record({"cost/startup_frac": [0.73], **stages}))
    assert finding is not None and finding.severity == HIGH
    assert finding.title == ("start-up took 73% of the run's wall clock (21.0 s to the first step; slowest: worker "
                             "group 7.9 s)")
    assert finding.changes[0].startswith("train.max_steps=")
    assert finding.changes[1].startswith("cluster.keep_warm_minutes=10 (the next command joins")
    cache = startup(record({"cost/startup_frac": [0.4], "startup/datasets_s": [9.0], "startup/total_s": [12.0]}))
    assert cache is not None and cache.severity == MEDIUM and "data.cache=none" in cache.changes[-1]
    assert startup(record({"cost/startup_frac": [0.2], **stages})) is None


def test_time_blocked_in_checkpoint_reports_suggests_fewer_checkpoints() -> None:
    finding = report_blocking(record({"cost/report_frac": [0.35]}, {"checkpoint.every": "50",
                                                                    "checkpoint.upload": "sync"}))
    assert finding is not None and finding.severity == HIGH and "35%" in finding.title
    assert finding.changes[:2] == ("checkpoint.every=100", "checkpoint.upload=async")
    # Without the run's ledger (a run still going), the intervals' own shares.
    assert report_blocking(record({"time/report_frac": [0.1, 0.2]})) is not None
    assert report_blocking(record({"cost/report_frac": [0.05]})) is None


# --------------------------------------------------------------------------- where the training time goes

# The run the issue reported "no findings" for: start-up 41-44% of the wall clock; of the training, other 39-40%,
# eval 17-18%, sync 12-14% (productive 3% of the wall clock); a small model (0.34 MB of gradients per step) on 3
# workers, one of them at 86,517 samples/s against 26-39k for the two others.
ISSUE_RUN = {"cost/startup_frac": [0.43], "cost/productive_frac": [0.03], "summary/time/other_frac": [0.395],
             "summary/time/eval_frac": [0.175], "summary/time/sync_frac": [0.13], "world_size": [3.0] * 4,
             WORKER_RATE.format(rank=0): [86_517.0], WORKER_RATE.format(rank=1): [26_000.0],
             WORKER_RATE.format(rank=2): [39_000.0]}


def test_the_issues_run_gets_a_finding_for_each_of_its_overheads() -> None:
    run = record(ISSUE_RUN, {"train.max_steps": "300", "scaling.num_workers": "3"})
    findings = diagnose(run)
    assert {f.rule for f in findings} == {"start-up", "other overhead", "evaluation", "gradient sync",
                                          "uneven workers"}
    text = format_findings("r1", run, findings)
    assert "no findings" not in text
    assert "     --set train.sync=local_sgd\n       # each worker steps alone and the workers average" in text
    assert "worker 0 ran at 86,517 samples/s, 2.7x the others (26,000-39,000)" in text


def test_a_phases_training_share_is_weighted_by_interval_seconds_and_leaves_start_up_out() -> None:
    # No summary (a trial's child run): the reports' shares, weighted by their seconds.
    trial = RunRecord(keyed({"time/eval_frac": [0.0, 0.5], "interval_s": [3.0, 1.0]}))
    assert training_share(trial, "eval") == pytest.approx(0.125)
    # The summary wins when there is one.
    assert training_share(record({"summary/time/eval_frac": [0.2]}), "eval") == pytest.approx(0.2)
    # A study's parent run has only the ledger: the part over the training parts (start-up, shutdown left out).
    parent = RunRecord(keyed({"cost/startup_frac": [0.5], "cost/shutdown_frac": [0.1], "cost/compute_frac": [0.2],
                              "cost/eval_frac": [0.1], "cost/other_frac": [0.1]}))
    assert training_share(parent, "eval") == pytest.approx(0.25)
    assert training_share(RunRecord(), "eval") is None


def test_a_large_eval_share_suggests_evaluating_less_often_or_on_a_smaller_split() -> None:
    finding = evaluation(record({"summary/time/eval_frac": [0.18]}, {"train.max_steps": "300"}))
    assert finding is not None and finding.severity == MEDIUM and "18% of the training time" in finding.title
    assert finding.changes[0] == "train.eval_every=200"
    assert finding.changes[1].startswith("a smaller validation split: each pass reads all of data.val")
    heavy = evaluation(record({"time/eval_frac": [0.0, 0.0, 0.0, 0.7], "interval_s": [1.0, 1.0, 1.0, 6.0]},
                              {"train.eval_every": "50"}))
    assert heavy is not None and heavy.severity == HIGH and "(1 pass over the validation split)" in heavy.title
    assert heavy.changes[0] == "train.eval_every=null (validate at the end only)"
    # Already validating at the end only, and that one pass as long as ~670 training steps: a smaller split is the
    # one change left. (A short run's one pass: test_one_end_of_run_validation_pass_is_not_blamed_on_the_split.)
    end_only = evaluation(record({"summary/time/eval_frac": [0.4]}, {"train.eval_every": "None",
                                                                     "train.max_steps": "1000"}))
    assert end_only is not None and len(end_only.changes) == 1
    assert end_only.changes[0].startswith("a smaller validation split")
    assert evaluation(record({"summary/time/eval_frac": [0.08]})) is None
    assert evaluation(record()) is None  # the healthy run: one pass, 3% of the training


def test_much_time_in_no_phase_suggests_fewer_reports_and_larger_steps() -> None:
    finding = bookkeeping(record({"summary/time/other_frac": [0.39]}))
    assert finding is not None and finding.severity == HIGH and "39%" in finding.title
    assert [c.split(" ")[0] for c in finding.changes] == ["train.log_every=50", "train.global_batch_size=256"]
    assert bookkeeping(record({"summary/time/other_frac": [0.2]})).severity == MEDIUM  # type: ignore[union-attr]
    assert bookkeeping(record()) is None  # 6%


def test_sync_heavy_small_model_suggests_fewer_workers_or_local_sgd() -> None:
    finding = gradient_sync(record({"summary/time/sync_frac": [0.13]}))
    assert finding is not None and finding.severity == MEDIUM
    assert finding.title == "gradient sync took 13% of the training time (2 workers, 0.35 MB of gradients per step)"
    assert [c.split(" ")[0] for c in finding.changes] == ["scaling.num_workers=1", "train.sync=local_sgd"]
    # A large model (128 MB of gradients per step): local SGD, or fewer all-reduces per sample.
    large = gradient_sync(record({"summary/time/sync_frac": [0.3], "comm_bytes_per_sample": [1e6]}))
    assert large is not None and large.severity == HIGH
    assert [c.split(" ")[0] for c in large.changes] == ["train.sync=local_sgd", "train.global_batch_size=256"]
    # Already on local SGD: average less often.
    local = gradient_sync(record({"summary/time/sync_frac": [0.2]}, {"train.sync": "local_sgd",
                                                                     "train.sync_every": "None"}))
    assert local is not None and local.changes[0].startswith("train.sync_every=16")
    assert gradient_sync(record()) is None  # 5%
    assert gradient_sync(record({"summary/time/sync_frac": [0.3], "world_size": [1.0]})) is None


def test_one_worker_much_faster_or_slower_than_the_others_is_named() -> None:
    fast = uneven_workers(record(ISSUE_RUN))
    assert fast is not None and fast.severity == HIGH
    assert fast.title.startswith("worker 0 ran at 86,517 samples/s, 2.7x the others (26,000-39,000)")
    assert fast.changes[0].startswith("check the other workers' nodes")
    assert fast.changes[1].startswith("check scaling.cpus_per_worker (now 1.0) against a node's cores")
    rates = {WORKER_RATE.format(rank=r): [v] for r, v in enumerate([10_000.0, 10_400.0, 6_000.0, 9_800.0])}
    slow = uneven_workers(record({**rates, "world_size": [4.0]}))
    assert slow is not None and slow.severity == MEDIUM and slow.title.startswith("worker 2 ran at 6,000 samples/s")
    assert "0.6x" in slow.title and slow.changes[0].startswith("check worker 2's node")
    even = {**rates, WORKER_RATE.format(rank=2): [9_000.0]}
    assert uneven_workers(record({**even, "world_size": [4.0]})) is None
    assert uneven_workers(record()) is None  # the healthy pair: within 5%
    # What runs record today: no per-worker pace at all.
    assert uneven_workers(record({WORKER_RATE.format(rank=r): [] for r in range(2)})) is None


# --------------------------------------------------------------------------- studies

def study(space: dict[str, object], best: dict[str, object], counts: dict[str, int],
          params: dict[str, str] | None = None) -> RunRecord:
    """A study's parent run as study.py records it."""
    metrics = keyed({f"trials_{status}": [float(n)] for status, n in counts.items()})
    tags = {"orchestrator.role": "study", "mlflow.runName": "digits-mlp-study", **space_tags(space, best)}
    return RunRecord(metrics, {"tune.scheduler": "asha", "tune.searcher": "random", **(params or {})}, tags)


LR_WARMUP = {"optim.lr": {"loguniform": [1e-4, 1e-1]}, "optim.warmup_steps": {"choice": [0, 50, 200]}}


def test_a_study_with_few_trials_per_searched_key_suggests_more_samples() -> None:
    run = study(LR_WARMUP, {"optim.lr": 3e-3, "optim.warmup_steps": 50}, {"completed": 3, "stopped": 1})
    finding = study_size(run)
    assert finding is not None and finding.severity == MEDIUM
    assert finding.title.startswith("study of 4 trials for 2 searched keys (optim.lr, optim.warmup_steps)")
    assert finding.changes[0].startswith("tune.num_samples=8 (ASHA stops weak trials early")
    assert study_size(study(LR_WARMUP, {}, {"completed": 2})).severity == HIGH  # type: ignore[union-attr]
    assert study_size(study(LR_WARMUP, {}, {"completed": 5, "stopped": 3})) is None
    # A grid key multiplies the trials (each sample runs every grid value) instead of needing samples.
    grid = {"optim.lr": {"loguniform": [1e-4, 1e-1]}, "train.global_batch_size": {"grid": [64, 128, 256]}}
    few = study_size(study(grid, {}, {"completed": 6}, {"tune.searcher": "optuna"}))
    assert few is not None and few.changes == ("tune.num_samples=20 (ASHA stops weak trials early, so extra ones "
                                               "cost less than full runs; Optuna's TPE samples at random for its "
                                               "first 10 trials)",)
    assert study_size(study(grid, {}, {"completed": 6}, {"tune.scheduler": "fifo"})).changes == (  # type: ignore
        "tune.num_samples=4 (each is a full run)",)
    assert study_size(study(grid, {}, {"completed": 12})) is None
    assert study_size(record()) is None  # not a study


def test_a_study_names_its_trials_not_steps_in_the_header() -> None:
    run = study(LR_WARMUP, {"optim.lr": 3e-3, "optim.warmup_steps": 50}, {"completed": 3, "stopped": 1})
    text = format_findings("p1", run, diagnose(run))
    assert text.splitlines()[0] == "doctor: run digits-mlp-study (p1), study of 4 trials (3 completed, 1 stopped early)"
    assert "0 steps" not in text
    assert "     --set tune.num_samples=8\n       # ASHA" in text  # tune.num_samples is a --set; a space edit is YAML
    run.tags["mlflow.source.name"] = "orchestrator tune --config examples/digits-tune.yaml"
    # A changed study is a new one (the saved one refuses another config): --fresh; its trials stay in MLflow.
    assert ("     orchestrator tune --config examples/digits-tune.yaml --fresh --set tune.num_samples=8"
            in format_findings("p1", run, diagnose(run)).splitlines())
    edge = study(LR_WARMUP, {"optim.lr": 0.09, "optim.warmup_steps": 50}, {"completed": 8})
    assert "     # tune.space.optim.lr: {loguniform: [0.0001, 1]}" in format_findings("p2", edge, diagnose(edge))


def test_best_value_at_the_end_of_a_choice_list_suggests_one_more_value() -> None:
    top = search_space_edge(RunRecord({}, {}, space_tags(LR_WARMUP, {"optim.lr": 3e-3, "optim.warmup_steps": 200})))
    assert top is not None and top.changes == ("tune.space.optim.warmup_steps: {choice: [0, 50, 200, 800]}",)
    lrs = {"optim.lr": {"choice": [1e-4, 1e-3, 1e-2]}, "optim.weight_decay": {"grid": [0.1, 0.2, 0.3]}}
    both = search_space_edge(RunRecord({}, {}, space_tags(lrs, {"optim.lr": 1e-4, "optim.weight_decay": 0.3})))
    assert both is not None and both.changes == ("tune.space.optim.lr: {choice: [1e-05, 0.0001, 0.001, 0.01]}",
                                                 "tune.space.optim.weight_decay: {grid: [0.1, 0.2, 0.3, 0.4]}")
    # Within the key's bounds: momentum < 1 gets a value short of 1; a lower edge at the bound gets nothing.
    momentum = search_space_edge(RunRecord({}, {}, space_tags({"optim.momentum": {"choice": [0.8, 0.9, 0.95]}},
                                                              {"optim.momentum": 0.95})))
    assert momentum is not None and 0.95 < float(momentum.changes[0].split(", ")[-1].rstrip("]}")) < 1.0
    quiet = [({"optim.warmup_steps": {"choice": [0, 50, 200]}}, {"optim.warmup_steps": 50}),  # in the middle
             ({"optim.warmup_steps": {"choice": [0, 50, 200]}}, {"optim.warmup_steps": 0}),  # 0 is its bound
             ({"optim.lr": {"choice": [1e-3, 1e-2]}}, {"optim.lr": 1e-2}),  # two values: a comparison
             ({"optim.name": {"choice": ["adamw", "sgd", "lion"]}}, {"optim.name": "lion"})]  # not numbers
    for space, best in quiet:
        assert search_space_edge(RunRecord({}, {}, space_tags(space, best))) is None, space


# --------------------------------------------------------------------------- every suggestion applies

def config_key(key: str) -> bool:
    from pydantic import BaseModel

    from orchestrator.config import Config

    model: object = Config
    for name in key.split("."):
        fields = getattr(model, "model_fields", {})
        if name not in fields:
            return False
        model = fields[name].annotation
    return not (isinstance(model, type) and issubclass(model, BaseModel))


def bad_runs() -> list[RunRecord]:
    return [record(ISSUE_RUN), record({"summary/time/sync_frac": [0.3], "comm_bytes_per_sample": [1e6]}),
            record({"summary/time/sync_frac": [0.3]}, {"train.sync": "local_sgd"}),
            record({"time/data_wait_frac": [0.5]}, {"data.read_parallelism": "4"}),
            record({"cost/report_frac": [0.4]}, {"checkpoint.every": "50", "checkpoint.upload": "sync"}),
            record({"cost/startup_frac": [0.6], "startup/datasets_s": [9.0], "startup/tracking_s": [1.0]}),
            study(LR_WARMUP, {"optim.lr": 0.09, "optim.warmup_steps": 200}, {"completed": 2},
                  {"tune.searcher": "optuna"})]


def test_every_set_change_is_a_config_key() -> None:
    findings: list[Finding] = [f for run in bad_runs() for f in diagnose(run)]
    assert len({f.rule for f in findings}) >= 9
    keys = {c.split("=", 1)[0] for f in findings for c in f.changes
            if "=" in c and not c.startswith(("tune.space.", "RAY_"))}
    assert keys and all(config_key(k) for k in keys), sorted(k for k in keys if not config_key(k))


def test_metrics_are_read_under_their_mlflow_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    # When the tracking layer renames keys (train_loss -> train/loss), doctor follows mlflow_key, not literals.
    import orchestrator.doctor.record as doctor_record

    expected = [(f.rule, f.title, f.changes) for f in diagnose(record(ISSUE_RUN))]
    monkeypatch.setattr(doctor_record, "mlflow_key", lambda name: f"renamed/{name}")
    renamed = RunRecord({f"renamed/{k}": v for k, v in {**HEALTHY, **ISSUE_RUN}.items()}, PARAMS, {})
    assert [(f.rule, f.title, f.changes) for f in diagnose(renamed)] == expected
    assert diagnose(RunRecord({k: v for k, v in {**HEALTHY, **ISSUE_RUN}.items()}, PARAMS, {})) == []


def test_checkpoint_interval_follows_the_measured_failure_rate_and_checkpoint_cost() -> None:
    import math

    ledger = {"cost/wall_s": [1000.0], "cost/compute_frac": [0.70], "cost/checkpoint_frac": [0.04],
              "cost/report_frac": [0.01], "cost/startup_frac": [0.25]}
    failed = {f"orchestrator.failure.{i}": f"after step {100 * i}: boom" for i in (1, 2, 3, 4)}
    params = {"train.max_steps": "1000", "checkpoint.every": "500"}
    # 2 checkpoints cost 50 s, 25 s each; 4 failures in 1000 s; a step is 750 s / 1000 steps of training.
    found = checkpoint_interval(record(ledger, params, failed))
    # sqrt(2 x 25 s x 250 s) = 158 s, but checkpoints blocking 25 s may take at most 3% of the time: 833 s (as
    # checkpoint.every=auto clamps it), 1111 steps.
    expected = round(max(math.sqrt(2 * 25.0 * 250.0), 25.0 / 0.03) / 0.75)
    assert found is not None and found.changes[1:] == (f"checkpoint.every={expected}",), found
    assert found.changes[0].startswith("checkpoint.every=auto")
    assert "sqrt(2 x 25 s a checkpoint x 250 s between interruptions)" in found.title, found.title
    # Without failures there is no rate to weigh against; near the optimum there is nothing to change.
    assert checkpoint_interval(record(ledger, params)) is None
    assert checkpoint_interval(record(ledger, {**params, "checkpoint.every": str(expected)}, failed)) is None


def test_sync_heavy_fsdp_run_is_never_told_to_use_local_sgd() -> None:
    # train.sync=local_sgd is refused with train.parallel=fsdp: the rule names what fsdp can change instead.
    fsdp = {"train.parallel": "fsdp", "train.grad_accum_steps": "4", "train.fsdp.defer_sync": "False"}
    finding = gradient_sync(record({"summary/time/sync_frac": [0.3], "comm_bytes_per_sample": [1e6]}, fsdp))
    assert finding is not None and not any("local_sgd" in c for c in finding.changes), finding
    assert [c.split(" ")[0] for c in finding.changes] == ["train.fsdp.defer_sync=true", "train.global_batch_size=256"]
    deferred = gradient_sync(record({"summary/time/sync_frac": [0.3]}, {**fsdp, "train.fsdp.defer_sync": "True"}))
    assert deferred is not None and [c.split(" ")[0] for c in deferred.changes] == ["train.global_batch_size=256"]


# --------------------------------------------------------------------------- what doctor prints can be run

def every_rules_run() -> list[RunRecord]:
    """Runs that, between them, make every rule in RULES fire."""
    gpu = {"device/cuda": [1.0], "device/bf16_supported": [1.0], "device/memory_total_gb": [24.0],
           "memory/peak_allocated_gb": [3.0], "world_size": [4.0] * 4, "param_bytes_per_rank": [4e9],
           "optimizer_bytes_per_rank": [8e9], "mfu": [0.05], "flops_per_sample": [2e6],
           "nonfinite_skipped": [0.0, 3.0, 6.0, 8.0]}
    failed = {f"orchestrator.failure.{i}": f"after step {100 * i}: boom" for i in (1, 2, 3, 4)}
    ledger = {"cost/wall_s": [1000.0], "cost/compute_frac": [0.70], "cost/checkpoint_frac": [0.04],
              "cost/report_frac": [0.01], "cost/startup_frac": [0.25]}
    return [*bad_runs(),
            record(gpu, {"scaling.num_workers": "4", "train.global_batch_size": "256", "scaling.use_gpu": "True"},
                   {"orchestrator.precision": "fp32"}),
            record(ledger, {"train.max_steps": "1000", "checkpoint.every": "500"}, failed),
            record(AUTOPILOT_RUN, AUTOPILOT_PARAMS),
            record({"time/data_wait_frac": [0.5]}, {"data.train": "s3://b/train", "data.val": "s3://b/val"}),
            record({"summary/time/eval_frac": [0.4]}, {"train.max_steps": "300", "train.eval_every": "25"}),
            record({"summary/time/eval_frac": [0.4]}, {"train.max_steps": "300", "train.eval_every": "100"}),
            study(LR_WARMUP, {"optim.lr": 3e-3, "optim.warmup_steps": 200}, {"completed": 3},
                  {"train.max_steps": "300", "train.log_every": "25", "train.eval_every": "100",
                   "tune.metric": "None"})]


def run_overrides(run: RunRecord) -> list[str]:
    """The run's own config as --set flags (its params that are config keys): a suggestion is checked in the
    context it was made for (a disk cache for remote data, local SGD for a ddp run)."""
    return [f"{key}={value}" for key, value in run.params.items()
            if config_key(key) and value != "None" and key != "train.grad_accum_steps"]  # derived: refused as input


def printed_advice(text: str) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """(the `orchestrator ...` commands, the `--set key=value` pairs, the `tune.space.KEY: VALUE` edits) in doctor's
    output."""
    import re

    commands = [m.group(1).strip() for m in re.finditer(r"\b(orchestrator [^)`;]*)", text)]
    sets = re.findall(SET, text)
    spaces = re.findall(r"^\s+(tune\.space\.[\w.]+: .*)$", text, re.MULTILINE)
    return commands, sets, spaces


SET = r"--set ([\w.]+)=(<[^>]*>|\S+)"


def test_every_command_and_set_doctor_prints_is_accepted_by_the_cli_and_the_config() -> None:
    import re
    import shlex

    from orchestrator.cli import build_parser
    from orchestrator.config import load_config
    from orchestrator.doctor.engine import RULES

    runs = every_rules_run()
    findings = [diagnose(run) for run in runs]
    assert {f.rule for found in findings for f in found} == {
        "start-up", "checkpoint reports", "checkpoint interval", "data pipeline", "evaluation", "other overhead",
        "gradient sync", "uneven workers", "memory headroom", "model state", "precision", "compile",
        "non-finite steps", "study size", "search space", "autopilot"}
    assert len(RULES) == 16  # a new rule joins the set above, and a run here that makes it fire
    checked = 0
    for run, found in zip(runs, findings, strict=True):
        base = run_overrides(run)
        load_config(None, base)  # the run itself is a valid config
        commands, sets, spaces = printed_advice(format_findings("r", run, found))
        for command in commands:
            try:
                build_parser().parse_args(shlex.split(command)[1:])
            except SystemExit:
                pytest.fail(f"doctor printed a command the CLI refuses: {command}")
        for line in format_findings("r", run, found).splitlines():  # the --set flags of a line apply together
            pairs = re.findall(SET, line)
            assert all(config_key(key) for key, _ in pairs), line
            assert not [value for _, value in pairs if value.startswith("<")], line  # no figure left to fill in
            load_config(None, [*base, *(f"{key}={value}" for key, value in pairs)])
            checked += len(pairs)
        assert sets
        for edit in spaces:
            key, _, domain = edit.removeprefix("tune.space.").partition(": ")
            load_config(None, [*base, f"tune.space={{{key}: {domain}}}"])
            checked += 1
    assert checked >= 25


# --------------------------------------------------------------------------- advice in its context

def test_under_asha_evaluation_advice_keeps_a_validation_at_every_report() -> None:
    # docs/tune.md's rule: ASHA compares trials at every report, so a study on a validation metric evaluates at each.
    run = study(LR_WARMUP, {"optim.lr": 3e-3, "optim.warmup_steps": 50}, {"completed": 8},
                {"train.max_steps": "300", "train.log_every": "25", "train.eval_every": "25"})
    run.metrics.update(keyed({"cost/startup_frac": [0.2], "cost/compute_frac": [0.3], "cost/eval_frac": [0.3],
                              "cost/other_frac": [0.2]}))
    found = {f.rule: f for f in diagnose(run)}
    text = format_findings("p", run, list(found.values()))
    sets = dict(printed_advice(text)[1])
    assert "evaluation" in found and "other overhead" in found, text
    assert sets.get("train.eval_every") == sets.get("train.log_every") == "50", text
    for change in (*found["evaluation"].changes, *found["other overhead"].changes):
        if "train.eval_every=" in change or "train.log_every=" in change:
            assert "train.eval_every=50" in change and "train.log_every=50" in change, change
    # Not under ASHA (fifo), or ranked by a training metric: the evaluation cadence is the run's own again.
    fifo = study(LR_WARMUP, {}, {"completed": 8}, {"tune.scheduler": "fifo", "train.max_steps": "300",
                                                   "train.log_every": "25", "train.eval_every": "25"})
    fifo.metrics.update(run.metrics)
    assert evaluation(fifo).changes[0] == "train.eval_every=50"  # type: ignore[union-attr]


def test_one_end_of_run_validation_pass_is_not_blamed_on_the_split() -> None:
    # 40 steps, validation at the end only (eval_every 100 > max_steps): the one pass is a fixed cost of the run.
    short = record({"summary/time/eval_frac": [0.35], "step": [10.0, 20.0, 30.0, 40.0]},
                   {"train.max_steps": "40", "train.eval_every": "100"})
    finding = evaluation(short)
    assert finding is None or not any("data.val" in c for c in finding.changes), finding
    assert finding is None or ("one validation pass" in finding.title and "end of the run" in finding.title)
    # Validating during the run (eval_every below max_steps), a large share is the cadence's doing.
    often = evaluation(record({"summary/time/eval_frac": [0.35]}, {"train.max_steps": "300",
                                                                   "train.eval_every": "25"}))
    assert often is not None and often.changes[0] == "train.eval_every=50"


def test_the_readmes_doctor_example_prints_only_advice_that_applies() -> None:
    # Its commands run as printed (from the checkout, where examples/ is): the CLI takes each, the config loads.
    from orchestrator.cli import build_parser
    from orchestrator.config import load_config

    root = Path(__file__).resolve().parents[3]
    readme = (root / "README.md").read_text()
    example = readme[readme.index("# doctor: run "):]
    example = example[:example.index("```")]
    commands = printed_commands("\n".join(line.removeprefix("# ") for line in example.splitlines()))
    assert len(commands) >= 4 and "=<" not in example
    for argv in commands:
        args = build_parser().parse_args(argv[1:])
        load_config(root / args.config, args.overrides)
        assert all(config_key(value.split("=", 1)[0]) for value in args.overrides), argv


def test_doctor_prints_no_download_progress_bars_and_leaves_mlflows_setting_alone(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # doctor downloads the run's summary table: MLflow draws a tqdm bar on stderr for it unless told not to.
    from orchestrator.cli import main
    from orchestrator.config import TrackingConfig
    from orchestrator.tracking.client import MlflowTracker

    uri = f"sqlite:///{tmp_path}/mlruns.db"
    tracker = MlflowTracker(TrackingConfig(uri=uri, experiment="doctor"), "r")
    for step in (10, 20):  # reported twice, unchanged: a figure of the summary table (an artifact)
        tracker.log_metrics({"train_loss": 1.0 / step, "flops_per_sample": 2e6, "step": step}, step=step)
    tracker.finish("FINISHED")
    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
    capfd.readouterr()
    assert main(["doctor", str(tracker.run_id), "--tracking-uri", uri]) == 0
    out, err = capfd.readouterr()
    assert out.startswith("doctor: run r "), out
    assert "Downloading artifacts" not in err and "it/s" not in err, err
    assert "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR" not in os.environ  # the user's setting, untouched


# --------------------------------------------------------------------------- the autopilot

def test_an_autopilot_run_reports_its_predicted_against_its_achieved_speedup() -> None:
    finding = autopilot_gain(record(AUTOPILOT_RUN, AUTOPILOT_PARAMS))
    assert finding is not None and finding.severity == 1  # LOW: achieved 1.25x of a predicted 1.3x
    assert finding.title == "predicted 1.30x over the configuration as written, achieved 1.25x; its search took 8.2 s"
    # What the choice changes of the config, as one line of --set flags: the accumulation is derived from the
    # micro-batch at the global batch; compile (False) and torch_threads (null) are the config's already.
    # The micro-batch comes with its accumulation at the global batch (128 = 32 x 2 x 2 workers), and the search
    # is turned off (a config may enable it).
    assert finding.changes == ("train.micro_batch_size=32 --set train.grad_accum_steps=2 --set "
                               "train.flush_denormal=true --set train.precision=fp32 --set autopilot.enabled=false "
                               "(the autopilot's choice: trains with it without a search)",)
    # Achieved under 0.9 of the prediction (1.1 < 1.17): a finding of its own, the shortfall its strength.
    short = autopilot_gain(record({**AUTOPILOT_RUN, "autopilot/achieved_speedup": [1.1]}, AUTOPILOT_PARAMS))
    assert short is not None and short.severity == MEDIUM and abs(short.score - 0.2) < 1e-9
    assert "ran slower than the search measured them" in short.title
    assert autopilot_gain(record()) is None  # not an autopilot run
    printed = format_findings("r", record(AUTOPILOT_RUN, AUTOPILOT_PARAMS), [finding])
    assert ("     --set train.micro_batch_size=32 --set train.grad_accum_steps=2 --set train.flush_denormal=true"
            in printed)
    # Run by `--autopilot`: the flag (which wins over --set) is left out, so the command trains without a search.
    started = record(AUTOPILOT_RUN, AUTOPILOT_PARAMS, {"mlflow.source.name": "orchestrator train --autopilot"})
    assert "     orchestrator train --set train.micro_batch_size=32 --set" in format_findings("r", started, [finding])
    # The configuration as written kept: nothing to set.
    same = {**AUTOPILOT_PARAMS, "autopilot.micro_batch_size": "64", "autopilot.flush_denormal": "True",
            "autopilot.precision": "auto"}
    kept = autopilot_gain(record(AUTOPILOT_RUN, {**same, "train.micro_batch_size": "64",
                                                 "train.flush_denormal": "True"}))
    assert kept is not None and kept.changes == ()


def test_a_finding_the_autopilot_measured_on_the_run_is_settled() -> None:
    small = {"mfu": [0.04, 0.05], "flops_per_sample": [2e6]}
    assert compile_small_kernels(record(small)) is not None
    assert compile_small_kernels(record(small, {"autopilot.compile": "False"})) is None
    gpu = {"device/cuda": [1.0], "device/bf16_supported": [1.0]}
    assert precision(record(gpu, {"autopilot.precision": "fp32"}, {"orchestrator.precision": "fp32"})) is None
    memory = {"device/cuda": [1.0], "device/memory_total_gb": [80.0], "memory/peak_allocated_gb": [6.0]}
    accumulating = memory_headroom(record(memory, {"train.global_batch_size": "512"}))  # 4 accumulation steps
    assert accumulating is not None and accumulating.changes[-1].startswith("`--autopilot` measures this")
    assert memory_headroom(record(memory, {"train.global_batch_size": "512",
                                           "autopilot.micro_batch_size": "64"})) is None
    # No accumulation left: only a larger global batch (a change of the math the autopilot never makes) remains.
    whole = memory_headroom(record(memory, {"autopilot.micro_batch_size": "64"}))
    assert whole is not None and "global_batch_size=256" in whole.changes[-1]


# --------------------------------------------------------------------------- advice runs as printed, on the examples

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples").glob("*.yaml"))
FAILED = {f"orchestrator.failure.{i}": f"after step {100 * i}: boom" for i in (1, 2, 3, 4)}
# (what the run recorded, the --set flags it was started with, its tags, its other flags): between them, runs that
# make every rule fire, each started from an example as a user starts one.
SCENARIOS: list[tuple[dict[str, list[float]], list[str], dict[str, str], list[str]]] = [
    (ISSUE_RUN, [], {}, []),
    ({"summary/time/sync_frac": [0.3], "comm_bytes_per_sample": [1e6]}, [], {}, []),
    ({"summary/time/sync_frac": [0.3], "comm_bytes_per_sample": [100.0]}, [], {}, []),
    ({"summary/time/sync_frac": [0.3]}, ["train.sync=local_sgd"], {}, []),
    ({"time/data_wait_frac": [0.5]}, ["data.read_parallelism=4"], {}, []),
    ({"time/data_wait_frac": [0.5]}, ["data.train=s3://b/train", "data.val=s3://b/val"], {}, []),
    ({"cost/report_frac": [0.4]}, ["checkpoint.every=50", "checkpoint.upload=sync"], {}, []),
    ({"cost/startup_frac": [0.6], "startup/datasets_s": [9.0], "startup/total_s": [12.0]}, [], {}, []),
    ({"device/cuda": [1.0], "device/bf16_supported": [1.0], "device/memory_total_gb": [24.0],
      "memory/peak_allocated_gb": [3.0], "param_bytes_per_rank": [4e9], "optimizer_bytes_per_rank": [8e9],
      "mfu": [0.05], "flops_per_sample": [2e6], "nonfinite_skipped": [0.0, 3.0, 6.0, 8.0]},
     ["train.precision=fp32"], {"orchestrator.precision": "fp32"}, []),
    ({"cost/wall_s": [1000.0], "cost/compute_frac": [0.70], "cost/checkpoint_frac": [0.04],
      "cost/report_frac": [0.01], "cost/startup_frac": [0.25]}, ["checkpoint.every=500"], FAILED, []),
    (AUTOPILOT_RUN, [], {}, ["--autopilot"]),
    ({"summary/time/eval_frac": [0.4]}, ["train.eval_every=25"], {}, []),
    ({"summary/time/eval_frac": [0.4]}, ["train.eval_every=null", "train.max_steps=1000"], {}, []),
    ({"summary/time/other_frac": [0.39]}, [], {}, []),
]


def autopilot_choice(params: dict[str, str]) -> dict[str, str]:
    """An autopilot run's params (autopilot_report.py): the config's, with the settings it chose, half the
    micro-batch at twice the accumulation among them, as `autopilot.<key>`."""
    micro, accum = params.get("train.micro_batch_size", "auto"), params.get("train.grad_accum_steps", "1")
    if not micro.isdigit():
        return {}
    return {**params, "autopilot.micro_batch_size": str(max(1, int(micro) // 2)),
            "autopilot.grad_accum_steps": str(int(accum) * 2 if int(micro) > 1 else int(accum)),
            "autopilot.compile": "False", "autopilot.torch_threads": "None", "autopilot.flush_denormal": "True",
            "autopilot.precision": "fp32"}


def example_run(example: Path, metrics: dict[str, list[float]], sets: list[str], tags: dict[str, str],
                flags: list[str], study_run: bool = False) -> RunRecord | None:
    """The MLflow record of a run started with `orchestrator train --config <example> <flags> --set ...` (tune for a
    study): its params the resolved config, as MLflow keeps them; None when the example refuses the flags."""
    import shlex

    from orchestrator.config import load_config
    from orchestrator.errors import ConfigError
    from orchestrator.tracking.context import config_params

    try:
        config = load_config(example, [*sets, *(["autopilot.enabled=true"] if "--autopilot" in flags else [])])
    except ConfigError:
        return None
    params = {key: str(value) for key, value in config_params(config).items()}
    if "--autopilot" in flags:
        params = autopilot_choice(params)
        if not params:
            return None
    micro = config.train.micro_batch_size if isinstance(config.train.micro_batch_size, int) else 16
    world = config.scaling.max_workers
    recorded = {**HEALTHY, "world_size": [float(world)] * 4, "micro_batch_size": [float(micro)] * 4,
                **{WORKER_RATE.format(rank=r): [10_000.0] for r in range(world)}, **metrics}
    command = ["orchestrator", "tune" if study_run else "train", "--config", str(example), *flags,
               *(part for item in sets for part in ("--set", item))]
    return RunRecord(keyed(recorded), params, {"mlflow.source.name": shlex.join(command), **tags})


def printed_commands(text: str) -> list[list[str]]:
    """The `orchestrator ...` command lines of doctor's report, as the shell splits them."""
    import shlex

    return [shlex.split(line) for line in text.splitlines() if line.strip().startswith("orchestrator ")]


def test_every_command_doctor_prints_runs_as_printed_on_every_example() -> None:
    # Each command is the run's own, with the changes as --set flags: the CLI takes it and the config it loads is
    # valid (a micro-batch comes with its accumulation, on an example that pins it), whatever the example; no value
    # is left for the user to fill in. The autopilot's choice trains without a search.
    from orchestrator.cli import build_parser
    from orchestrator.config import load_config
    from orchestrator.doctor.engine import RULES

    fired: set[str] = set()
    commands = 0
    for example in EXAMPLES:
        runs = [example_run(example, *scenario) for scenario in SCENARIOS]
        space = space_tags(LR_WARMUP, {"optim.lr": 0.09, "optim.warmup_steps": 200})
        runs.append(example_run(example, {"trials_completed": [2.0]}, [], {"orchestrator.role": "study", **space},
                                [], study_run=True))
        for run in (r for r in runs if r is not None):
            findings = [f for rule in RULES if (f := rule(run)) is not None]
            fired |= {f.rule for f in findings}
            text = format_findings("r", run, findings)
            assert "=<" not in text and "<2x" not in text, text  # no placeholder left to fill in
            for finding in findings:
                printed = printed_commands(format_findings("r", run, [finding]))
                assert len(printed) == sum(1 for c in finding.changes if settings(c) is not None), finding
                for argv in printed:
                    args = build_parser().parse_args(argv[1:])
                    overrides = [*args.overrides, *(["autopilot.enabled=true"] if getattr(args, "autopilot", False)
                                                    else [])]
                    try:
                        config = load_config(args.config, overrides)
                    except Exception as exc:
                        pytest.fail(f"{example.name}, {finding.rule}: `{shlex_join(argv)}` fails: {exc}")
                    assert finding.rule != "autopilot" or not config.autopilot.enabled, argv
                    commands += 1
    assert len(RULES) == len(RULE_NAMES)  # a new rule joins the names, and a scenario above makes it fire
    assert fired == set(RULE_NAMES), sorted(set(RULE_NAMES) - fired)
    assert commands >= 100


RULE_NAMES = ("start-up", "checkpoint reports", "checkpoint interval", "data pipeline", "evaluation",
              "other overhead", "gradient sync", "uneven workers", "memory headroom", "model state", "precision",
              "compile", "non-finite steps", "study size", "search space", "autopilot")


def shlex_join(argv: list[str]) -> str:
    import shlex

    return shlex.join(argv)


def test_local_sgd_advice_says_it_changes_the_optimisation() -> None:
    for run in (record({"summary/time/sync_frac": [0.3], "comm_bytes_per_sample": [1e6]}),
                record({"summary/time/sync_frac": [0.13]}),
                record({"summary/time/sync_frac": [0.2]}, {"train.sync": "local_sgd"})):
        finding = gradient_sync(run)
        assert finding is not None
        sgd = [c for c in finding.changes if "train.sync" in c]
        assert sgd and all("changes the optimisation" in c for c in sgd), finding.changes
