"""What two ranks must get right together, in a real two-process gloo group (no Ray): the gradient of the global
batch, an out-of-memory retry on one rank only, and an exact resume (each rank's own RNG stream; under local SGD
each rank's own optimizer state)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo import run_two_ranks
from test_loop import Recorder
from torch.nn.parallel import DistributedDataParallel

from orchestrator.config import Config, load_config
from orchestrator.models.zoo import build_model
from orchestrator.training.checkpoint import load_state, restore
from orchestrator.training.loop import Data, run
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision
from orchestrator.training.step import train_step
from orchestrator.training.sync import build_local_sgd

CPU = torch.device("cpu")


def _config(*overrides: str) -> Config:
    return load_config(None, ["scaling.num_workers=2", "model.hidden=[32]", "train.precision=fp32",
                              "optim.warmup_steps=2", "train.eval_every=null", "data.val=null", *overrides])


def _parts(model: torch.nn.Module, cfg: Config) -> Parts:
    t = cfg.train
    optimizer, scheduler = build_optimizer(model, cfg.optim, t.max_steps or 1)
    return Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU, cfg.optim.max_grad_norm,
                 local_sgd=build_local_sgd(t.sync, *t.local_sgd))


class OomOnce(torch.nn.Module):
    """Raises an out-of-memory error the first time it sees a batch larger than `limit` (or at its `at_call`-th
    forward), like a full GPU."""

    def __init__(self, limit: int, at_call: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.limit, self.raised = limit, False
        self.at_call, self.calls = at_call, 0  # or: the first time it is called for the `at_call`-th time

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if (len(x) > self.limit or self.calls == self.at_call) and not self.raised:
            self.raised = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return self.net(x)


SGD = ["optim.name=sgd", "optim.momentum=0", "optim.weight_decay=0", "optim.lr=1", "optim.warmup_steps=0",
       "optim.schedule=constant", "optim.max_grad_norm=null"]  # an update is exactly minus the gradient


def _rows(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)  # different data per rank, as a sharded dataset gives
    return torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)


def _steps(rank: int, shared: Path) -> dict[str, Any]:
    # One step of two micro-batches of 16 per rank (global batch 64). Rank 1 runs out of memory in its first
    # (unsynced) micro-batch, while rank 0 goes on to the synced one.
    cfg = _config("train.global_batch_size=64", "train.micro_batch_size=16", "train.max_steps=1", *SGD)
    x, y = _rows(rank)
    both = [_rows(r) for r in (0, 1)]
    out: dict[str, Any] = {}
    for name, limit in (("clean", 1000), ("oom", 8 if rank == 1 else 1000), ("late", None)):
        # late: rank 1 runs out in its second micro-batch, after the first one's gradients were accumulated.
        model = OomOnce(limit) if limit is not None else OomOnce(1000, at_call=2 if rank == 1 else None)
        parts = _parts(DistributedDataParallel(model), cfg)
        before = [p.detach().clone() for p in parts.model.parameters()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            size = 8 if name == "late" else 16  # late: four micro-batches, so its second one is not the synced one
            train_step(parts, [{"x": x[i:i + size], "labels": y[i:i + size]} for i in range(0, 32, size)])
        out[name] = {"update": [b - p.detach() for b, p in zip(before, parts.model.parameters(), strict=True)],
                     "split": parts.state.split, "retries": parts.state.oom_retries,
                     "warnings": [str(w.message) for w in caught]}
    # The reference: the mean cross-entropy gradient over the global batch (both ranks' rows), by autograd alone.
    reference = OomOnce(1000)
    torch.nn.functional.cross_entropy(reference(torch.cat([b[0] for b in both])),
                                      torch.cat([b[1] for b in both])).backward()
    out["expected"] = [p.grad for p in reference.parameters()]
    return out


def _resume(rank: int, shared: Path, *overrides: str) -> dict[str, Any]:
    """12 steps straight, and 8 steps + a resume from the step-8 checkpoint (mid-epoch) to 12, on two ranks with
    dropout and per-rank RNG streams, so every rank's own RNG state and data position must come back."""
    cfg = _config("train.global_batch_size=32", "train.max_steps=12", "train.log_every=4", "checkpoint.every=4",
                  "model.dropout=0.2", *overrides)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(512, 16, generator=g)
    y = x[:, :4].argmax(dim=1)

    def source(epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [{"x": x[i:i + 16], "labels": y[i:i + 16]} for i in range(0, 512, 16)]

    def fresh(seed: int) -> Parts:
        torch.manual_seed(seed)  # the same initial weights on both ranks
        parts = _parts(DistributedDataParallel(build_model("mlp", None, 16, 4, {"hidden": [32], "dropout": 0.2})),
                       cfg)
        torch.manual_seed(7 + rank)  # but each rank's own dropout stream
        return parts

    straight = fresh(0)
    run(cfg, straight, Data(source), Recorder())

    where = shared / "-".join(["checkpoint", *overrides])

    class Keep(Recorder):
        def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
            if checkpoint_dir and metrics["step"] == 8:  # rank 0 writes it; storage is shared
                shutil.copytree(checkpoint_dir, where)

    first = fresh(0)
    run(cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": 8})}), first, Data(source), Keep())
    dist.barrier()
    resumed = fresh(99)
    torch.manual_seed(123 + rank)  # a restarted worker starts from other RNG state
    progress = restore(resumed, load_state(where))
    restored_at = progress.step
    run(cfg, resumed, Data(source), Recorder(), progress)
    return {"straight": [p.detach().clone() for p in straight.model.parameters()],
            "resumed": [p.detach().clone() for p in resumed.model.parameters()], "step": restored_at}


def _resumes(rank: int, shared: Path) -> dict[str, Any]:
    return {"ddp": _resume(rank, shared),
            "local_sgd": _resume(rank, shared, "train.sync=local_sgd", "train.sync_every=4")}


@pytest.fixture(scope="module")
def resumes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_two_ranks(_resumes, tmp_path_factory.mktemp("resumes"))


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_two_ranks(_steps, tmp_path_factory.mktemp("steps"))


def test_a_ddp_step_applies_the_mean_gradient_of_the_global_batch(steps: list[dict[str, Any]]) -> None:
    # Normalised over both micro-batches and both ranks: neither 2x (no world factor) nor per micro-batch.
    for result in steps:
        for moved, grad in zip(result["clean"]["update"], result["expected"], strict=True):
            torch.testing.assert_close(moved, grad, atol=1e-6, rtol=1e-5)


def test_an_oom_on_one_rank_is_retried_by_that_rank_alone(steps: list[dict[str, Any]]) -> None:
    # Its pieces before the synced one hold no collective: the other rank neither knows nor waits for a verdict (one
    # agreed every step would read a flag back every step), it meets the retried rank in the gradient all-reduce.
    assert [(r["oom"]["split"], r["oom"]["retries"]) for r in steps] == [(1, 0), (2, 1)]
    for result in steps:
        assert (result["clean"]["split"], result["clean"]["retries"]) == (1, 0)
    assert [sum("out of memory" in w for w in r["oom"]["warnings"]) for r in steps] == [0, 1]


@pytest.mark.parametrize("case", ["oom", "late"])
def test_the_retried_step_applies_the_gradient_of_an_oom_free_step(steps: list[dict[str, Any]], case: str) -> None:
    # Rank 1 ran out in its first micro-batch (oom), or in its second after the first one's gradients were
    # accumulated (late): those are dropped, not doubled, and rank 0's meet the retried ones in the one all-reduce.
    assert [r[case]["retries"] for r in steps] == [0, 1]
    for result in steps:
        for retried, grad in zip(result[case]["update"], result["expected"], strict=True):
            torch.testing.assert_close(retried, grad, atol=1e-6, rtol=1e-5)
    for a, b in zip(steps[0][case]["update"], steps[1][case]["update"], strict=True):
        assert torch.equal(a, b)  # DDP: the ranks hold one model


@pytest.mark.parametrize("sync", ["ddp", "local_sgd"])
def test_a_resume_on_two_ranks_is_bitwise_exact(resumes: list[dict[str, Any]], sync: str) -> None:
    # Every rank's own RNG stream (dropout) and data position; under local SGD also its own optimizer moments.
    for result in resumes:
        assert result[sync]["step"] == 8
        for straight, resumed in zip(result[sync]["straight"], result[sync]["resumed"], strict=True):
            assert torch.equal(straight, resumed)


def _failing_backend(graph: Any, example_inputs: Any) -> Any:
    raise RuntimeError("this backend cannot compile anything")


def _compile_fails_on_rank_1(rank: int, shared: Path) -> dict[str, Any]:
    """The first (compiling) step when compiling fails on rank 1 only, with two micro-batches and with one: every
    rank must fall back to eager together, or rank 1 would redo the step alone against rank 0's collectives."""
    from orchestrator.training.step import first_compiled_step

    out: dict[str, Any] = {}
    x, y = _rows(rank)
    for pieces in (2, 1):
        cfg = _config("train.global_batch_size=64", f"train.micro_batch_size={32 // pieces}", "train.max_steps=1",
                      *SGD)
        parts = _parts(DistributedDataParallel(OomOnce(1000)), cfg)
        parts.eager_model = parts.model
        parts.model = torch.compile(parts.model, backend=_failing_backend if rank == 1 else "eager")
        batch = [{"x": x[i:i + 32 // pieces], "labels": y[i:i + 32 // pieces]} for i in range(0, 32, 32 // pieces)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first_compiled_step(parts, batch)
        out[pieces] = {"eager": isinstance(parts.model, DistributedDataParallel) and parts.eager_model is None,
                       "weights": [p.detach().clone() for p in parts.model.parameters()],
                       "warnings": [str(w.message) for w in caught if "compile" in str(w.message)]}
    reference = OomOnce(1000)
    both = [_rows(r) for r in (0, 1)]
    torch.nn.functional.cross_entropy(reference(torch.cat([b[0] for b in both])),
                                      torch.cat([b[1] for b in both])).backward()
    out["expected"] = [p.detach() - p.grad for p in reference.parameters()]
    return out


@pytest.mark.timeout(300)
def test_a_compile_failure_on_one_rank_makes_every_rank_run_eagerly(tmp_path: Path) -> None:
    results = run_two_ranks(_compile_fails_on_rank_1, tmp_path)
    for pieces in (2, 1):
        assert [r[pieces]["eager"] for r in results] == [True, True]
        # Rank 1 says why; rank 0 says that another rank failed.
        assert "this backend cannot compile anything" in " ".join(results[1][pieces]["warnings"])
        assert "another rank" in " ".join(results[0][pieces]["warnings"])
        for a, b, expected in zip(results[0][pieces]["weights"], results[1][pieces]["weights"],
                                  results[0]["expected"], strict=True):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, expected, atol=1e-6, rtol=1e-5)
