"""train.parallel=fsdp through the product's own worker code (build_parts, train_step, evaluate, the FLOPs probe,
the per-rank facts) in a real two-process gloo group, against plain torch in this process on the whole batch."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_world import run_ranks

from orchestrator.config import Config, load_config
from orchestrator.errors import ConfigError
from orchestrator.models.tasks import task_parts
from orchestrator.models.zoo import build_model
from orchestrator.training import fsdp
from orchestrator.training.evaluation import evaluate
from orchestrator.training.micro_batch import refuse_auto_under_fsdp
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import build_parts, compile_model, rank_bytes
from orchestrator.training.step import DeviceMemoryError, flops_per_sample, train_step
from orchestrator.training.timing import count_flops

CPU = torch.device("cpu")
ROWS, STEPS, CONTEXT, VOCAB, FEATURES, CLASSES = 16, 3, 8, 12, 6, 5

# name: (model, optimizer, max_grad_norm, train.fsdp overrides). Accumulation 4 (micro-batch 2 x 4 x 2 ranks = 16).
CASES: dict[str, tuple[str, str, float | None, list[str]]] = {
    "mlp-sgd": ("mlp", "sgd", None, []),
    "mlp-adamw-clip": ("mlp", "adamw", 0.3, ["train.fsdp.blocks=[Linear]", "train.fsdp.defer_sync=true"]),
    "gpt-sgd-clip": ("gpt", "sgd", 0.5, ["train.fsdp.defer_sync=true"]),
    "gpt-sgd": ("gpt", "sgd", None, []),
    "gpt-adamw": ("gpt", "adamw", None, []),
}


def config(kind: str, opt: str, max_norm: float | None, *overrides: str, workers: int = 2) -> Config:
    model = (["model.name=mlp", "model.hidden=[16,16]", f"model.num_classes={CLASSES}"] if kind == "mlp" else
             ["model.name=gpt", "model.d_model=16", "model.n_layer=2", "model.n_head=2", "data.label=null",
              "task.name=causal_lm", f"model.num_classes={VOCAB}"])
    optim = (["optim.name=sgd", "optim.momentum=0.9", "optim.lr=0.1", "optim.weight_decay=0"] if opt == "sgd" else
             ["optim.name=adamw", "optim.lr=0.01", "optim.weight_decay=0.01"])
    return load_config(None, [*model, *optim, "optim.warmup_steps=0", "optim.schedule=constant",
                              f"optim.max_grad_norm={'null' if max_norm is None else max_norm}",
                              "train.precision=fp32", f"scaling.num_workers={workers}",
                              f"train.global_batch_size={ROWS}", f"train.micro_batch_size={ROWS // 4 // workers}",
                              f"train.max_steps={STEPS}", "train.parallel=fsdp", *overrides])


def in_features(kind: str) -> int:
    return FEATURES if kind == "mlp" else CONTEXT


def batch(kind: str, step: int, rows: slice = slice(None)) -> dict[str, torch.Tensor]:
    """Step `step`'s global batch (its `rows`): for the GPT, tokens with some targets ignored, so the ranks' target
    counts differ and only the global normaliser gives the whole batch's mean."""
    g = torch.Generator().manual_seed(100 + step)
    if kind == "mlp":
        x = torch.randn(ROWS, FEATURES, generator=g)
        return {"x": x[rows], "labels": torch.randint(0, CLASSES, (ROWS,), generator=g)[rows]}
    tokens = torch.randint(0, VOCAB, (ROWS, CONTEXT + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[labels < 3] = -100
    return {"x": tokens[:, :-1][rows], "labels": labels[rows]}


def reference(kind: str, opt: str, max_norm: float | None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole batch, the mean loss over its targets, no accumulation, plain torch."""
    cfg = config(kind, opt, max_norm, workers=1)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model.name, None, in_features(kind), cfg.model.num_classes, cfg.model.kwargs)
    optimizer, _ = build_optimizer(model, cfg.optim, STEPS)
    norms = []
    for step in range(STEPS):
        b = batch(kind, step)
        logits = model(b["x"]).flatten(0, -2)
        torch.nn.functional.cross_entropy(logits, b["labels"].flatten(), ignore_index=-100).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or math.inf)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _micro_batches(kind: str, step: int, rank: int, accum: int) -> list[dict[str, torch.Tensor]]:
    share = ROWS // 2
    mine = batch(kind, step, slice(rank * share, (rank + 1) * share))
    size = share // accum
    return [{k: v[i * size:(i + 1) * size] for k, v in mine.items()} for i in range(accum)]


def _parity(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (kind, opt, max_norm, overrides) in CASES.items():
        cfg = config(kind, opt, max_norm, *overrides)
        parts = build_parts(cfg, in_features(kind), CPU)
        assert cfg.train.grad_accum_steps == 4
        norms = [float(train_step(parts, _micro_batches(kind, step, rank, 4)).grad_norm) for step in range(STEPS)]
        out[name] = {"weights": fsdp.full_state_dict(parts.model), "norms": norms, "sharded": fsdp.is_sharded(
            parts.model), "bytes": rank_bytes(parts)}
    return out


def _nonfinite(rank: int) -> dict[str, Any]:
    """A NaN in rank 1's rows only: both ranks skip the step together and keep their weights."""
    parts = build_parts(config("mlp", "sgd", None), FEATURES, CPU)
    before = fsdp.full_state_dict(parts.model)
    micro = _micro_batches("mlp", 0, rank, 4)
    if rank == 1:
        micro[2]["x"][0, 0] = math.nan
    result = train_step(parts, micro)
    return {"skipped": result.skipped, "before": before, "after": fsdp.full_state_dict(parts.model)}


def _oom(rank: int) -> dict[str, Any]:
    """Out of memory in a forward under FSDP: no one-rank retry (the others would wait in an all-gather), a fatal
    error naming the key to change."""
    out: dict[str, Any] = {}
    for where in ("first", "last"):  # an unsynced micro-batch, and the last one, whose backward reduce-scatters
        parts = build_parts(config("mlp", "sgd", None), FEATURES, CPU)
        calls = [0]

        def full(*_: Any, where: str = where, calls: list[int] = calls) -> None:
            calls[0] += 1
            if where == "first" or calls[0] == 4:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

        parts.model[0].register_forward_pre_hook(full)  # type: ignore[index]
        try:
            train_step(parts, _micro_batches("mlp", 0, rank, 4))
            out[where] = {"error": "none", "split": parts.state.split}
        except DeviceMemoryError as exc:
            out[where] = {"error": str(exc), "split": parts.state.split}
    return out


def _evaluate(rank: int) -> dict[str, Any]:
    """Uneven validation shards (rank 0: 3 batches, rank 1: 1): every rank runs as many forwards (each holds
    all-gathers), and the metrics are those of all rows."""
    parts = build_parts(config("gpt", "sgd", None), CONTEXT, CPU)
    whole = batch("gpt", 9)
    mine = [slice(0, 4), slice(4, 8), slice(8, 12)] if rank == 0 else [slice(12, 16)]
    metrics = evaluate(parts, [{k: v[s] for k, v in whole.items()} for s in mine])
    flops = flops_per_sample(parts, _micro_batches("gpt", 0, rank, 4)[0])
    return {"metrics": metrics, "weights": fsdp.full_state_dict(parts.model), "flops": flops}


def _refusals(rank: int) -> list[str]:
    """Probes that would run forwards outside the agreed step: refused under FSDP, each in one line."""
    out = []
    for probe in (compile_model, refuse_auto_under_fsdp):
        parts = build_parts(config("mlp", "sgd", None), FEATURES, CPU)
        try:
            probe(parts)
            out.append("accepted")
        except ConfigError as exc:
            out.append(str(exc))
    return out


def _export(rank: int, shared: Path) -> dict[str, Any]:
    """A trained step's shards written as a checkpoint (DCP, as the loop's sharded checkpoints), and the full
    weights gathered for comparison."""
    parts = build_parts(config("gpt", "adamw", None), CONTEXT, CPU)
    train_step(parts, _micro_batches("gpt", 0, rank, 4))
    fsdp.save_sharded(shared / "final", parts.model, parts.optimizer, extra={"step": 1})
    return {"path": shared / "final", "weights": fsdp.full_state_dict(parts.model)}


def _all(rank: int, shared: Path) -> dict[str, Any]:
    return {"export": _export(rank, shared), "parity": _parity(rank), "nonfinite": _nonfinite(rank),
            "oom": _oom(rank), "evaluate": _evaluate(rank),
            "refusals": _refusals(rank)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_all, tmp_path_factory.mktemp("fsdp_training"), 2)


@pytest.mark.parametrize("name", list(CASES))
def test_two_fsdp_ranks_accumulating_through_train_step_match_one_process(ranks: list[dict[str, Any]],
                                                                           name: str) -> None:
    kind, opt, max_norm, _ = CASES[name]
    expected, norms = reference(kind, opt, max_norm)
    got = ranks[0]["parity"][name]
    assert got["sharded"] and ranks[1]["parity"][name]["sharded"]
    assert ranks[1]["parity"][name]["weights"] == {}  # gathered on rank 0 only
    assert got["weights"].keys() == expected.keys()
    diffs = {k: (got["weights"][k] - expected[k]).abs() for k in expected}
    if opt == "adamw" and kind == "gpt":
        # The attention's key bias has a zero gradient up to rounding (softmax ignores a shift of the keys): AdamW
        # (eps 1e-8) turns two summation orders' rounding noise into steps of up to lr. Checked apart, loosely.
        for k in [k for k in diffs if k.endswith("attn.qkv.bias")]:
            key_bias = diffs[k][16:32]  # d_model=16: q, k, v
            assert float(key_bias.max()) < 1e-4, (k, float(key_bias.max()))
            diffs[k] = torch.cat([diffs[k][:16], diffs[k][32:]])
    worst = max(diffs, key=lambda k: float(diffs[k].max()))
    assert float(diffs[worst].max()) < 1e-6, (worst, float(diffs[worst].max()))
    initial = build_model(kind if kind == "gpt" else "mlp", None, in_features(kind),
                          CLASSES if kind == "mlp" else VOCAB, config(kind, opt, max_norm).model.kwargs)
    assert any(float((got["weights"][k] - initial.state_dict()[k]).abs().max()) > 1e-3 for k in expected)
    assert got["norms"] == pytest.approx(norms, rel=1e-5)  # the global norm, the same on both ranks
    assert ranks[1]["parity"][name]["norms"] == pytest.approx(norms, rel=1e-5)
    if max_norm is not None:
        assert max(norms) > max_norm  # clipping was active


def test_facts_give_each_rank_its_share_of_parameters_and_optimizer_state(ranks: list[dict[str, Any]]) -> None:
    for name, (kind, opt, max_norm, _) in CASES.items():
        expected, _ = reference(kind, opt, max_norm)
        full = sum(v.numel() * v.element_size() for v in expected.values())
        slots = 2 if opt == "adamw" else 1  # AdamW: two moments; SGD with momentum: one buffer
        for rank in (0, 1):
            facts = ranks[rank]["parity"][name]["bytes"]
            assert facts["parallel"] == "fsdp"
            # Half the full model, plus at most a row of padding per tensor on the larger shard.
            assert full / 2 * 0.9 <= facts["param_bytes_per_rank"] <= full / 2 * 1.3, (name, facts, full)
            assert facts["optimizer_bytes_per_rank"] >= slots * facts["param_bytes_per_rank"]
            assert facts["optimizer_bytes_per_rank"] <= slots * facts["param_bytes_per_rank"] + 64 * len(expected)


def test_a_nonfinite_loss_on_one_rank_skips_the_step_on_both(ranks: list[dict[str, Any]]) -> None:
    assert [r["nonfinite"]["skipped"] for r in ranks] == [True, True]
    before, after = ranks[0]["nonfinite"]["before"], ranks[0]["nonfinite"]["after"]
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_out_of_memory_under_fsdp_is_one_fatal_error_naming_the_micro_batch(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        for where in ("first", "last"):
            oom = r["oom"][where]
            assert "train.micro_batch_size" in oom["error"] and "fsdp" in oom["error"], where
            assert "now 2 rows per forward" in oom["error"] and oom["split"] == 1  # not retried


def whole_batch_metrics(weights: dict[str, torch.Tensor]) -> dict[str, float]:
    """The GPT's validation metrics with `weights` on all 9 rows in one process: what the ranks' shards must sum to."""
    cfg = config("gpt", "sgd", None, workers=1)
    model = build_model("gpt", None, CONTEXT, VOCAB, cfg.model.kwargs)
    model.load_state_dict(weights)
    task = task_parts(cfg)[0]
    whole = batch("gpt", 9)
    with torch.no_grad():
        sums = task.metric_sums(model(whole["x"]), whole)
    return task.metrics({k: float(v) for k, v in sums.items()})


def test_evaluation_on_uneven_shards_matches_all_rows(ranks: list[dict[str, Any]]) -> None:
    expected = whole_batch_metrics(ranks[0]["evaluate"]["weights"])
    for r in ranks:
        assert r["evaluate"]["metrics"] == pytest.approx(expected, rel=1e-5)


def test_flops_probe_counts_the_whole_model_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    cfg = config("gpt", "sgd", None, workers=1)
    model = build_model("gpt", None, CONTEXT, VOCAB, cfg.model.kwargs)
    b = _micro_batches("gpt", 0, 0, 4)[0]
    task = task_parts(cfg)[0]
    flops = count_flops(lambda: task.loss_sum(model(b["x"]), b).backward()) / len(b["x"])
    assert [r["evaluate"]["flops"] for r in ranks] == [flops, flops]


def test_compile_and_auto_micro_batch_are_refused_under_fsdp_naming_the_keys(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        compiled, auto = r["refusals"]
        assert "train.compile" in compiled and "train.parallel=fsdp" in compiled
        assert "train.micro_batch_size=auto" in auto and "train.parallel=fsdp" in auto


def test_final_weights_are_put_together_from_the_shards_on_one_process(ranks: list[dict[str, Any]]) -> None:
    from orchestrator.tracking.flavour import checkpoint_weights

    gathered = ranks[0]["export"]["weights"]
    weights = checkpoint_weights(ranks[0]["export"]["path"])
    assert weights.keys() == gathered.keys()
    assert all(torch.equal(weights[k], gathered[k]) for k in gathered)
    model = build_model("gpt", None, CONTEXT, VOCAB, config("gpt", "sgd", None).model.kwargs)
    model.load_state_dict(weights)  # strict: every parameter and buffer, the model's own shapes


def test_ddp_facts_are_the_whole_model_and_its_adamw_moments() -> None:
    from test_loop import Recorder, batches, config, dataset, make_parts

    from orchestrator.training.loop import Data, run

    cfg = config("train.max_steps=2", "train.log_every=2", "train.eval_every=null", "checkpoint.every=2",
                 "optim.warmup_steps=0")
    parts = make_parts(cfg)
    report = Recorder()
    x, y = dataset(64)
    run(cfg, parts, Data(lambda epoch: batches(x, y, 32)), report)
    first = report.reports[0][0]
    params = list(parts.model.parameters())
    full = sum(p.numel() * p.element_size() for p in params)
    assert first["parallel"] == "ddp" and first["param_bytes_per_rank"] == full
    # Two moments per parameter, and one step counter each (a 0-d tensor of 4 or 8 bytes).
    assert 2 * full + 4 * len(params) <= first["optimizer_bytes_per_rank"] <= 2 * full + 8 * len(params)
