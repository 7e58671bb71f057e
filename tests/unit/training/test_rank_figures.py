"""What a two-rank group reports about its own speed and loss, in a real two-process gloo group (no Ray): the group's
samples/s, tokens/s and MFU (the world factor), each worker's own pace, and the training loss as the mean over both
ranks' targets. Every figure is compared with a count made here from the data, not with the loop's own sums."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo import run_two_ranks
from test_loop import Recorder
from torch.nn.parallel import DistributedDataParallel

from orchestrator.config import Config, load_config
from orchestrator.models.tasks import CausalLM
from orchestrator.training.evaluation import evaluate
from orchestrator.training.loop import Data, run
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision
from pipelines.tensors import IGNORE_INDEX

CPU = torch.device("cpu")
VOCAB, WIDTH, SEQ = 16, 8, 6  # token ids, embedding width, positions per row
ROWS = 16  # per rank: 4 steps of 2 micro-batches of 2 rows
MICRO, STEPS, LOG_EVERY = 2, 4, 2
PEAK_TFLOPS = 0.001
SLOW_S = 0.05  # rank 1's extra seconds per forward: a slow node


def _config() -> Config:
    return load_config(None, ["scaling.num_workers=2", "model.hidden=[32]", "train.precision=fp32",
                              "optim.warmup_steps=0", "train.eval_every=null", "data.val=null",
                              f"train.global_batch_size={2 * 2 * MICRO}", f"train.micro_batch_size={MICRO}",
                              f"train.max_steps={STEPS}", f"train.log_every={LOG_EVERY}", f"checkpoint.every={STEPS}",
                              f"train.peak_tflops={PEAK_TFLOPS}"])


class TinyLM(torch.nn.Module):
    """Embedding then a linear head over the vocabulary; `slow_s` of sleep per forward stands in for a slow node."""

    def __init__(self, slow_s: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on both ranks and in the reference
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        self.slow_s = slow_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow_s:
            time.sleep(self.slow_s)
        return self.head(self.embed(x))


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token rows; rank 1's targets are mostly padding, so the ranks hold very different token counts."""
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    if rank == 1:
        lengths = torch.randint(1, 3, (ROWS,), generator=g)
        y[torch.arange(SEQ) >= lengths[:, None]] = IGNORE_INDEX
    return x, y


def _train(rank: int, shared: Path) -> dict[str, Any]:
    cfg = _config()
    x, y = _data(rank)
    model = DistributedDataParallel(TinyLM(SLOW_S if rank == 1 else 0.0))
    # lr 0: the weights stay the initial ones, so the reference loss of every interval is one forward away.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    parts = Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU, None, task=CausalLM())
    recorder = Recorder()
    run(cfg, parts, Data(lambda epoch: [{"x": x[i:i + MICRO], "labels": y[i:i + MICRO]}
                                        for i in range(0, ROWS, MICRO)]), recorder)
    # Each rank evaluates its own validation shard (rank 0 in two batches, rank 1 in one): the figures must be the
    # whole split's.
    val = [{"x": x[:ROWS // 2], "labels": y[:ROWS // 2]}, {"x": x[ROWS // 2:], "labels": y[ROWS // 2:]}]
    evaluated = evaluate(parts, val if rank == 0 else [{"x": x, "labels": y}])
    return {"reports": [metrics for metrics, _ in recorder.reports], "x": x, "y": y, "val": evaluated}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_two_ranks(_train, tmp_path_factory.mktemp("figures"))


ROWS_PER_INTERVAL = LOG_EVERY * 2 * MICRO  # one rank's rows between two reports


def _interval(i: int) -> slice:
    return slice(i * ROWS_PER_INTERVAL, (i + 1) * ROWS_PER_INTERVAL)


def test_samples_per_second_is_the_groups(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert [m["step"] for m in result["reports"]] == [2, 4]
        for metrics in result["reports"]:
            assert metrics["world_size"] == 2
            # Both ranks' rows over the interval's wall clock, not one rank's.
            assert metrics["samples_per_s"] * metrics["interval_s"] == pytest.approx(2 * ROWS_PER_INTERVAL)


def test_tokens_per_second_counts_every_ranks_tokens(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        for i, metrics in enumerate(result["reports"]):
            tokens = sum(int((r["y"][_interval(i)] != IGNORE_INDEX).sum()) for r in ranks)
            own = int((result["y"][_interval(i)] != IGNORE_INDEX).sum())
            assert tokens != 2 * own  # unequal counts: a rank's own count times the world would not pass
            assert metrics["tokens_per_s"] * metrics["interval_s"] == pytest.approx(tokens)


def test_mfu_is_the_group_throughput_over_the_groups_peak(ranks: list[dict[str, Any]]) -> None:
    # torch's flop counter counts matrix products only: the head's forward, and its two backward products (the
    # gradients of its input and of its weight), 2 FLOPs per multiply-add, per position.
    flops_per_sample = 3 * 2 * SEQ * WIDTH * VOCAB
    for result in ranks:
        for metrics in result["reports"]:
            assert metrics["flops_per_sample"] == flops_per_sample
            assert metrics["mfu"] == pytest.approx(
                flops_per_sample * metrics["samples_per_s"] / (PEAK_TFLOPS * 1e12 * 2))


def test_each_workers_pace_is_its_own(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        for i, metrics in enumerate(result["reports"]):
            paces = [metrics[f"worker/{r}/samples_per_s"] for r in (0, 1)]
            for r, pace in enumerate(paces):
                # Its own rows over its own busy seconds, which are at most its interval's wall clock.
                assert pace >= ROWS_PER_INTERVAL / ranks[r]["reports"][i]["interval_s"] * (1 - 1e-9)
            # Rank 1 slept in each of its forwards: its own rows over at least that long.
            assert paces[1] <= ROWS_PER_INTERVAL / (SLOW_S * ROWS_PER_INTERVAL / MICRO)
            assert paces[0] > paces[1]  # the slow node shows as the slow one
    assert ranks[0]["reports"][-1]["worker/1/samples_per_s"] == ranks[1]["reports"][-1]["worker/1/samples_per_s"]


def test_train_loss_is_the_mean_over_both_ranks_targets(ranks: list[dict[str, Any]]) -> None:
    model = TinyLM()
    for i in range(STEPS // LOG_EVERY):
        sums, counts = [], []
        with torch.no_grad():
            for r in ranks:
                logits = model(r["x"][_interval(i)]).double()
                sums.append(float(torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), r["y"][_interval(i)].flatten(), reduction="sum",
                    ignore_index=IGNORE_INDEX)))
                counts.append(int((r["y"][_interval(i)] != IGNORE_INDEX).sum()))
        expected = sum(sums) / sum(counts)
        # The mean of the ranks' means weighs rank 1's few tokens as much as rank 0's many: a different figure.
        assert abs(expected - sum(s / c for s, c in zip(sums, counts, strict=True)) / 2) > 1e-3
        for result in ranks:
            assert result["reports"][i]["train_loss"] == pytest.approx(expected, rel=1e-5)


def test_validation_figures_are_the_whole_splits_over_both_ranks(ranks: list[dict[str, Any]]) -> None:
    model = TinyLM()
    with torch.no_grad():
        logits = torch.cat([model(r["x"]) for r in ranks]).double().flatten(0, 1)
    labels = torch.cat([r["y"] for r in ranks]).flatten()
    real = labels != IGNORE_INDEX
    loss = float(torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX))
    accuracy = float((logits.argmax(1) == labels)[real].double().mean())
    for result in ranks:
        assert result["val"]["val_loss"] == pytest.approx(loss, rel=1e-6)
        assert result["val"]["val_accuracy"] == pytest.approx(accuracy, rel=1e-9)


DATA_WAIT_S = 0.05  # rank 1's wait for each of its batches: a slow reader on one node


def _slow_reader(rank: int, shared: Path) -> dict[str, Any]:
    cfg = _config()
    x, y = _data(rank)
    parts = Parts(DistributedDataParallel(TinyLM()), *_frozen(TinyLM()), Precision("fp32", CPU), CPU, None,
                  task=CausalLM())

    def batches(epoch: int) -> Any:
        for i in range(0, ROWS, MICRO):
            if rank == 1:
                time.sleep(DATA_WAIT_S)
            yield {"x": x[i:i + MICRO], "labels": y[i:i + MICRO]}

    recorder = Recorder()
    run(cfg, parts, Data(batches), recorder)
    return {"reports": [metrics for metrics, _ in recorder.reports]}


def _frozen(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def test_waiting_for_a_rank_whose_reader_is_slow_is_sync_not_other(tmp_path: Path) -> None:
    """Rank 1 waits for each of its batches; rank 0, whose data is ready, waits for rank 1 at the step's first
    collective. That wait is billed to sync on rank 0 (whose shares the ledger takes), not left in "other"."""
    fast, slow = (r["reports"][-1] for r in run_two_ranks(_slow_reader, tmp_path))
    waited = LOG_EVERY * 2 * DATA_WAIT_S  # rank 1's reads in the second interval: 2 steps of 2 micro-batches
    assert slow["time/data_wait_frac"] * slow["interval_s"] >= waited * 0.9
    assert fast["time/sync_frac"] * fast["interval_s"] >= waited * 0.8
    assert fast["time/other_frac"] * fast["interval_s"] < waited * 0.2
