"""DDP vs local SGD in a real two-process gloo group (torch.multiprocessing, no Ray): parameters agree across
ranks right after every sync and differ between syncs; the bytes all-reduced per sample drop ~sync_every x;
the outer Nesterov step and the config checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gloo import run_two_ranks

from orchestrator.config import load_config
from orchestrator.errors import ConfigError
from orchestrator.models.zoo import build_model
from orchestrator.training.loop import Data, run
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision
from orchestrator.training.ranks import rank0_says
from orchestrator.training.sync import LocalSGD, build_local_sgd

CPU = torch.device("cpu")
H = 4
STEPS = 12


def _config(*overrides: str) -> Any:
    return load_config(None, ["scaling.num_workers=2", "train.global_batch_size=32", "model.hidden=[32]",
                              f"train.max_steps={STEPS}", "train.log_every=2", "train.eval_every=null",
                              f"checkpoint.every={STEPS}", "train.precision=fp32", "optim.warmup_steps=2",
                              "data.val=null", *overrides])


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    """A copy of every parameter tensor, exactly as it is now (compared with torch.equal, not a float sum)."""
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _train(rank: int, *overrides: str) -> list[dict[str, Any]]:
    cfg = _config(*overrides)
    t = cfg.train
    torch.manual_seed(0)  # the same initial weights on both ranks (DDP would broadcast rank 0's anyway)
    model = torch.nn.parallel.DistributedDataParallel(build_model("mlp", None, 16, 4, {"hidden": [32]}))
    optimizer, scheduler = build_optimizer(model, cfg.optim, STEPS)
    parts = Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU, cfg.optim.max_grad_norm,
                  local_sgd=build_local_sgd(t.sync, *t.local_sgd))
    g = torch.Generator().manual_seed(100 + rank)  # different data per rank, as a sharded dataset gives
    x = torch.randn(512, 16, generator=g)
    y = x[:, :4].argmax(dim=1)
    reports: list[dict[str, Any]] = []

    class Watch:
        def publish(self, metrics: dict[str, Any]) -> None:
            reports.append({"step": metrics["step"], "params": _params(model), "comm": metrics["comm_bytes"],
                            "per_sample": metrics["comm_bytes_per_sample"]})

        def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
            pass  # nothing to register in-process

    run(cfg, parts, Data(lambda epoch: [{"x": x[i:i + 16], "labels": y[i:i + 16]} for i in range(0, 512, 16)]), Watch())
    return reports


def _both_modes(rank: int, shared: Path) -> dict[str, Any]:
    return {
        "ddp": _train(rank),
        "local": _train(rank, "train.sync=local_sgd", f"train.sync_every={H}"),
        "diloco": _train(rank, "train.sync=local_sgd", f"train.sync_every={H}", "train.outer_momentum=0.9"),
        # Checkpoints at steps 3, 6 and 9 too, between syncs (as checkpoint.every=auto's clock may place them).
        "checkpointed": _train(rank, "train.sync=local_sgd", f"train.sync_every={H}", "checkpoint.every=3"),
        # Each rank's own clock says something else; every rank must act on rank 0's.
        "rank0_says": [rank0_says(rank == 0, torch.device("cpu")), rank0_says(rank == 1, torch.device("cpu"))],
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[dict[str, Any]]]]:
    return run_two_ranks(_both_modes, tmp_path_factory.mktemp("gloo"))


@pytest.mark.parametrize("mode", ["local", "diloco"])
def test_parameters_agree_right_after_each_sync_and_drift_between(
        two_ranks: list[dict[str, list[dict[str, Any]]]], mode: str) -> None:
    a, b = two_ranks[0][mode], two_ranks[1][mode]
    assert [r["step"] for r in a] == [2, 4, 6, 8, 10, 12]
    for ra, rb in zip(a, b, strict=True):
        if ra["step"] % H == 0:  # synced at this step: bitwise the same model on both ranks
            assert _same(ra["params"], rb["params"]), ra["step"]
        else:  # local steps on different data: the ranks have drifted apart
            assert not _same(ra["params"], rb["params"]), ra["step"]


def test_checkpoints_between_syncs_leave_the_weights_as_the_sync_period_makes_them(
        two_ranks: list[dict[str, list[dict[str, Any]]]]) -> None:
    # The replicas are averaged at the configured sync steps only: a checkpoint (or evaluation) between two saves
    # (or scores) their average and leaves each replica as it was, so where checkpoint.every=auto's clock puts the
    # checkpoints cannot change the weights.
    for result in two_ranks:
        assert _same(result["local"][-1]["params"], result["checkpointed"][-1]["params"])
    after_step_3 = [next(r for r in result["checkpointed"] if r["step"] == 3) for result in two_ranks]
    assert not _same(after_step_3[0]["params"], after_step_3[1]["params"])  # each rank's replica, as it was


def test_a_clock_decision_is_rank_0s_on_every_rank(two_ranks: list[dict[str, Any]]) -> None:
    assert [r["rank0_says"] for r in two_ranks] == [[True, False], [True, False]]


def test_ddp_ranks_always_agree(two_ranks: list[dict[str, list[dict[str, Any]]]]) -> None:
    reports = list(zip(two_ranks[0]["ddp"], two_ranks[1]["ddp"], strict=True))
    assert [ra["step"] for ra, _ in reports] == [2, 4, 6, 8, 10, 12]
    # Every step all-reduces the same gradient into both ranks, which then take the same optimizer step: the
    # parameters are the same tensors, bit for bit, at every report (not merely sums within a tolerance).
    for ra, rb in reports:
        assert _same(ra["params"], rb["params"]), ra["step"]
    # ...and they trained: a run whose optimizer never stepped would agree trivially.
    assert not _same(reports[0][0]["params"], reports[-1][0]["params"])


def test_local_sgd_all_reduces_about_sync_every_times_fewer_bytes(
        two_ranks: list[dict[str, list[dict[str, Any]]]]) -> None:
    params = sum(p.numel() for p in build_model("mlp", None, 16, 4, {"hidden": [32]}).parameters())
    ddp, local = two_ranks[0]["ddp"][-1]["comm"], two_ranks[0]["local"][-1]["comm"]
    # DDP: one gradient all-reduce of every fp32 parameter per step (classification's normaliser is rows x world,
    # no all-reduce).
    assert ddp == STEPS * params * 4
    # Local SGD: one parameter all-reduce per sync_every steps, nothing in between.
    assert local == STEPS // H * params * 4
    assert ddp / local == pytest.approx(H, rel=0.01)
    assert two_ranks[0]["ddp"][-1]["per_sample"] == pytest.approx(params * 4 / 32)


def test_outer_nesterov_step_on_the_averaged_change() -> None:
    model = torch.nn.Linear(2, 1, bias=False)
    sgd = LocalSGD(every=2, outer_lr=0.7, outer_momentum=0.9)
    sgd.start(model)
    anchor = model.weight.detach().clone()
    with torch.no_grad():
        model.weight -= 0.1  # the local steps moved the weights by -0.1
    sgd.average(model)  # one process: the average is itself, then the outer step
    # delta = 0.1, momentum = 0.1, Nesterov update = 0.1 + 0.9 * 0.1 = 0.19, times the outer lr 0.7
    torch.testing.assert_close(model.weight.detach(), anchor - 0.7 * 0.19)
    torch.testing.assert_close(sgd.anchor[0], model.weight.detach())


def test_plain_average_is_untouched_by_the_outer_step() -> None:
    model = torch.nn.Linear(2, 1)
    sgd = LocalSGD(every=2)
    sgd.start(model)
    with torch.no_grad():
        model.weight += 1.0
    before = model.weight.detach().clone()
    assert sgd.average(model) == 0  # nothing to all-reduce in one process
    torch.testing.assert_close(model.weight.detach(), before)


def test_sync_options_need_local_sgd(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train.sync_every has no effect with train.sync=ddp"):
        load_config(None, ["train.sync_every=8"])
    with pytest.raises(ConfigError, match="train.outer_momentum has no effect"):
        load_config(None, ["train.outer_momentum=0.9"])
    with pytest.raises(ConfigError, match="train.outer_momentum"):
        load_config(None, ["train.sync=local_sgd", "train.outer_momentum=1.5"])
    t = load_config(None, ["train.sync=local_sgd"]).train
    assert t.local_sgd == (8, 1.0, None)
    assert load_config(None, ["train.sync=local_sgd", "train.outer_momentum=0.9"]).train.local_sgd == (8, 0.7, 0.9)
