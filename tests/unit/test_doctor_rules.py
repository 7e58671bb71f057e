"""`orchestrator doctor`: each rule against hand-made metric histories, the order of findings, the output."""

from __future__ import annotations

import json

import pytest

from orchestrator.doctor import (
    HIGH,
    MEDIUM,
    RunRecord,
    compile_small_kernels,
    data_pipeline,
    diagnose,
    format_findings,
    memory_headroom,
    nonfinite_steps,
    precision,
    report_blocking,
    search_space_edge,
    startup,
)

HEALTHY = {"step": [25.0, 50.0, 75.0, 100.0], "time/data_wait_frac": [0.02, 0.01, 0.02, 0.01],
           "time/compute_frac": [0.85] * 4, "micro_batch_size": [64.0] * 4, "skipped_steps": [0.0] * 4}
PARAMS = {"data.prefetch_batches": "2", "data.read_parallelism": "None", "data.cache": "auto",
          "data.train": "data/digits/train", "data.transforms": "[]", "optim.lr": "0.003",
          "optim.warmup_steps": "20", "optim.max_grad_norm": "1.0", "train.compile": "False",
          "train.grad_accum_steps": "1", "train.precision": "auto"}


def record(metrics: dict[str, list[float]] | None = None, params: dict[str, str] | None = None,
           tags: dict[str, str] | None = None) -> RunRecord:
    return RunRecord({**HEALTHY, **(metrics or {})}, {**PARAMS, **(params or {})}, tags or {})


def test_a_healthy_cpu_run_has_no_findings() -> None:
    run = record()
    assert diagnose(run) == []
    assert "no findings" in format_findings("abc", run, [])


def test_data_wait_names_prefetch_parallelism_and_cache() -> None:
    finding = data_pipeline(record({"time/data_wait_frac": [0.5, 0.6, 0.4]}, {"data.prefetch_batches": "0"}))
    assert finding is not None and finding.severity == HIGH
    assert "50%" in finding.title
    assert finding.changes[:2] == ("data.prefetch_batches=4", "data.read_parallelism=<CPUs per node for reading, "
                                                              "e.g. 8>")
    assert "data.cache=memory" in finding.changes
    remote = data_pipeline(record({"time/data_wait_frac": [0.2]}, {"data.train": "s3://b/train",
                                                                   "data.read_parallelism": "4"}))
    assert remote is not None and remote.severity == MEDIUM
    assert "data.read_parallelism=8" in remote.changes and any("cache" in c and "remote" in c for c in remote.changes)
    assert data_pipeline(record({"time/data_wait_frac": [0.1]})) is None


def test_free_device_memory_suggests_a_larger_micro_batch() -> None:
    gpu = {"device/cuda": [1.0], "device/memory_total_gb": [80.0], "memory/peak_allocated_gb": [6.0, 7.5]}
    finding = memory_headroom(record(gpu))
    assert finding is not None and "7.5 of 80 GiB" in finding.title
    assert finding.changes[:2] == ("train.micro_batch_size=auto", "train.micro_batch_size=128 (or more)")
    assert memory_headroom(record({**gpu, "memory/peak_allocated_gb": [60.0]})) is None
    assert memory_headroom(record()) is None  # CPU: no device memory figures


def test_fp32_on_a_bf16_gpu_suggests_bf16() -> None:
    gpu = {"device/cuda": [1.0], "device/bf16_supported": [1.0]}
    finding = precision(record(gpu, tags={"orchestrator.precision": "fp32"}))
    assert finding is not None and finding.changes == ("train.precision=bf16",)
    assert precision(record(gpu, tags={"orchestrator.precision": "bf16"})) is None
    assert precision(record({**gpu, "device/bf16_supported": [0.0]}, tags={"orchestrator.precision": "fp32"})) is None
    assert precision(record(tags={"orchestrator.precision": "fp32"})) is None  # CPU


def test_low_mfu_with_small_kernels_suggests_compile() -> None:
    small = {"mfu": [0.04, 0.05], "flops_per_sample": [2e6]}
    finding = compile_small_kernels(record(small))
    assert finding is not None and finding.changes == ("train.compile=true",)
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
    assert text.splitlines()[1] == "1. [high] precision: trained in fp32 on a GPU that supports bf16"
    assert "     --set train.precision=bf16" in text and "     --set data.prefetch_batches=4" in text


@pytest.mark.parametrize("rule", [data_pipeline, memory_headroom, precision, compile_small_kernels,
                                  nonfinite_steps, search_space_edge])
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
    stages = {"startup/ray_start_s": [4.4], "startup/worker_group_s": [7.9], "startup/datasets_s": [2.0],
              "startup/total_s": [21.0]}
    finding = startup(record({"cost/startup_frac": [0.73], **stages}))
    assert finding is not None and finding.severity == HIGH
    assert finding.title == ("start-up took 73% of the run's wall clock (21.0 s to the first step; slowest: worker "
                             "group 7.9 s)")
    assert finding.changes[0].startswith("train.max_steps=")
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
