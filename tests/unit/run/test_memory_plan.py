"""The driver's memory estimate (orchestrator.run.memory_plan) against the worker's own DDP figure and plain arithmetic.
The FSDP figures are checked against bytes measured on real ranks in tests/unit/training/test_fsdp.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrator.errors import ConfigError
from orchestrator.run.memory_plan import estimate_bytes_per_rank
from orchestrator.training.memory import state_bytes


def test_ddp_estimate_is_the_workers_state_bytes() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(30, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    n = sum(p.numel() for p in model.parameters())
    for optimizer, slots in (("adamw", 2), ("sgd", 1)):
        for world in (1, 4):  # DDP replicates: the world size changes nothing per rank
            e = estimate_bytes_per_rank(n, world, "ddp", optimizer, "bf16")
            assert e["total"] == e["params"] + e["grads"] + e["optimizer"] == state_bytes(model, slots)
            assert e["gathered"] == 0


def test_fsdp_shards_everything_but_deferred_gradients_and_gathers_a_block() -> None:
    n, world = 1_000_003, 4
    ddp = estimate_bytes_per_rank(n, world, "ddp", "adamw", "bf16")
    fsdp = estimate_bytes_per_rank(n, world, "fsdp", "adamw", "bf16", block_params=50_000)
    for key in ("params", "grads", "optimizer"):
        assert fsdp[key] == -(-n // world) * ddp[key] // n  # 1/world, rounded up to whole parameters
    assert fsdp["gathered"] == 2 * 50_000 * 2  # two bf16 blocks in flight
    deferred = estimate_bytes_per_rank(n, world, "fsdp", "adamw", "bf16", defer_sync=True)
    assert deferred["grads"] == ddp["grads"] and deferred["params"] == fsdp["params"]
    assert estimate_bytes_per_rank(n, 1, "fsdp", "adamw", "fp32", block_params=50_000)["gathered"] == 0


@pytest.mark.parametrize(("args", "key"), [((10, 2, "zero", "adamw", "fp32"), "train.parallel"),
                                           ((10, 2, "fsdp", "lion", "fp32"), "optim.name"),
                                           ((10, 2, "fsdp", "adamw", "auto"), "train.precision")])
def test_unknown_values_name_their_key(args: tuple, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        estimate_bytes_per_rank(*args)


def test_the_fsdp_advice_names_the_setting_only_when_ddp_would_not_fit_and_fsdp_would() -> None:
    from orchestrator.run.memory_plan import fsdp_advice

    n, gib = 1_000_000_000, 2**30  # a 1B-parameter model under AdamW: 16 GB of model state per DDP rank
    ddp = estimate_bytes_per_rank(n, 4, "ddp", "adamw", "bf16")["total"]
    fsdp = estimate_bytes_per_rank(n, 4, "fsdp", "adamw", "bf16", block_params=50_000_000)["total"]
    assert ddp == 16 * n and fsdp == 4 * n + 2 * 50_000_000 * 2  # a quarter of it, two bf16 blocks in flight
    budget = (8 * gib, "train.memory_budget_gb=8")
    line = fsdp_advice(n, 50_000_000, 4, "adamw", "bf16", budget)
    assert line is not None and "\n" not in line and "--set train.parallel=fsdp" in line
    assert f"{ddp / gib:.1f} GiB" in line and f"{fsdp / gib:.1f} GiB" in line and "8.0 GiB" in line
    assert "train.memory_budget_gb=8" in line and "4 workers" in line
    assert fsdp_advice(n, 50_000_000, 4, "adamw", "bf16", (16 * gib, "budget")) is None  # ddp fits
    assert fsdp_advice(n, 50_000_000, 1, "adamw", "bf16", budget) is None  # one worker: nothing to shard over
    assert fsdp_advice(n, 50_000_000, 2, "adamw", "bf16", (6 * gib, "budget")) is None  # fsdp would not fit either
    # Plain SGD holds no optimizer state: 8 bytes per parameter under DDP fits the 8 GiB budget.
    assert fsdp_advice(n, 0, 4, "sgd_plain", "fp32", budget) is None


def _text_config(*overrides: str):  # type: ignore[no-untyped-def]
    from orchestrator.config import load_config

    return load_config(ROOT / "examples/text-gpt.yaml", ["model.num_classes=256", *overrides])


ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]
TOKENS = __import__("pipelines.sources", fromlist=["DatasetInfo"]).DatasetInfo(
    "train", [], num_rows=10_000, num_bytes=0, feature_dim=129, num_classes=256)


def test_the_driver_counts_the_workers_model_and_says_fsdp_fits_where_ddp_does_not() -> None:
    from orchestrator.models.zoo import build_model
    from orchestrator.run.checks import model_state_advice
    from orchestrator.training.fsdp import find_blocks

    # The built-in gpt at d_model 1024, 8 layers: counted here on the meta device as the driver counts it.
    sets = ["model.d_model=1024", "model.n_layer=8", "model.n_head=8", "scaling.num_workers=4"]
    with torch.device("meta"):
        model = build_model("gpt", None, 128, 256, {"d_model": 1024, "n_layer": 8, "n_head": 8})
    n = sum(p.numel() for p in model.parameters())
    block = max(sum(p.numel() for p in b.parameters()) for b in find_blocks(model))
    ddp_gib = estimate_bytes_per_rank(n, 4, "ddp", "adamw", "fp32")["total"] / 2**30
    fsdp_gib = estimate_bytes_per_rank(n, 4, "fsdp", "adamw", "fp32", block_params=block)["total"] / 2**30
    assert fsdp_gib < 1.0 < ddp_gib  # ~1.5 GiB replicated, ~0.5 GiB sharded: a 1 GiB budget tells them apart
    line = model_state_advice(_text_config(*sets, "train.memory_budget_gb=1"), TOKENS)
    assert line is not None and f"{n:,} parameters" in line and "--set train.parallel=fsdp" in line
    assert f"{ddp_gib:.1f} GiB" in line and f"{fsdp_gib:.1f} GiB" in line and "train.memory_budget_gb" in line
    assert model_state_advice(_text_config(*sets, "train.memory_budget_gb=2"), TOKENS) is None  # ddp fits
    # The budget came with micro_batch_size=auto, which fsdp cannot probe: the line names what to set with it.
    assert line.endswith("--set train.parallel=fsdp --set train.micro_batch_size=<rows per worker> "
                         "--set train.memory_budget_gb=null (auto cannot probe memory under fsdp)"), line
    fixed = _text_config(*sets, "train.micro_batch_size=4", "train.parallel=fsdp")
    assert model_state_advice(fixed, TOKENS) is None  # already sharded


def test_orchestrator_train_says_so_before_ray_starts(tmp_path: Path, digits_dir: str,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrator import cli
    from orchestrator.run import launch

    # An MLP of 17M parameters has no blocks: fsdp gathers it whole in compute (2 x 4 bytes per parameter) and
    # shards the rest over 4 workers, 12 bytes per parameter in all against ddp's 16: a 0.22 GB budget lies between.
    argv = ["train", "--set", f"data.train={digits_dir}/train", "--set", f"data.val={digits_dir}/val",
            "--set", f"storage.path={tmp_path}/runs", "--set", "tracking.enabled=false",
            "--set", "model.hidden=[4096,4096]", "--set", "scaling.num_workers=4",
            "--set", "train.micro_batch_size=auto", "--set", "train.memory_budget_gb=0.22"]
    monkeypatch.chdir(tmp_path)
    printed: list[str] = []

    def ray_start(cluster: Any) -> bool:
        printed.extend(capsys.readouterr().err.splitlines())  # what the user saw before Ray started
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "connect_cluster", ray_start)
    assert cli.main(argv) == 130
    (line,) = [x for x in printed if "train.parallel=fsdp" in x]
    assert line.startswith("memory: with train.parallel=ddp each worker holds 0.3 GiB") and "0.2 GiB" in line


def test_the_printed_summary_shows_the_parallel_mode_and_what_each_worker_holds() -> None:
    from orchestrator.config import load_config
    from orchestrator.run.result import TrainResult, summary

    # The worker's facts come with the first report of each (re)start; a resize's later facts are the ones shown.
    history = [{"step": 25, "train_loss": 1.0, "parallel": "fsdp", "world_size": 2,
                "param_bytes_per_rank": 3 * 2**20, "optimizer_bytes_per_rank": 6 * 2**20},
               {"step": 50, "train_loss": 0.5},
               {"step": 75, "train_loss": 0.4, "parallel": "fsdp", "world_size": 3,
                "param_bytes_per_rank": 2 * 2**20, "optimizer_bytes_per_rank": 4 * 2**30}]
    result = TrainResult(load_config(None, ["train.parallel=fsdp"]), {"step": 75, "train_loss": 0.4}, None, "runs",
                         None, None, history)
    lines = summary(result).splitlines()
    assert "parallel: fsdp over 3 workers, each holding 2.0 MiB of parameters and 4.0 GiB of optimizer state" in lines
    result.history = [{k: v for k, v in r.items() if "bytes" not in k and k != "parallel"} for r in history]
    assert not [line for line in summary(result).splitlines() if line.startswith("parallel:")]  # no facts, no line


def test_the_parallel_line_of_one_worker_says_worker_not_workers() -> None:
    from orchestrator.run.result import parallel_line

    facts = {"step": 10, "parallel": "ddp", "param_bytes_per_rank": 2**20, "optimizer_bytes_per_rank": 2**21}
    assert parallel_line([facts | {"world_size": 1}]) == ("parallel: ddp on 1 worker, holding 1.0 MiB of parameters "
                                                          "and 2.0 MiB of optimizer state")
    assert parallel_line([facts | {"world_size": 2}]) == ("parallel: ddp over 2 workers, each holding 1.0 MiB of "
                                                          "parameters and 2.0 MiB of optimizer state")


@pytest.mark.parametrize(("trials", "workers", "cpus", "node_cpus", "sharing"), [
    (15, 1, 1.0, 16.0, 15),  # 15 one-worker trials at once on a 16-CPU node: each plans 1/15 of its half
    (3, 2, 1.0, 16.0, 6),  # two-worker trials: their workers count too, not only one run's
    (4, 4, 2.0, 16.0, 8),  # at most what the node's CPUs hold: 8 two-CPU ranks
    (1, 1, 1.0, 4.0, 1),
])
def test_auto_micro_batch_in_a_study_divides_the_nodes_memory_by_every_rank_it_places_there(
        trials: int, workers: int, cpus: float, node_cpus: float, sharing: int) -> None:
    import psutil

    from orchestrator.training.micro_batch import cpu_budget
    from orchestrator.tuning.search import ranks_per_node

    ranks = ranks_per_node(trials, workers, cpus, node_cpus)
    assert ranks == sharing
    budget, basis = cpu_budget(None, ranks)
    node = psutil.virtual_memory().total
    assert budget == pytest.approx(node / 2 / sharing)
    assert basis == (f"budget {node / 2 / sharing / 2**30:.2f} GiB: half of this node's {node / 2**30:.2f} GiB over "
                     f"{sharing} rank{'s' * (sharing > 1)} of the study's trials at once")
    assert cpu_budget(3.0, ranks) == (3 * 2**30, "budget 3 GiB: train.memory_budget_gb")  # the user's figure wins


def test_the_auto_micro_batch_line_of_one_worker_says_worker_not_workers(capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrator.config import load_config
    from orchestrator.models.zoo import build_model
    from orchestrator.training.micro_batch import choose_micro_batch
    from orchestrator.training.optim import build_optimizer
    from orchestrator.training.parts import Parts
    from orchestrator.training.precision import Precision

    cpu = torch.device("cpu")
    cfg = load_config(None, ["scaling.num_workers=1", "model.hidden=[8]", "train.precision=fp32",
                             "train.global_batch_size=16", "train.micro_batch_size=auto"])
    model = build_model("mlp", None, 4, 3, {"hidden": [8]})
    optimizer, scheduler = build_optimizer(model, cfg.optim, 10)
    sample = {"x": torch.randn(4, 4, device=cpu), "labels": torch.tensor([0, 1, 2, 0], device=cpu)}
    size = choose_micro_batch(cfg, Parts(model, optimizer, scheduler, Precision("fp32", cpu), cpu), sample)
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"auto micro-batch: {size} per worker x {16 // size} accumulation x 1 worker = global "
                           "batch 16 (budget ") and line.endswith(" over 1 rank of this run)"), line
