"""Every tensor the training side makes names its device. On GPUs the process group is NCCL, which serves only
`cuda` tensors: a tensor created without `device=` lands on the CPU and the collective it reaches fails on every
rank (`No backend type associated with device type cpu`). On this CPU-only machine two emulations show that class:
- a two-rank group made with `backend="cuda:gloo"` has NCCL's device map, so any CPU collective fails there;
- a default device that is not the training device (`torch.set_default_device("meta")`, as `cpu` is beside a
  `cuda` training device) makes every tensor created without `device=` land elsewhere, so the step's real
  collectives fail on exactly the tensors that would miss the GPU.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo import run_two_ranks
from test_rank_agreement import OomOnce
from torch.nn.parallel import DistributedDataParallel

from orchestrator.config import load_config
from orchestrator.training import ranks
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision
from orchestrator.training.step import train_step

ROOT = Path(__file__).resolve().parents[3]
# The worker side: the training package and the task and model code it runs.
TRAINING_SIDE = [*sorted((ROOT / "orchestrator" / "training").glob("*.py")),
                 ROOT / "orchestrator" / "models" / "tasks.py", ROOT / "orchestrator" / "models" / "zoo.py"]
# Tensor constructors that take `device=`; `*_like`, `x.new_*` and `.to(...)` derive it from another tensor.
CONSTRUCTORS = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "eye", "rand", "randn",
                "randint", "randperm", "scalar_tensor"}
CPU = torch.device("cpu")


def _deviceless_constructors(source: str) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CONSTRUCTORS
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            lines.append(node.lineno)
    return lines


def test_the_scan_finds_a_constructor_without_a_device() -> None:
    assert _deviceless_constructors("import torch\nflag = torch.tensor(True)\nok = torch.zeros((), device=d)\n"
                                    "derived = torch.zeros_like(flag)\n") == [2]


@pytest.mark.parametrize("module", TRAINING_SIDE, ids=lambda p: p.name)
def test_every_tensor_the_training_side_creates_names_its_device(module: Path) -> None:
    lines = _deviceless_constructors(module.read_text())
    assert not lines, f"{module.name}: tensor constructors without device= at lines {lines}"


def _collectives_on(rank: int, shared: Path) -> dict[str, Any]:
    """In a group with NCCL's device map: a CPU collective fails as on GPUs, and every `ranks` collective moves its
    value to the device it is given (here the CPU, so it must fail too: it uses that device, not a default)."""
    out: dict[str, Any] = {}
    for name, call in (("any_rank", lambda: ranks.any_rank(True, CPU)),
                       ("all_reduce_sum", lambda: ranks.all_reduce_sum([1.0], CPU)),
                       ("rank0_says", lambda: ranks.rank0_says(True, CPU))):
        try:
            call()
            out[name] = "ran"
        except RuntimeError as exc:
            out[name] = str(exc).splitlines()[0]
    return out


def test_a_cuda_gloo_group_refuses_cpu_collectives_as_nccl_does(tmp_path: Path) -> None:
    for result in run_two_ranks(_collectives_on, tmp_path, backend="cuda:gloo"):
        assert set(result) == {"any_rank", "all_reduce_sum", "rank0_says"}
        for message in result.values():
            assert "No backend type associated with device type cpu" in message


def _step_elsewhere(rank: int, shared: Path) -> dict[str, Any]:
    """A DDP step of two micro-batches (and one with an OOM retry on rank 1) while the default device is not the
    training device: every tensor the step makes without `device=` lands on `meta` and breaks the step."""
    return _steps(rank, CPU, default="meta")


def _step_on_the_gpu(rank: int, shared: Path) -> dict[str, Any]:
    """The same steps on a CUDA device in a `cuda:gloo` group (both ranks share the one GPU, which NCCL refuses):
    a CPU tensor anywhere in a collective fails there."""
    torch.cuda.set_device(0)
    return _steps(rank, torch.device("cuda", 0), default=None)


def _steps(rank: int, device: torch.device, default: str | None) -> dict[str, Any]:
    cfg = load_config(None, ["scaling.num_workers=2", "train.global_batch_size=32", "train.micro_batch_size=8",
                             "train.max_steps=1", "optim.name=sgd", "optim.momentum=0", "optim.weight_decay=0",
                             "optim.warmup_steps=0", "optim.schedule=constant", "optim.max_grad_norm=1.0"])
    g = torch.Generator().manual_seed(10 + rank)
    x, y = torch.randn(16, 16, generator=g).to(device), torch.randint(0, 4, (16,), generator=g).to(device)
    out: dict[str, Any] = {}
    for name, limit in (("clean", 100), ("oom", 4 if rank == 1 else 100)):
        model = DistributedDataParallel(OomOnce(limit).to(device))
        optimizer, scheduler = build_optimizer(model, cfg.optim, 1)
        parts = Parts(model, optimizer, scheduler, Precision("fp32", device), device, cfg.optim.max_grad_norm)
        torch.set_default_device(default)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = train_step(parts, [{"x": x[:8], "labels": y[:8]}, {"x": x[8:], "labels": y[8:]}])
            out[name] = {"loss": float(result.loss_sum), "retries": parts.state.oom_retries,
                         "weights": [p.detach().cpu() for p in model.parameters()]}
        except Exception as exc:  # shown in the assertion: the line a GPU user would have seen
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
        finally:
            torch.set_default_device(None)
    return out


@pytest.mark.parametrize("where", ["cpu-meta-default", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_ddp_step_with_accumulation_and_an_oom_retry_makes_no_tensor_off_its_device(tmp_path: Path,
                                                                                     where: str) -> None:
    if where == "cuda":
        results = run_two_ranks(_step_on_the_gpu, tmp_path, backend="cuda:gloo")
    else:
        results = run_two_ranks(_step_elsewhere, tmp_path)
    for result in results:
        for name in ("clean", "oom"):
            assert "error" not in result[name], result[name]["error"]
        assert result["clean"]["retries"] == 0
    assert [result["oom"]["retries"] for result in results] == [0, 1]  # the rank that ran out retries, alone
    for name in ("clean", "oom"):  # one model on both ranks, and the retried step is the clean step
        for a, b, c in zip(results[0][name]["weights"], results[1][name]["weights"], results[0]["clean"]["weights"],
                           strict=True):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-5)
