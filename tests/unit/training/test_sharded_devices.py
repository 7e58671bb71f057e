"""FSDP2 on the device a GPU run trains on, through the product's own step and checkpoint code: fp16 with its
GradScaler and fused AdamW, where a first step whose gradients overflow on one rank's shard is skipped on every rank
and leaves every shard (weights and optimizer state) as if that batch never came; and a sharded DCP checkpoint of
those DTensors written by 2 ranks and restored, resharded, by 1. Each runs twice: on the CPU in a gloo group (the
twin, in every suite run) and on the GPU in a `cuda:gloo` group (gpu-marked: the two ranks share the one GPU, which
NCCL refuses; the group has NCCL's device map, so a CPU tensor in any collective fails there as on GPUs). No Ray or
MLflow: the GPU check's torch tier runs it (scripts/gpu_check.py)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_world import run_ranks

from orchestrator.config import load_config
from orchestrator.models.zoo import build_model
from orchestrator.training import fsdp
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision
from orchestrator.training.step import train_step

ROWS, FEATURES, CLASSES, ACCUM, STEPS = 16, 6, 5, 2, 3
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
BACKEND = {"cpu": "gloo", "cuda": "cuda:gloo"}
OVERFLOW = 3e4  # one input feature: finite in the fp16 forward, its scaled weight gradient past fp16's 65,504


def device_of(kind: str) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def build(device: torch.device) -> Parts:
    """The product's pieces for train.parallel=fsdp, train.precision=fp16, AdamW (fused where torch has the kernel:
    on CPU and CUDA both)."""
    cfg = load_config(None, ["optim.name=adamw", "optim.lr=0.01", "optim.weight_decay=0.01", "optim.warmup_steps=0",
                             "optim.schedule=constant", "optim.max_grad_norm=null"])
    torch.manual_seed(0)
    model = build_model("mlp", None, FEATURES, CLASSES, {"hidden": [16, 16]}).to(device)
    model = fsdp.shard_model(model, mesh=fsdp.mesh_of_all_ranks(device), blocks=["Linear"], precision="fp16")
    optimizer, scheduler = build_optimizer(model, cfg.optim, STEPS)  # type: ignore[arg-type]
    return Parts(model, optimizer, scheduler, Precision("fp16", device), device)


def micro_batches(step: int, rank: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(ROWS, FEATURES, generator=g), torch.randint(0, CLASSES, (ROWS,), generator=g)
    share = ROWS // 2
    x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    return [{"x": xm.to(device), "labels": ym.to(device)}
            for xm, ym in zip(x.chunk(ACCUM), y.chunk(ACCUM), strict=True)]


def shards(parts: Parts) -> dict[str, torch.Tensor]:
    """This rank's own pieces: its shard of every parameter and of AdamW's moments and step counts, on the CPU."""
    names = {id(p): n for n, p in parts.model.named_parameters()}
    out = {n: fsdp.local_tensor(p).detach().cpu().clone() for n, p in parts.model.named_parameters()}
    for param, state in parts.optimizer.state.items():
        for key, value in state.items():
            out[f"{names[id(param)]}.{key}"] = fsdp.local_tensor(value).detach().cpu().clone()
    return out


def _skipped_first_step(rank: int, shared: Path, kind: str) -> dict[str, Any]:
    device = device_of(kind)
    runs: dict[str, Any] = {}
    for name, steps in (("skipped", range(STEPS)), ("never", range(1, STEPS))):
        parts = build(device)
        skipped = []
        for step in steps:
            micro = micro_batches(step, rank, device)
            if name == "skipped" and step == 0 and rank == 1:
                micro[1]["x"][0, 0] = OVERFLOW
            result = train_step(parts, micro)
            skipped.append(bool(result.overflowed))  # read here, in the test: the step itself reads nothing
        scaler = parts.precision.scaler
        assert scaler is not None
        runs[name] = {"skipped": skipped, "scale": float(scaler.get_scale()), "shards": shards(parts),
                      "fused": parts.optimizer.defaults.get("fused"),
                      "devices": {fsdp.local_tensor(p).device.type for p in parts.model.parameters()}}
    return runs


@pytest.mark.parametrize("kind", DEVICES)
def test_an_fp16_overflow_on_one_shard_skips_the_first_step_on_every_rank_as_if_it_never_came(
        tmp_path: Path, kind: str) -> None:
    ranks = run_ranks(functools.partial(_skipped_first_step, kind=kind), tmp_path, 2, BACKEND[kind])
    for rank in ranks:
        skipped, never = rank["skipped"], rank["never"]
        assert skipped["fused"] is True and skipped["devices"] == {kind}
        # Rank 0's own gradients were finite: it skips too (the found-inf flag is max-reduced over the mesh), and
        # both back off the scale once.
        assert skipped["skipped"] == [True, False, False] and never["skipped"] == [False, False]
        assert (skipped["scale"], never["scale"]) == (never["scale"] / 2, 65536.0)
        # Every shard as in the run that never had the batch: no state from the dropped step (fused AdamW makes its
        # moments and step counts before its kernel sees the flag), the same two updates.
        assert skipped["shards"].keys() == never["shards"].keys()
        for key, value in never["shards"].items():
            if key.endswith(".step"):
                assert float(skipped["shards"][key]) == float(value) == 2.0, key
            else:  # the scale halved: the fp16 backward rounds its (scaled) gradients a little differently
                torch.testing.assert_close(skipped["shards"][key], value, rtol=1e-3, atol=1e-6, msg=key)


def _save_two_steps(rank: int, shared: Path, kind: str, path: str) -> dict[str, Any]:
    device = device_of(kind)
    parts = build(device)
    for step in range(2):
        train_step(parts, micro_batches(step, rank, device))
    fsdp.save_sharded(path, parts.model, parts.optimizer, extra={"step": 2})
    return {"weights": fsdp.full_state_dict(parts.model),
            "optimizer": fsdp.full_optimizer_state_dict(parts.model, parts.optimizer)}


def _restore_on_one(rank: int, shared: Path, kind: str, path: str) -> dict[str, Any]:
    device = device_of(kind)
    parts = build(device)
    extra = fsdp.load_sharded(path, parts.model, parts.optimizer)
    return {"extra": extra, "weights": fsdp.full_state_dict(parts.model),
            "optimizer": fsdp.full_optimizer_state_dict(parts.model, parts.optimizer),
            "devices": {fsdp.local_tensor(t).device.type for state in parts.optimizer.state.values()
                        for t in state.values()} | {fsdp.local_tensor(p).device.type
                                                     for p in parts.model.parameters()}}


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in flat(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


@pytest.mark.parametrize("kind", DEVICES)
def test_a_sharded_checkpoint_of_two_ranks_restores_resharded_on_one(tmp_path: Path, kind: str) -> None:
    path = str(tmp_path / "checkpoint")
    saved = run_ranks(functools.partial(_save_two_steps, kind=kind, path=path), tmp_path, 2, BACKEND[kind])[0]
    (restored,) = run_ranks(functools.partial(_restore_on_one, kind=kind, path=path), tmp_path, 1, BACKEND[kind])
    assert restored["extra"] == {"step": 2} and restored["devices"] == {kind}
    assert saved["weights"].keys() == restored["weights"].keys()
    for key, value in saved["weights"].items():
        assert torch.equal(restored["weights"][key], value), key
    before, after = flat(saved["optimizer"]), flat(restored["optimizer"])
    assert before.keys() == after.keys() and any(k.endswith("exp_avg_sq") for k in before)
    for key, value in before.items():
        assert torch.equal(after[key], value) if isinstance(value, torch.Tensor) else after[key] == value, key
