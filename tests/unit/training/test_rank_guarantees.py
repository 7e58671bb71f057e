"""What the ranks of one group must decide together or leave consistent, in one real two-process gloo group (no
Ray): the finite-weights verdict before an FSDP checkpoint, FSDP's units and its fp32 gradient reduction, what FSDP
validation exchanges to keep its ranks in step, a sharded checkpoint's manifest after a slow rank's write, and
`micro_batch_size=auto` on two ranks whose fits differ."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import fsspec.implementations.local
import pyarrow.fs as pafs
import pytest
import torch
import torch.distributed as dist
from gloo_world import run_ranks
from test_fsdp_training import CONTEXT, FEATURES, batch, whole_batch_metrics
from test_fsdp_training import config as fsdp_config
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from orchestrator.config import load_config
from orchestrator.models.tasks import task_parts
from orchestrator.models.zoo import build_model
from orchestrator.training import fsdp
from orchestrator.training.cadence import Notices
from orchestrator.training.checkpoint import MANIFEST, Progress, ShardedSaver, check_complete
from orchestrator.training.evaluation import evaluate
from orchestrator.training.loop import Data, run
from orchestrator.training.memory import GIB, activation_bytes_per_sample, state_bytes
from orchestrator.training.micro_batch import choose_micro_batch, with_auto_micro_batch
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts, build_parts
from orchestrator.training.precision import Precision
from pipelines.tensors import Batch

CPU = torch.device("cpu")


# ---- FSDP's units and its gradient reduction ---------------------------------------------------------------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5))


def _units(rank: int) -> dict[str, list[str]]:
    """The names of the FSDP units (in `modules()` order) of an MLP sharded per Linear and of the built-in GPT
    through build_parts (its Blocks by default)."""
    mlp = fsdp.shard_model(_mlp(), mesh=fsdp.mesh_of_all_ranks(CPU), blocks=["Linear"])
    gpt = build_parts(fsdp_config("gpt", "sgd", None), CONTEXT, CPU).model
    return {name: [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
            for name, model in (("mlp", mlp), ("gpt", gpt))}


def _reduction(rank: int) -> dict[str, Any]:
    """bf16 FSDP: one backward on this rank's rows; the reduced (sharded) gradients gathered whole, with this rank's
    own bf16 gradients from a plain bf16 copy of the model (what each rank feeds into the reduction)."""
    x, y = torch.randn(8, FEATURES, generator=torch.Generator().manual_seed(rank)), torch.arange(8) % 5
    model = fsdp.shard_model(_mlp(), mesh=fsdp.mesh_of_all_ranks(CPU), blocks=["Linear"], precision="bf16")
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    plain = _mlp().to(torch.bfloat16)
    nn.functional.cross_entropy(plain(x.to(torch.bfloat16)), y, reduction="sum").backward()
    return {"reduced": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
            "own": {n: p.grad for n, p in plain.named_parameters()}}


# ---- FSDP validation: what the ranks exchange to stay in step ----------------------------------------------------


def _tensors_in(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(_tensors_in(k) + _tensors_in(v) for k, v in obj.items())
    if isinstance(obj, list | tuple | set):
        return sum(_tensors_in(v) for v in obj)
    return 0


def _validation(rank: int) -> dict[str, Any]:
    """Rank 1 has no validation rows at all, so the shape of its empty batches must come from rank 0. Every object
    the ranks exchange is recorded (torch's own all_gather_object still does the exchange)."""
    parts = build_parts(fsdp_config("gpt", "sgd", None), CONTEXT, CPU)
    whole = batch("gpt", 9)
    mine = [{k: v[s] for k, v in whole.items()} for s in (slice(0, 4), slice(4, 8), slice(8, 16))] if rank == 0 \
        else []
    sent: list[Any] = []
    gather = dist.all_gather_object

    def recorded(out: list[Any], obj: Any, group: Any = None) -> None:
        sent.append(obj)
        gather(out, obj, group=group)

    dist.all_gather_object = recorded
    try:
        metrics = evaluate(parts, mine)
    finally:
        dist.all_gather_object = gather
    return {"metrics": metrics, "weights": fsdp.full_state_dict(parts.model), "sent": sent,
            "tensors_sent": _tensors_in(sent)}


# ---- a sharded checkpoint's manifest after a slow rank's write ---------------------------------------------------


SLOW_WRITE_S = 1.0


class _SlowShardWrites(fsspec.implementations.local.LocalFileSystem):
    """Local storage where opening `__1_*` (rank 1's shards) for writing takes SLOW_WRITE_S: a slow upload."""

    cachable = False

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "w" in mode and Path(path).name.startswith("__1_"):
            time.sleep(SLOW_WRITE_S)
        return super()._open(path, mode, *args, **kwargs)


def _slow_manifest(rank: int, shared: Path) -> dict[str, Any]:
    """An asynchronous sharded save whose rank 1 writes slowly, committed at once on both ranks: what rank 0's
    manifest lists when its commit returns, and the files in storage once every rank's commit returned."""
    model = fsdp.shard_model(_mlp(), mesh=fsdp.mesh_of_all_ranks(CPU), blocks=["Linear"])
    optimizer, scheduler = build_optimizer(model, load_config(None, []).optim, 4)
    parts = Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU)
    storage = pafs.PyFileSystem(pafs.FSSpecHandler(_SlowShardWrites()))
    path = str(shared / "slow")
    saver = ShardedSaver(asynchronous=True)
    pending = saver.save(storage, path, parts, Progress(step=1), micro_batch_size=4)
    pending.commit()
    listed = json.loads((Path(path) / MANIFEST).read_text())["files"] if rank == 0 else None
    saver.close()
    dist.barrier()
    stored = {p.name: p.stat().st_size for p in Path(path).iterdir() if p.name != MANIFEST}
    return {"listed": listed, "stored": stored, "complete": check_complete(pafs.LocalFileSystem(), path)}


# ---- micro_batch_size=auto on two ranks whose fits differ --------------------------------------------------------


PER_WORKER = 64
ROOM = (100, 20)  # samples each rank's budget has room for: rank 0 fits 64 rows, rank 1 the divisor 16


def _auto_config(rank: int, world: int) -> Any:
    return load_config(None, [f"scaling.num_workers={world}", "model.hidden=[32]", "train.precision=fp32",
                              f"train.global_batch_size={PER_WORKER * world}", "train.micro_batch_size=auto",
                              f"train.memory_budget_gb={_budget_gb(rank)}"])


def _auto_model() -> nn.Module:
    return build_model("mlp", None, 16, 4, {"hidden": [32]})


def _sample() -> Batch:
    g = torch.Generator().manual_seed(5)
    return {"x": torch.randn(8, 16, generator=g), "labels": torch.randint(0, 4, (8,), generator=g)}


def _budget_gb(rank: int) -> float:
    """A budget with room for the model's state (AdamW) and ROOM[rank] samples, as the CPU estimate counts them."""
    model, sample = _auto_model(), _sample()
    task = task_parts(load_config(None, []))[0]
    per_sample = activation_bytes_per_sample(model, 8, lambda: task.loss_sum(model(sample["x"]), sample))
    return (state_bytes(model, optimizer_slots=2) + ROOM[rank] * per_sample) / GIB


def _auto_parts(cfg: Any, wrap: bool) -> Parts:
    torch.manual_seed(0)
    model = _auto_model()
    model = DistributedDataParallel(model) if wrap else model
    optimizer, scheduler = build_optimizer(model, cfg.optim, 10)
    return Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU)


def _auto(rank: int) -> int:
    cfg = _auto_config(rank, 2)
    chosen = with_auto_micro_batch(cfg, _auto_parts(cfg, wrap=True), None, _sample())
    return chosen.train.micro_batch_size  # type: ignore[return-value]


# ---- the finite-weights verdict before an FSDP checkpoint --------------------------------------------------------


class _Reporter:
    """Sharded checkpoints into local storage, as the Ray reporter writes them; reports recorded."""

    def __init__(self, root: Path) -> None:
        self.root, self.saver, self.published = root, ShardedSaver(asynchronous=False), []

    def save_sharded(self, parts: Parts, progress: Progress, micro_batch_size: Any) -> Any:
        return self.saver.save(pafs.LocalFileSystem(), str(self.root / f"step{progress.step}"), parts, progress,
                               micro_batch_size)

    def checkpoint(self, metrics: dict[str, Any], pending: Any) -> None:
        pending.commit()

    def publish(self, metrics: dict[str, Any]) -> None:
        self.published.append(metrics["step"])


def _overflow_in_one_shard(rank: int, shared: Path) -> dict[str, Any]:
    """Two steps under FSDP with a checkpoint at step 2. After step 2's update, an inf lands in rank 1's shard of
    the first weight only (as an overflowing update of that shard would leave it): every rank must stop before the
    checkpoint's collectives, with the same error. Last in the group: a rank left in a collective breaks it."""
    cfg = fsdp_config("mlp", "sgd", None, "train.max_steps=2", "train.log_every=1", "checkpoint.every=2")
    parts = build_parts(cfg, FEATURES, CPU)
    reports = [0]

    def plant() -> bool:  # the loop asks at every report step, after the step's update
        reports[0] += 1
        if reports[0] == 2 and rank == 1:
            with torch.no_grad():
                next(parts.model.parameters()).to_local()[0, 0] = math.inf
        return False

    def train_batches(epoch: int) -> list[Batch]:
        whole = batch("mlp", epoch)
        return [{k: v[rank * 8 + i:rank * 8 + i + 2] for k, v in whole.items()} for i in range(0, 8, 2)]

    reporter = _Reporter(shared / "finite")
    try:
        run(cfg, parts, Data(train_batches), reporter, notices=Notices(plant))
        error = "none"
    except Exception as exc:  # noqa: BLE001 - whatever each rank met is the result
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "published": reporter.published, "saved": sorted(p.name for p in
                                                                             (shared / "finite").glob("step*"))}


def _all(rank: int, shared: Path) -> dict[str, Any]:
    return {"units": _units(rank), "reduction": _reduction(rank), "validation": _validation(rank),
            "manifest": _slow_manifest(rank, shared), "auto": _auto(rank),
            "finite": _overflow_in_one_shard(rank, shared)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_all, tmp_path_factory.mktemp("rank_guarantees"), 2)


def test_an_overflow_in_one_ranks_shard_stops_every_rank_with_one_error_before_the_checkpoint(
        ranks: list[dict[str, Any]]) -> None:
    errors = [r["finite"]["error"] for r in ranks]
    assert errors[0] == errors[1], errors
    assert errors[0] == ("NonFiniteLossError: the model weights are not finite at step 2: not checkpointing them; "
                         "lower optim.lr or set optim.max_grad_norm, and resume from the last checkpoint")
    for r in ranks:
        assert r["finite"]["published"] == [1]  # step 1's report went out, step 2's never
        assert r["finite"]["saved"] == []  # no rank began writing the checkpoint


def test_every_configured_block_is_its_own_fsdp_unit(ranks: list[dict[str, Any]]) -> None:
    # The root (which holds what no block does) and each block: the MLP's three Linear layers, the GPT's two Blocks
    # (the root keeps embeddings, final norm and head).
    linears = [n for n, m in _mlp().named_modules() if isinstance(m, nn.Linear)]
    cfg = fsdp_config("gpt", "sgd", None, workers=1)
    gpt = build_model("gpt", None, CONTEXT, cfg.model.num_classes, cfg.model.kwargs)
    blocks = [n for n, m in gpt.named_modules() if type(m).__name__ == "Block"]
    assert len(linears) == 3 and len(blocks) == 2
    for r in ranks:
        assert r["units"]["mlp"] == ["", *linears]
        assert r["units"]["gpt"] == ["", *blocks]


def test_bf16_fsdp_reduces_gradients_in_fp32(ranks: list[dict[str, Any]]) -> None:
    """Each rank's bf16 gradients, averaged in fp32: a bf16 reduction would round the mean to 8 bits of mantissa
    (an error of up to 2**-9 of each value); fp32 keeps it to rounding noise."""
    for name, reduced in ranks[0]["reduction"]["reduced"].items():
        mean = (ranks[0]["reduction"]["own"][name].double() + ranks[1]["reduction"]["own"][name].double()) / 2
        assert reduced.dtype == torch.float32
        assert torch.allclose(reduced.double(), mean, rtol=1e-6, atol=1e-9), \
            (name, float((reduced.double() - mean).abs().max()))
        # The control: the same mean rounded to bf16 is measurably further from it.
        assert not torch.allclose(mean.to(torch.bfloat16).double(), mean, rtol=1e-6, atol=1e-9), name
    assert ranks[1]["reduction"]["reduced"].keys() == ranks[0]["reduction"]["reduced"].keys()


def test_fsdp_validation_exchanges_shapes_not_tensors_and_keeps_its_ranks_in_step(ranks: list[dict[str, Any]]
                                                                                   ) -> None:
    # Tensors pickled across ranks would be unpickled on their own (foreign) GPU: a CUDA context per GPU per rank.
    sent = [r["validation"]["sent"] for r in ranks]
    assert [r["validation"]["tensors_sent"] for r in ranks] == [0, 0], sent
    assert all(sent)  # the exchange took place (rank 1 learnt the shapes from rank 0)
    expected = whole_batch_metrics(ranks[0]["validation"]["weights"])
    for r in ranks:
        assert r["validation"]["metrics"] == pytest.approx(expected, rel=1e-5)


def test_a_sharded_manifest_is_written_after_every_ranks_write_even_a_slow_one(ranks: list[dict[str, Any]]) -> None:
    manifest = ranks[0]["manifest"]
    assert sorted(manifest["stored"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # What rank 0 listed when its commit returned is every rank's file at its final size: rank 1's slow shard too.
    assert manifest["listed"] == manifest["stored"]
    assert manifest["complete"] is None


def test_auto_micro_batch_agrees_on_the_smallest_fit_of_the_ranks(ranks: list[dict[str, Any]]) -> None:
    # Each rank's fit alone (a one-rank group, here), under the budget that rank had.
    alone = [choose_micro_batch(_auto_config(rank, 1), _auto_parts(_auto_config(rank, 1), wrap=False), _sample())
             for rank in (0, 1)]
    assert alone == [64, 16]
    assert [r["auto"] for r in ranks] == [16, 16]
