"""FSDP2 (orchestrator.training.fsdp) in real gloo groups of 1, 2 and 3 processes, against plain torch in this
process: the same weights as one process on the whole batch, shards of 1/world, sharded checkpoints that reshard on
load and resume bitwise, and the driver's memory estimate."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo_world import run_ranks
from torch import nn
from torch.distributed.fsdp import FSDPModule

from orchestrator.errors import ConfigError
from orchestrator.run.memory_plan import estimate_bytes_per_rank
from orchestrator.training import fsdp

ROWS, ACCUM, STEPS, VOCAB, CONTEXT = 16, 4, 3, 12, 8


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":  # 5 outputs: the head's rows do not split evenly over 2 ranks (padding)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5))
    from orchestrator.models.zoo import GPT

    return GPT(CONTEXT, VOCAB, d_model=16, n_layer=2, n_head=2)


def optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # eps above rounding noise: the attention's key bias has a zero gradient up to rounding (softmax ignores a shift of
    # the keys), and at eps=1e-8 Adam turns two summation orders' noise (1e-13 vs 1e-10) into lr-sized steps.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=1e-5)


def data(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if kind == "mlp":
        return torch.randn(ROWS, 6, generator=g), torch.randint(0, 5, (ROWS,), generator=g)
    tokens = torch.randint(0, VOCAB, (ROWS, CONTEXT), generator=g)
    targets = tokens[:, 1:].clone()
    targets[targets < 3] = -100  # ignored tokens: the ranks' target counts differ
    return tokens, targets


def loss_sum(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if kind == "gpt":
        out = out[:, :-1].reshape(-1, VOCAB)
        y = y.reshape(-1)
    return nn.functional.cross_entropy(out, y, reduction="sum", ignore_index=-100)


def count(y: torch.Tensor) -> torch.Tensor:
    return (y != -100).sum().to(torch.float32)


def plain_run(kind: str, opt_name: str, max_norm: float | None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The independent reference: one process, the whole batch, a mean loss, no accumulation."""
    model = build(kind)
    opt = optimizer(opt_name, model)
    norms = []
    for step in range(STEPS):
        x, y = data(kind, step)
        (loss_sum(kind, model, x, y) / count(y)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or math.inf)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def fsdp_step(kind: str, model: nn.Module, opt: torch.optim.Optimizer, step: int, *, defer: bool = True,
              max_norm: float | None = None, fail_once: list[bool] | None = None, summed: bool = False
              ) -> tuple[float, dict[str, int]]:
    """The product's step under FSDP: this rank's rows in ACCUM micro-batches, each loss a sum over the step's
    targets on all ranks times the world size (FSDP's reduce-scatter averages). Returns the global gradient norm
    and the bytes held right after the update. `fail_once`: raise in the first forward (on every rank), recover,
    redo the step. `summed`: gradients as a reduction that sums over ranks instead of averaging would give."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = data(kind, step)
    share = ROWS // world
    x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    total = count(y)
    dist.all_reduce(total)
    scale = world / total * (world if summed else 1)
    while True:
        try:
            for i, (xm, ym) in enumerate(zip(x.chunk(ACCUM), y.chunk(ACCUM), strict=True)):
                with fsdp.gradient_sync(model, synced=i == ACCUM - 1, defer=defer):
                    if fail_once and i == 1:
                        fail_once.clear()
                        raise RuntimeError("out of memory (simulated)")
                    (loss_sum(kind, model, xm, ym) * scale).backward()
            break
        except RuntimeError:
            fsdp.recover(model)
            opt.zero_grad(set_to_none=True)
    norm = float(fsdp.clip_grad_norm(model, max_norm or math.inf))
    opt.step()
    held = fsdp.local_bytes(model, opt)
    opt.zero_grad(set_to_none=True)
    return norm, held


def sharded(kind: str, opt_name: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = fsdp.shard_model(build(kind, seed), mesh=fsdp.mesh_of_all_ranks(torch.device("cpu")), precision="fp32",
                             blocks=["Linear"] if kind == "mlp" else None)
    return model, optimizer(opt_name, model)


# name: (model, optimizer, defer the sync, max_norm, how the gradients are reduced)
CASES: dict[str, tuple[str, str, bool, float | None, str]] = {
    "mlp-sgd": ("mlp", "sgd", True, None, "average"),
    "mlp-adamw-clip": ("mlp", "adamw", False, 0.3, "average"),
    "gpt-sgd-clip": ("gpt", "sgd", True, 0.5, "average"),
    "gpt-adamw": ("gpt", "adamw", False, None, "average"),
    "mlp-sgd-force-sum-comms": ("mlp", "sgd", True, None, "force_sum"),
    "mlp-sgd-recover": ("mlp", "sgd", True, None, "recover"),
    # The control: gradients world times too large, as a reduce-scatter that sums (gloo's AVG summing, torch issue
    # 162338) would give, must be caught. (Not through set_gradient_divide_factor(1.0): with it, torch 2.13's first
    # all-gather hangs on gloo.)
    "mlp-sgd-summed": ("mlp", "sgd", True, None, "sum"),
}


def _parity(rank: int) -> dict[str, Any]:
    results = {}
    for name, (kind, opt_name, defer, max_norm, reduction) in CASES.items():
        model, opt = sharded(kind, opt_name)
        for module in model.modules():
            if isinstance(module, FSDPModule) and reduction == "force_sum":
                module.set_force_sum_reduction_for_comms(True)
        fail = [True] if reduction == "recover" else None
        norms = [fsdp_step(kind, model, opt, step, defer=defer, max_norm=max_norm, fail_once=fail,
                           summed=reduction == "sum")[0] for step in range(STEPS)]
        results[name] = (fsdp.full_state_dict(model), norms)
    return results


def _checkpoints(rank: int, shared: Path) -> dict[str, Any]:
    """gpt + AdamW: 2 steps, a sharded save (and an async one), 2 more steps; a fresh model loads the save and runs
    the same 2 steps."""
    model, opt = sharded("gpt", "adamw")
    for step in range(2):
        fsdp_step("gpt", model, opt, step, defer=False)
    fsdp.save_sharded(shared / "ckpt", model, opt, extra={"step": 2})
    saved = (fsdp.full_state_dict(model), fsdp.full_optimizer_state_dict(model, opt))
    future = fsdp.async_save_sharded(shared / "async", model, opt, extra={"step": 2}, group=fsdp.checkpoint_group())
    held = {}
    for step in (2, 3):  # changes the parameters while the async save writes
        _, held = fsdp_step("gpt", model, opt, step, defer=False)
    future.result()
    uninterrupted = (fsdp.full_state_dict(model), fsdp.full_optimizer_state_dict(model, opt))

    model, opt = sharded("gpt", "adamw", seed=1)
    extra = fsdp.load_sharded(shared / "ckpt", model, opt)
    for step in (2, 3):
        fsdp_step("gpt", model, opt, step, defer=False)
    resumed = (fsdp.full_state_dict(model), fsdp.full_optimizer_state_dict(model, opt))

    model, opt = sharded("gpt", "adamw", seed=2)
    async_extra = fsdp.load_sharded(shared / "async", model, opt)
    from_async = (fsdp.full_state_dict(model), fsdp.full_optimizer_state_dict(model, opt))
    return {"saved": saved, "uninterrupted": uninterrupted, "resumed": resumed, "extra": extra,
            "from_async": from_async, "async_extra": async_extra, "held": held}


def _scaler(rank: int) -> dict[str, Any]:
    """fp16's GradScaler on sharded (DTensor) gradients: one clean step, then one with an inf in rank 1's shard only."""
    model, opt = sharded("mlp", "sgd")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = data("mlp", 0)
    x, y = x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]
    out: dict[str, Any] = {}
    for step in range(2):
        scaler.scale(loss_sum("mlp", model, x, y) * 2 / ROWS).backward()
        if step == 1 and rank == 1:
            next(model.parameters()).grad.to_local()[0, 0] = math.inf
        scaler.unscale_(opt)
        if step == 0:
            out["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        out[f"weights{step}"] = fsdp.full_state_dict(model)
        out[f"scale{step}"] = scaler.get_scale()
    return out


def _bf16(rank: int) -> dict[str, Any]:
    model = fsdp.shard_model(build("mlp"), mesh=fsdp.mesh_of_all_ranks(torch.device("cpu")), blocks=["Linear"],
                             precision="bf16")
    x, y = data("mlp", 0)
    output = model(x[rank * 8:(rank + 1) * 8])
    loss_sum("mlp", model, x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp.shard_model(build("mlp"), mesh=fsdp.mesh_of_all_ranks(torch.device("cpu")))  # no block named
    return {"output": output.detach(), "param_dtypes": {p.dtype for p in model.parameters()},
            "grad_dtypes": {p.grad.dtype for p in model.parameters()}, "warnings": [str(w.message) for w in caught]}


def _two(rank: int, shared: Path) -> dict[str, Any]:
    return {"parity": _parity(rank), "checkpoints": _checkpoints(rank, shared), "scaler": _scaler(rank),
            "bf16": _bf16(rank)}


def _load_elsewhere(rank: int, shared: Path) -> dict[str, Any]:
    """At another world size: load the 2-rank checkpoint, then one more step (bytes held)."""
    model, opt = sharded("gpt", "adamw", seed=3)
    extra = fsdp.load_sharded(shared.parent.parent / "two" / "ranks2" / "ckpt", model, opt)
    loaded = (fsdp.full_state_dict(model), fsdp.full_optimizer_state_dict(model, opt))
    _, held = fsdp_step("gpt", model, opt, 2, defer=False)
    return {"loaded": loaded, "extra": extra, "held": held}


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[Any]]:
    root = tmp_path_factory.mktemp("fsdp")
    two = run_ranks(_two, root / "two", 2)
    return {2: two, 1: run_ranks(_load_elsewhere, root / "one", 1), 3: run_ranks(_load_elsewhere, root / "three", 3)}


def _diffs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    assert a.keys() == b.keys()
    return {k: float((a[k].float() - b[k].float()).abs().max()) for k in a}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(_diffs(a, b).values())


@pytest.mark.parametrize("name", [n for n in CASES if n != "mlp-sgd-summed"])
def test_two_ranks_accumulating_match_one_process_on_the_whole_batch(groups: dict[int, list[Any]], name: str
                                                                     ) -> None:
    kind, opt_name, _, max_norm, _ = CASES[name]
    expected, expected_norms = plain_run(kind, opt_name, max_norm)
    weights, norms = groups[2][0]["parity"][name]
    assert _max_diff(weights, expected) < 1e-6, _diffs(weights, expected)
    assert norms == pytest.approx(expected_norms, rel=1e-5)
    assert groups[2][1]["parity"][name][1] == norms  # every rank sees the one global norm
    if max_norm is not None:  # the clip was active on some step
        assert max(norms) > max_norm


def test_a_summing_reduction_is_caught(groups: dict[int, list[Any]]) -> None:
    # The same run with FSDP told to sum over ranks instead of averaging (gloo issue 162338's symptom) must miss the
    # reference by far more than the parity tolerance.
    expected, _ = plain_run("mlp", "sgd", None)
    assert _max_diff(groups[2][0]["parity"]["mlp-sgd-summed"][0], expected) > 1e-3


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_each_rank_holds_a_world_share_of_parameters_and_optimizer_state(groups: dict[int, list[Any]]) -> None:
    model = build("gpt")
    params = list(model.parameters())  # the tied embedding once
    full = _bytes(params)
    row = sum(p[0].numel() * p.element_size() for p in params)  # a shard exceeds full/world by at most a row
    for world, ranks in groups.items():
        held = [r["checkpoints"]["held"] if world == 2 else r["held"] for r in ranks]
        for h in held:
            assert h["params"] <= full / world + row
            assert h["grads"] <= full / world + row
            assert h["optimizer"] <= 2 * (full / world + row) + 4 * len(params)  # two moments and a step counter
        # Nothing duplicated, nothing lost: the shards add up to the whole model.
        assert sum(h["params"] for h in held) == full
        assert sum(h["optimizer"] for h in held) == 2 * full + 4 * len(params) * world


def test_checkpoint_from_two_ranks_loads_bitwise_into_one_and_three(groups: dict[int, list[Any]]) -> None:
    saved_model, saved_optim = groups[2][0]["checkpoints"]["saved"]
    for world in (1, 3):
        loaded = groups[world][0]
        model, optim = loaded["loaded"]
        assert model.keys() == saved_model.keys()
        assert all(torch.equal(model[k], saved_model[k]) for k in model)
        _assert_same_optimizer(optim, saved_optim)
        assert [r["extra"] for r in groups[world]] == [{"step": 2}] * world
        assert all(r["loaded"] == ({}, {}) for r in groups[world][1:])  # the full state is rank 0's only


def _assert_same_optimizer(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for name, slots in a["state"].items():
        assert slots.keys() == b["state"][name].keys()
        assert all(torch.equal(slots[s], b["state"][name][s]) for s in slots), name
    assert a["param_groups"] == b["param_groups"]


def test_resume_at_the_same_world_continues_bitwise(groups: dict[int, list[Any]]) -> None:
    ckpt = groups[2][0]["checkpoints"]
    (resumed, resumed_optim), (ahead, ahead_optim) = ckpt["resumed"], ckpt["uninterrupted"]
    assert all(torch.equal(resumed[k], ahead[k]) for k in ahead)
    _assert_same_optimizer(resumed_optim, ahead_optim)
    assert ckpt["extra"] == {"step": 2}
    # The step-2 weights differ from step 4's: the comparison above could fail.
    assert not all(torch.equal(ckpt["saved"][0][k], ahead[k]) for k in ahead)


def test_async_save_keeps_the_state_of_its_call(groups: dict[int, list[Any]]) -> None:
    ckpt = groups[2][0]["checkpoints"]
    (weights, optim), (saved, saved_optim) = ckpt["from_async"], ckpt["saved"]
    assert all(torch.equal(weights[k], saved[k]) for k in saved)  # not the later steps' parameters
    _assert_same_optimizer(optim, saved_optim)
    assert ckpt["async_extra"] == {"step": 2}


def test_estimate_matches_the_bytes_held_at_one_and_two_ranks(groups: dict[int, list[Any]]) -> None:
    n_params = sum(p.numel() for p in build("gpt").parameters())
    for world in (1, 2):
        estimate = estimate_bytes_per_rank(n_params, world, "fsdp", "adamw", "fp32")
        for rank in groups[world]:
            held = rank["checkpoints"]["held"] if world == 2 else rank["held"]
            for key in ("params", "grads", "optimizer"):  # 1%: AdamW's step counters are not in the estimate
                assert held[key] == pytest.approx(estimate[key], rel=0.01), (world, key)


def test_grad_scaler_unscales_sharded_gradients_and_skips_an_overflow_on_every_rank(groups: dict[int, list[Any]]
                                                                                     ) -> None:
    model = build("mlp")
    x, y = data("mlp", 0)
    (loss_sum("mlp", model, x, y) / ROWS).backward()
    for name, p in model.named_parameters():
        assert torch.allclose(groups[2][0]["scaler"]["grads"][name], p.grad, atol=1e-7), name
    first = groups[2][0]["scaler"]["weights0"]
    # An inf in rank 1's shard alone: rank 0 skips the step too (its own gradients were finite) and both back off.
    assert all(torch.equal(groups[2][0]["scaler"]["weights1"][k], first[k]) for k in first)
    assert [r["scaler"]["scale1"] for r in groups[2]] == [512.0, 512.0]
    assert [r["scaler"]["scale0"] for r in groups[2]] == [1024.0, 1024.0]


def test_bf16_computes_in_bf16_on_fp32_shards(groups: dict[int, list[Any]]) -> None:
    x, _ = data("mlp", 0)
    expected = build("mlp").to(torch.bfloat16)(x.to(torch.bfloat16))  # a plain bf16 model: the same casts
    output = torch.cat([r["bf16"]["output"] for r in groups[2]])
    assert output.dtype == torch.bfloat16
    assert torch.allclose(output.float(), expected.float(), atol=1e-2)
    bf16 = groups[2][0]["bf16"]
    assert bf16["param_dtypes"] == {torch.float32} and bf16["grad_dtypes"] == {torch.float32}
    assert any("no block" in w and "train.fsdp.blocks" in w for w in bf16["warnings"])


def test_blocks_found_for_hugging_face_built_in_and_named_classes() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    assert [type(m).__name__ for m in fsdp.find_blocks(hf)] == ["GPT2Block"] * 3
    gpt = build("gpt")
    assert fsdp.find_blocks(gpt) == list(gpt.blocks)
    assert len(fsdp.find_blocks(build("mlp"), ["Linear"])) == 3
    assert fsdp.find_blocks(build("mlp")) == []
    with pytest.raises(ConfigError, match=r"train.fsdp.blocks.*'Linar'.*Linear"):
        fsdp.find_blocks(build("mlp"), ["Linar"])
