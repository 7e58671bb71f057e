"""Validation over held small data on a real gloo group (no Ray runtime): each rank scores the validation shard the
worker builds for it (worker.rank_shard over pipelines/held.py), `evaluate` adds the sums across ranks, and the
accuracy and loss equal one worker's over every row, counted here independently with numpy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from gloo_world import run_ranks

from orchestrator.config import load_config
from orchestrator.training.evaluation import evaluate
from orchestrator.training.handoff import WorkerSpec
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision
from orchestrator.training.worker import Seat, rank_shard
from pipelines.batches import FeatureCollate
from pipelines.held import HeldRows

CPU = torch.device("cpu")
N_VAL, FEATURES, CLASSES = 7, 4, 3


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    return rng.normal(size=(N_VAL, FEATURES)).astype(np.float32), rng.integers(CLASSES, size=N_VAL)


def _model() -> torch.nn.Linear:
    torch.manual_seed(3)
    return torch.nn.Linear(FEATURES, CLASSES)


def _rank_metrics(rank: int, shared: Path) -> dict[str, float]:
    import ray

    ray.get = lambda refs: refs  # the blocks are in-memory tables here, not ObjectRefs
    x, y = _data()
    table = pa.table({"f": pa.FixedSizeListArray.from_arrays(x.reshape(-1), FEATURES), "label": y})
    held = HeldRows([table.slice(0, 4), table.slice(4)])  # two blocks, as the driver holds them
    world = torch.distributed.get_world_size()
    shard = rank_shard(WorkerSpec(config={}, held={"val": held}), "val", Seat(world, rank, CPU, 0.0), lambda _: None)
    model = _model()
    optimizer, scheduler = build_optimizer(model, load_config(None, []).optim, 1)
    parts = Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU)
    return evaluate(parts, shard.iter_torch_batches(batch_size=2, collate_fn=FeatureCollate(["f"], "label")))


@pytest.mark.parametrize("world", [2, 3])
def test_held_validation_on_several_ranks_equals_one_worker_over_every_row(tmp_path: Path, world: int) -> None:
    x, y = _data()
    model = _model()
    w, b = model.weight.detach().numpy().astype(np.float64), model.bias.detach().numpy().astype(np.float64)
    logits = x.astype(np.float64) @ w.T + b
    accuracy = float((logits.argmax(-1) == y).sum()) / N_VAL
    shifted = logits - logits.max(-1, keepdims=True)
    loss = float(np.mean(np.log(np.exp(shifted).sum(-1)) - shifted[np.arange(N_VAL), y]))
    assert 0 < accuracy < 1  # a dropped row would change it: k/7 is never j/6 or j/5 for 0 < k < 7

    metrics: list[dict[str, Any]] = run_ranks(_rank_metrics, tmp_path, world)
    for m in metrics:  # every rank reports the group's figures
        assert m["val_accuracy"] == accuracy
        assert m["val_loss"] == pytest.approx(loss, rel=1e-6)
