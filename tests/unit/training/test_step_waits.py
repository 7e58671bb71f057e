"""A step never waits for the device: between two reports no value is read back and nothing synchronises it (the
real loop, one process and a real two-rank gloo group, DDP with accumulation, local SGD and FSDP, fp32 and bf16);
what the report needs is read at the report, a bounded number of times whatever the interval's length. The
decisions that used to read a flag every step are taken on the device and still hold: a non-finite step is skipped
on every rank, and the targets' all-reduce runs only where the ranks' counts differ (tokens)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch
import torch.distributed as dist
from gloo import run_two_ranks
from reads import HostReads
from test_loop import Recorder
from torch.nn.parallel import DistributedDataParallel

from orchestrator.config import Config, load_config
from orchestrator.models.tasks import task_parts
from orchestrator.models.zoo import build_model
from orchestrator.training.checkpoint import ShardedSaver
from orchestrator.training.loop import Data, run
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts, build_parts
from orchestrator.training.precision import Precision, resolve_precision
from orchestrator.training.step import train_step
from orchestrator.training.sync import build_local_sgd
from orchestrator.training.timing import PhaseTimer
from pipelines.feed import RankBatches, RankOrder

CPU = torch.device("cpu")
FEATURES, CLASSES, ROWS = 16, 4, 512


def _config(*overrides: str, workers: int = 1) -> Config:
    """The product's defaults (checkpoint.every=auto among them) but for the experiment's size."""
    mlp = [] if any(o.startswith(("model.name=", "model.entrypoint=")) for o in overrides) else ["model.hidden=[32]",
                                                                          f"model.num_classes={CLASSES}"]
    return load_config(None, [f"scaling.num_workers={workers}", *mlp, "data.val=null", "train.eval_every=null",
                              *overrides])


def _source(rank: int, micro: int, nan_at: int | None = None) -> Any:
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(ROWS, FEATURES, generator=g)
    y = x[:, :CLASSES].argmax(dim=1)
    if nan_at is not None:
        x[nan_at * micro, 0] = math.nan

    def batches(epoch: int) -> list[dict[str, torch.Tensor]]:
        return [{"x": x[i:i + micro], "labels": y[i:i + micro]} for i in range(0, ROWS - micro + 1, micro)]
    return batches


def _built(cfg: Config, in_features: int = FEATURES) -> Parts:
    """build_parts, but with torch's own DDP wrapper where Ray Train's prepare_model would wrap (no Ray here)."""
    if cfg.train.parallel == "fsdp" or cfg.scaling.num_workers == 1:
        return build_parts(cfg, in_features, CPU)
    task, call, model_loss = task_parts(cfg)
    torch.manual_seed(cfg.train.seed)
    model = DistributedDataParallel(build_model(cfg.model.name, None, in_features, cfg.model.num_classes,
                                                cfg.model.kwargs))
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.train.max_steps)  # type: ignore[arg-type]
    return Parts(model, optimizer, scheduler, Precision(resolve_precision(cfg.train.precision, CPU), CPU), CPU,
                 cfg.optim.max_grad_norm, local_sgd=build_local_sgd(cfg.train.sync, *cfg.train.local_sgd),
                 task=task, call=call, model_loss=model_loss)


class ShardedRecorder(Recorder):
    """Recorder that also writes train.parallel=fsdp's sharded checkpoints (into `root`, synchronously)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root, self.saver = root, ShardedSaver(asynchronous=False)

    def save_sharded(self, parts: Parts, progress: Any, micro_batch_size: Any) -> Any:
        return self.saver.save(pafs.LocalFileSystem(), str(self.root / f"step{progress.step}"), parts, progress,
                               micro_batch_size)

    def checkpoint(self, metrics: dict[str, Any], pending: Any) -> None:
        if hasattr(pending, "commit"):
            pending.commit()
        else:
            super().checkpoint(metrics, pending)


def _counted(cfg: Config, parts: Parts, source: Any, root: Path | None = None, profile: bool = False
             ) -> dict[str, Any]:
    report = ShardedRecorder(root) if root is not None else Recorder()
    with HostReads(profile=profile).around_loop() as reads:
        run(cfg, parts, Data(source), report)
    return {"reads": dict(reads.counts), "syncs": dict(reads.syncs), "steps": reads.steps,
            "reports": len(report.reports), "waits": dict(reads.waits)}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_no_host_read_in_the_steps_between_reports_and_a_bounded_few_at_each(precision: str) -> None:
    counted = {}
    for log_every in (4, 12):
        cfg = _config(f"train.precision={precision}", "train.global_batch_size=32", "train.micro_batch_size=16",
                      "train.max_steps=24", f"train.log_every={log_every}")
        counted[log_every] = _counted(cfg, build_parts(cfg, FEATURES, CPU), _source(0, 16), profile=True)
    for log_every, result in counted.items():
        assert result["steps"] == 24 and result["reports"] == 24 // log_every
        assert result["reads"].get("step", 0) == 0, result
        assert result["syncs"] == {}, result
        # The profiler's count (the GPU test's, which also sees CUDA's blocking calls) agrees: none in the steps,
        # and it sees the reads the reports make.
        waits = result["waits"]
        assert not {k: n for k, n in waits.items() if k[0] == "step"}, waits
        assert waits.get(("report", "aten::_local_scalar_dense"), 0) >= result["reports"], waits
    # A report's reads do not grow with the steps it covers (a checkpoint's report reads a few more: the first and
    # the last report of these runs save one under checkpoint.every=auto).
    per_report = {n: r["reads"]["report"] / r["reports"] for n, r in counted.items()}
    assert max(per_report.values()) <= 4, per_report


def tiny_lm(vocab: int = 16) -> torch.nn.Module:
    """An embedding and a head over the vocabulary, called by name: forward(input_ids, attention_mask)."""

    class TinyLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(input_ids) * attention_mask[..., None])

    return TinyLM()


class Tokens:
    """One rank's variable-length token rows as Ray Data's iter_torch_batches hands them out: fetched chunks
    collated by the product's own collate (padded with a mask), on the host."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.table = pa.table({"tokens": pa.array([list(rng.integers(1, 16, n)) for n in rng.integers(2, 12, 256)],
                                                  type=pa.list_(pa.int64()))})

    def iter_torch_batches(self, *, batch_size: int, collate_fn: Any, **_: Any) -> Any:
        for start in range(0, self.table.num_rows, batch_size):
            yield collate_fn(self.table.slice(start, batch_size))


def test_variable_length_tokens_are_trimmed_without_a_read_in_the_steps() -> None:
    # Padded rows: each micro-batch is cut to its own longest row on the host, from the mask, before the copy.
    cfg = _config("model.entrypoint=test_step_waits:tiny_lm",
                  "model.inputs={input_ids: tokens, attention_mask: attention_mask}", "data.features=[tokens]",
                  "data.label=null", "task.name=causal_lm", "train.global_batch_size=16", "train.micro_batch_size=8",
                  "train.max_steps=24", "train.log_every=8", "optim.warmup_steps=2")
    tokens = Tokens()
    data = RankBatches(cfg.data, tokens, None, 8, RankOrder(seed=0, rank=0, replay=True), named=True,
                       schema=tokens.table.schema)
    counted = _counted(cfg, build_parts(cfg, None, CPU), data.train)
    assert counted["steps"] == 24 and counted["reads"].get("step", 0) == 0, counted


def _two_ranks(rank: int, shared: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    modes = {"ddp": [], "local_sgd": ["train.sync=local_sgd", "train.sync_every=4"],
             "fsdp": ["train.parallel=fsdp"]}
    for name, overrides in modes.items():
        cfg = _config("train.precision=fp32", "train.global_batch_size=32", "train.micro_batch_size=8",
                      "train.max_steps=16", "train.log_every=8", "optim.warmup_steps=4", *overrides,
                      workers=2)
        out[name] = _counted(cfg, _built(cfg), _source(rank, 8), shared / name)
    out["nan"] = _skips_together(rank, "optim.momentum=0", nan_step=3)
    # The first step skipped: the optimizer's state (SGD's momentum) does not exist yet, and must not come out of it.
    out["nan_first"] = _skips_together(rank, "optim.momentum=0.9", nan_step=1)
    out["token_shares"] = _token_shares(rank)
    return out


TOKENS = ["model.name=gpt", "model.d_model=16", "model.n_layer=1", "model.n_head=2", "data.label=null",
          "task.name=causal_lm", "model.num_classes=12"]
LATE_S = 0.25  # rank 0's data comes this late at every step (well beyond a step of this model, even on a busy machine)


def _token_shares(rank: int) -> dict[str, float]:
    """A token run on two ranks whose rank 0 reads each step's data LATE_S late: rank 1 waits that long for the
    token count's all-reduce, which is sync (waiting for a peer), not compute."""
    cfg = _config(*TOKENS, "train.global_batch_size=8", "train.micro_batch_size=2", "optim.warmup_steps=0",
                  "train.max_steps=6", "train.log_every=6", workers=2)
    parts = _built(cfg, 6)
    g = torch.Generator().manual_seed(rank)
    labels = torch.randint(0, 12, (2, 6), generator=g)
    labels[:, : 2 + rank] = -100  # ranks hold different token counts
    batch = {"x": torch.randint(0, 12, (2, 6), generator=g), "labels": labels}

    def source(epoch: int) -> Any:
        for i in range(64):
            if rank == 0 and i % 2 == 0:  # a step's first micro-batch (two per step and rank)
                time.sleep(LATE_S)
            yield batch

    report = Recorder()
    run(cfg, parts, Data(source), report)
    metrics = report.reports[-1][0]
    return {key: metrics[key] for key in metrics if key.startswith("time/")} | {"wall": metrics["interval_s"]}


SGD = ["optim.name=sgd", "optim.weight_decay=0", "optim.lr=0.5", "optim.warmup_steps=0", "optim.schedule=constant",
       "optim.max_grad_norm=null"]


def _skips_together(rank: int, momentum: str, nan_step: int) -> dict[str, Any]:
    """Rank 1's rows of step `nan_step` hold a NaN: the run that skips that step, and a run on both ranks' data
    without that step's rows (one step fewer), must end with the same weights on both ranks."""
    cfg = _config(*SGD, momentum, "train.global_batch_size=16", "train.max_steps=8", "train.log_every=4", workers=2)
    parts = _built(cfg)
    source = _source(rank, 8, nan_at=nan_step - 1 if rank == 1 else None)  # one micro-batch per step and rank
    report = Recorder()
    run(cfg, parts, Data(source), report)
    shorter = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": 7})})
    without = _built(shorter)
    run(shorter, without,
        Data(lambda epoch: [b for i, b in enumerate(_source(rank, 8)(epoch)) if i != nan_step - 1]), Recorder())
    return {"skipped": [m["nonfinite_skipped"] for m, _ in report.reports],
            "weights": [p.detach().clone() for p in parts.model.parameters()],
            "without": [p.detach().clone() for p in without.model.parameters()]}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_two_ranks(_two_ranks, tmp_path_factory.mktemp("waits"))


@pytest.mark.parametrize("mode", ["ddp", "local_sgd", "fsdp"])
def test_no_host_read_between_reports_on_two_ranks(two_ranks: list[dict[str, Any]], mode: str) -> None:
    for result in two_ranks:
        counted = result[mode]
        assert counted["steps"] == 16 and counted["reports"] == 2
        assert counted["reads"].get("step", 0) == 0, counted
        assert counted["syncs"] == {}, counted


@pytest.mark.parametrize("case", ["nan", "nan_first"])
def test_a_nan_on_one_rank_skips_the_step_on_both_with_the_weights_of_a_run_without_it(
        two_ranks: list[dict[str, Any]], case: str) -> None:
    """`nan`: SGD without momentum, step 3; `nan_first`: SGD with momentum 0.9, the first step (its momentum
    buffers are created by the step the device skips)."""
    for result in two_ranks:
        assert result[case]["skipped"] == [1, 1]  # the run's count, from the report that follows it
        for skipped, without in zip(result[case]["weights"], result[case]["without"], strict=True):
            torch.testing.assert_close(skipped, without, rtol=0, atol=1e-7)
    for a, b in zip(two_ranks[0][case]["weights"], two_ranks[1][case]["weights"], strict=True):
        assert torch.equal(a, b)


def test_a_wait_for_a_late_rank_in_the_token_count_is_sync_and_the_shares_tile_the_wall_clock(
        two_ranks: list[dict[str, Any]]) -> None:
    late, waiting = (r["token_shares"] for r in two_ranks)
    phases = [key for key in late if key.startswith("time/") and key != "time/other_frac"]
    for shares in (late, waiting):
        assert sum(shares[key] for key in phases) <= 1.0 + 1e-6, shares  # no second is billed twice
    # Rank 0 waits for its data at least 5 times LATE_S (the loop may fetch the first step's before the interval).
    assert late["time/data_wait_frac"] * late["wall"] >= 5 * LATE_S, late
    # Rank 1 spends those seconds in the all-reduce of the token count: sync, and not its compute.
    assert waiting["time/sync_frac"] * waiting["wall"] >= 0.8 * 5 * LATE_S, (late, waiting)
    assert waiting["time/compute_frac"] < waiting["time/sync_frac"] / 2, (late, waiting)


def _collectives(rank: int, shared: Path) -> dict[str, int]:
    """The all-reduces one step makes before its backward: none for classification (the normaliser is rows x
    world), one for tokens (whose counts differ per rank), started before the forward and waited for after it."""
    calls: dict[str, int] = {}
    original = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        key = "async" if kwargs.get("async_op") else "blocking"
        calls[key] = calls.get(key, 0) + 1
        return original(tensor, *args, **kwargs)

    out = {}
    for name, overrides in {"classification": [], "tokens": TOKENS}.items():
        cfg = _config(*overrides, "train.global_batch_size=8", "train.micro_batch_size=2", "optim.warmup_steps=0",
                      workers=2)
        parts = _built(cfg, 6 if name == "tokens" else FEATURES)
        g = torch.Generator().manual_seed(rank)
        if name == "tokens":
            labels = torch.randint(0, 12, (2, 6), generator=g)
            labels[:, : 2 + rank] = -100  # ranks hold different token counts
            batch = [{"x": torch.randint(0, 12, (2, 6), generator=g), "labels": labels}] * 2
        else:
            batch = [{"x": torch.randn(2, FEATURES, generator=g), "labels": torch.randint(0, CLASSES, (2,))}] * 2
        calls.clear()
        dist.all_reduce = counting  # type: ignore[assignment]
        try:
            train_step(parts, batch)
        finally:
            dist.all_reduce = original
        out[name] = dict(calls)
    return out


def test_the_targets_all_reduce_runs_only_for_tokens_and_overlaps_the_forward(tmp_path: Path) -> None:
    # The remaining blocking all-reduce is the non-finite flag's (a device collective, never read back); DDP's own
    # gradient all-reduce does not go through dist.all_reduce.
    for counted in run_two_ranks(_collectives, tmp_path):
        assert counted["classification"] == {"blocking": 1}
        assert counted["tokens"] == {"async": 1, "blocking": 1}


class Event:
    """A stand-in CUDA event on a fake device clock that advances 1 ms per recorded event: records, and counts the
    waits for it."""

    clock = 0.0
    waits = 0

    def __init__(self) -> None:
        self.at: float | None = None

    def record(self) -> None:
        Event.clock += 1.0
        self.at = Event.clock

    def synchronize(self) -> None:
        Event.waits += 1

    def elapsed_time(self, end: Event) -> float:
        assert self.at is not None and end.at is not None, "read before both were recorded"
        return end.at - self.at


def test_phase_times_are_recorded_as_events_and_read_once_at_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config("train.precision=fp32", "train.global_batch_size=32", "train.micro_batch_size=8")
    parts = build_parts(cfg, FEATURES, CPU)
    synchronized: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synchronized.append(a))
    timer = PhaseTimer(CPU, events=Event)
    batch = _source(0, 8)(0)[:4]
    for _ in range(3):
        with timer.phase("data_wait"):
            pass
        train_step(parts, batch, timer)
    assert Event.waits == 0 and not synchronized and timer.seconds == {}  # nothing read during the steps
    shares = timer.shares()
    assert Event.waits == 1 and not synchronized
    # Per step: data_wait (2 events, 1 ms apart), 4 pieces of 3 events (start, forward, backward: 2 ms each), the
    # update's compute phase (2 events: 1 ms). One rank: nothing billed to sync.
    assert timer.seconds["data_wait"] == pytest.approx(3 * 0.001)
    assert timer.seconds["compute"] == pytest.approx(3 * (4 * 0.002 + 0.001))
    assert timer.seconds["sync"] == 0.0
    assert shares["time/compute_frac"] > 0
