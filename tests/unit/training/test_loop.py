"""The loop in-process (no Ray): accumulation equivalence, precision paths, reports, checkpoints and resume."""

from __future__ import annotations

import copy
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrator.config import Config, load_config
from orchestrator.errors import ConfigError
from orchestrator.models.zoo import build_model
from orchestrator.training.checkpoint import Progress, load_state, restore
from orchestrator.training.loop import Data, NonFiniteLossError, run
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.position import micro_batches
from orchestrator.training.precision import Precision, resolve_precision
from orchestrator.training.step import train_step

CPU = torch.device("cpu")


def make_parts(cfg: Config, mode: str = "fp32", seed: int = 0) -> Parts:
    torch.manual_seed(seed)
    model = build_model(cfg.model.name, None, 16, 4, cfg.model.kwargs)
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.train.max_steps or 1)
    return Parts(model, optimizer, scheduler, Precision(mode, CPU), CPU, cfg.optim.max_grad_norm)  # type: ignore[arg-type]


def dataset(rows: int = 256, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 16, generator=g)
    return x, (x[:, :4].argmax(dim=1))  # learnable labels


def xy(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """A batch of the classic contract: the feature vector `x` and the targets."""
    return {"x": x, "labels": y}


def batches(x: torch.Tensor, y: torch.Tensor, size: int) -> list[dict[str, torch.Tensor]]:
    return [xy(x[i:i + size], y[i:i + size]) for i in range(0, len(y) - size + 1, size)]


def config(*overrides: str) -> Config:
    base = ["scaling.num_workers=1", "train.global_batch_size=32", "model.hidden=[32]", "optim.warmup_steps=2",
            "train.max_steps=8", "train.log_every=2", "train.eval_every=4", "checkpoint.every=4"]
    return load_config(None, [*base, *overrides])


def sgd_config(*overrides: str) -> Config:
    """Plain SGD at lr 1 with a constant schedule: a step moves every parameter by exactly minus its gradient, so a
    wrong gradient scale shows in the update (one AdamW step is nearly blind to it)."""
    return config("optim.name=sgd", "optim.momentum=0", "optim.weight_decay=0", "optim.lr=1", "optim.warmup_steps=0",
                  "optim.schedule=constant", "optim.max_grad_norm=null", *overrides)


def mean_gradient(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The reference: the gradient of the mean cross-entropy over the whole batch, by autograd alone."""
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    return grads


def update(before: list[torch.Tensor], model: torch.nn.Module) -> list[torch.Tensor]:
    return [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]


@pytest.mark.parametrize("micro", [32, 8])
def test_a_step_applies_the_mean_gradient_of_the_whole_batch(micro: int) -> None:
    # 1 x 32 and 4 x 8 (accumulated under one normaliser) must both move by the batch-mean gradient.
    cfg = sgd_config()
    x, y = dataset(32)
    parts = make_parts(cfg)
    before = [p.detach().clone() for p in parts.model.parameters()]
    expected = mean_gradient(parts.model, x, y)
    train_step(parts, batches(x, y, micro))
    for moved, grad in zip(update(before, parts.model), expected, strict=True):
        torch.testing.assert_close(moved, grad, atol=1e-6, rtol=1e-5)


def test_clipping_bounds_the_update_and_reports_the_true_norm() -> None:
    cfg = sgd_config("optim.max_grad_norm=1e-3")
    parts = make_parts(cfg)
    x, y = dataset(32)
    before = [p.detach().clone() for p in parts.model.parameters()]
    true_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in mean_gradient(parts.model, x, y)]))
    norm = train_step(parts, [xy(x, y)]).grad_norm
    moved = torch.linalg.vector_norm(torch.stack([u.norm() for u in update(before, parts.model)]))
    assert float(true_norm) > 0.01  # so a missing clip would move the weights 10x further
    assert float(moved) == pytest.approx(1e-3, rel=1e-3)  # lr 1: the update is the clipped gradient
    assert float(norm) == pytest.approx(float(true_norm), rel=1e-5)  # the norm before clipping is reported


def test_bf16_autocast_runs_on_cpu_and_keeps_fp32_params() -> None:
    cfg = config()
    parts = make_parts(cfg, mode="bf16")
    x, y = dataset(64)
    with parts.precision.autocast():
        assert parts.model(x).dtype == torch.bfloat16
    loss = train_step(parts, batches(x, y, 16)).loss_sum
    assert torch.isfinite(loss)
    assert all(p.dtype == torch.float32 for p in parts.model.parameters())
    assert parts.precision.scaler is None


def test_precision_resolution() -> None:
    assert resolve_precision("fp32", CPU) == "fp32"
    assert resolve_precision("auto", CPU) in ("bf16", "fp32")
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        resolve_precision("fp16", CPU)


class Recorder:
    """The loop's reports in order: (metrics, the state of the checkpoint registered at that step, or None)."""

    def __init__(self) -> None:
        self.reports: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
        self.saved: dict[str, Any] | None = None

    def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        self.saved = load_state(checkpoint_dir) if checkpoint_dir else None  # rank 0 hands over the directory

    def publish(self, metrics: dict[str, Any]) -> None:
        self.reports.append((metrics, self.saved))
        self.saved = None


def test_run_reports_on_schedule_evaluates_and_learns() -> None:
    cfg = config("train.max_steps=40", "train.log_every=10", "train.eval_every=20", "checkpoint.every=20",
                 "optim.lr=0.01")
    parts = make_parts(cfg)
    x, y = dataset(256)
    report = Recorder()
    final = run(cfg, parts, Data(lambda epoch: batches(x, y, cfg.train.micro_batch_size), lambda: batches(x, y, 64)),
                report)
    steps = [m["step"] for m, _ in report.reports]
    assert steps == [10, 20, 30, 40]
    assert [ckpt is not None for _, ckpt in report.reports] == [False, True, False, True]
    assert "val_accuracy" in report.reports[1][0] and "val_accuracy" not in report.reports[0][0]
    assert report.reports[-1][0]["train_loss"] < report.reports[0][0]["train_loss"]
    assert final["val_accuracy"] > 0.7
    assert final["samples_seen"] == 40 * cfg.train.global_batch_size
    # Steps run across epoch boundaries: 40 x 32 rows = 5 passes over 256 rows, the last (index 4) complete.
    assert final["epoch"] == 4


def test_resume_from_mid_epoch_checkpoint_is_bitwise_exact() -> None:
    # 256 rows / 32 per step = 8 steps per epoch; the checkpoint at step 4 is mid-epoch.
    cfg = config("train.max_steps=12", "checkpoint.every=4", "model.dropout=0.2", "data.val=null")
    x, y = dataset(256)
    source = lambda epoch: batches(x, y, cfg.train.micro_batch_size)  # noqa: E731

    straight = make_parts(cfg)
    run(cfg, straight, Data(source), Recorder())

    first = make_parts(cfg)
    short = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": 4})})
    recorder = Recorder()
    run(short, first, Data(source), recorder)
    state = copy.deepcopy(recorder.reports[-1][1])
    assert state is not None and state["progress"]["rows_in_epoch"] == 128

    torch.manual_seed(123)  # a fresh process would start from other RNG state
    resumed = make_parts(cfg, seed=99)
    progress = restore(resumed, state)
    assert progress == Progress(step=4, samples_seen=128, epoch=0, rows_in_epoch=128)
    run(cfg, resumed, Data(source), Recorder(), progress)
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_non_finite_loss_stops_with_a_clear_error_and_no_checkpoint() -> None:
    cfg = config("train.max_steps=4", "train.log_every=2", "train.max_nonfinite_steps=0")
    parts = make_parts(cfg)
    x, y = dataset(64)
    x[3, 0] = float("nan")
    report = Recorder()
    with pytest.raises(NonFiniteLossError, match="lower optim.lr"):
        run(cfg, parts, Data(lambda epoch: batches(x, y, 32)), report)
    assert report.reports == []


def test_checkpoint_holds_everything_for_resume(tmp_path: Path) -> None:
    cfg = config("train.max_steps=4")
    report = Recorder()
    x, y = dataset(128)
    run(cfg, make_parts(cfg), Data(lambda epoch: batches(x, y, 32)), report)
    state = report.reports[-1][1]
    assert state is not None
    assert set(state) == {"model", "optimizer", "scheduler", "precision", "progress", "rng", "micro_batch_size"}
    assert state["micro_batch_size"] == 32
    assert not any(k.startswith("module.") for k in state["model"])
    assert state["progress"]["step"] == 4 and len(state["rng"]) == 1


def test_tiny_training_split_is_a_clear_error() -> None:
    from orchestrator.errors import UserError

    cfg = config()
    with pytest.raises(UserError, match="smaller than one micro-batch"):
        run(cfg, make_parts(cfg), Data(lambda epoch: []), Recorder())


@pytest.mark.parametrize("new_micro", [4, 16])
def test_resume_with_another_micro_batch_trains_every_row_once(new_micro: int) -> None:
    # A checkpoint after one step of 4 micro-batches of 8 (rows 0..31); auto micro-batching or --resume may run
    # the rest with another micro-batch size: the next two steps must be rows 32..95, none twice, none skipped.
    x, y = dataset(256)
    ids = torch.arange(256.0)
    x = torch.cat([x, ids[:, None]], dim=1)  # the last column names the row

    def source(micro: int) -> Any:
        return lambda epoch: batches(x, y, micro)

    old = config("train.micro_batch_size=8", "train.max_steps=1", "checkpoint.every=1", "data.val=null",
                 "optim.warmup_steps=0")
    report = Recorder()
    torch.manual_seed(0)
    model = torch.nn.Linear(17, 4)
    optimizer, scheduler = build_optimizer(model, old.optim, 3)
    run(old, Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU), Data(source(8)), report)
    state = report.reports[-1][1]
    assert state is not None

    progress = restore(Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU), copy.deepcopy(state))
    stream = micro_batches(source(new_micro), progress, CPU)
    seen = [int(i) for _ in range(64 // new_micro) for i in next(stream)["x"][:, -1]]
    assert seen == list(range(32, 96))


def test_compile_failing_after_a_resume_falls_back_to_eager_once() -> None:
    cfg = config("train.max_steps=8", "checkpoint.every=4", "data.val=null")
    x, y = dataset(256)
    short = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": 4})})
    report = Recorder()
    run(short, make_parts(cfg), Data(lambda epoch: batches(x, y, 32)), report)
    state = report.reports[-1][1]
    assert state is not None

    parts = make_parts(cfg)
    parts.eager_model = parts.model
    parts.model = torch.compile(parts.model, backend=_failing_backend)  # type: ignore[assignment]
    progress = restore(parts, state)
    resumed = Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(cfg, parts, Data(lambda epoch: batches(x, y, 32)), resumed, progress)
    assert [m["step"] for m, _ in resumed.reports] == [6, 8]
    assert sum("torch.compile failed" in str(w.message) for w in caught) == 1
    assert parts.eager_model is None and not hasattr(parts.model, "_orig_mod")
    assert resumed.reports[0][0]["compile_s"] > 0  # timed apart, not in the first interval's throughput


def _failing_backend(graph: Any, example_inputs: Any) -> Any:
    raise RuntimeError("no C compiler on this node")


def test_time_blocked_in_report_is_billed_to_an_interval() -> None:
    # Registering a checkpoint blocks (a barrier, and a poll interval in Ray's controller): the wall clock between
    # two reports is the interval, report included, so the intervals tile the run with no gap, and throughput is
    # samples over that wall clock.
    cfg = config("train.max_steps=8", "train.log_every=2", "checkpoint.every=2", "data.val=null")
    x, y = dataset(256)
    calls: list[tuple[float, dict[str, Any]]] = []

    class SlowRegistry(Recorder):
        def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
            calls.append((time.perf_counter(), metrics))
            time.sleep(0.3)

    run(cfg, make_parts(cfg), Data(lambda epoch: batches(x, y, 32)), SlowRegistry())
    for (before, _), (at, metrics) in zip(calls, calls[1:], strict=False):
        assert metrics["interval_s"] == pytest.approx(at - before, abs=0.02)
        assert metrics["time/report_frac"] == pytest.approx(0.3 / metrics["interval_s"], abs=0.05)
        assert sum(v for k, v in metrics.items() if k.startswith("time/")) == pytest.approx(1.0, abs=1e-6)
        assert metrics["samples_per_s"] == pytest.approx(2 * 32 / metrics["interval_s"])
    assert calls[0][1]["time/report_frac"] == 0.0


def test_metrics_are_published_at_every_report_step_and_only_checkpoints_wait() -> None:
    # The loop hands metrics over at every log step without a barrier; the blocking registration runs only at
    # checkpoint steps, so a slow registry costs nothing at the steps in between.
    cfg = config("train.max_steps=12", "train.log_every=2", "checkpoint.every=6", "data.val=null")
    x, y = dataset(256)
    events: list[tuple[str, int]] = []

    class Log(Recorder):
        def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
            events.append(("checkpoint", metrics["step"]))
            super().checkpoint(metrics, checkpoint_dir)

        def publish(self, metrics: dict[str, Any]) -> None:
            events.append(("publish", metrics["step"]))
            super().publish(metrics)

    log = Log()
    run(cfg, make_parts(cfg), Data(lambda epoch: batches(x, y, 32)), log)
    assert events == [("publish", 2), ("publish", 4), ("checkpoint", 6), ("publish", 6), ("publish", 8),
                      ("publish", 10), ("checkpoint", 12), ("publish", 12)]
    assert [m["step"] for m, ckpt in log.reports if ckpt is not None] == [6, 12]
    first = log.reports[0][0]
    assert first["at/loop"] <= first["at/first_batch"] <= first["at/first_step"] <= time.time()  # the marks, once
    assert all("at/loop" not in m and "at/first_step" not in m for m, _ in log.reports[1:])


def test_fp16_grad_norm_averages_the_applied_steps_and_the_scalers_skips_are_counted() -> None:
    """fp16's GradScaler skips a step whose unscaled gradient overflowed (its norm is inf/nan): the reported norm is
    the mean over the steps that were applied, and the skipped ones are counted. fp16 autocast runs on the CPU here
    (the config refuses fp16 on CPU for speed, not correctness)."""
    cfg = config("train.max_steps=8", "train.log_every=8", "checkpoint.every=8", "data.val=null",
                 "train.eval_every=null")
    x, y = dataset(256)

    def fp16_parts() -> Parts:
        parts = make_parts(cfg, mode="fp16")
        # A first loss scale so large that the fp16 backward overflows: the scaler skips steps until it backs off.
        parts.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
        return parts

    # The reference, step by step: whether each step moved the weights, and the norm it measured.
    by_hand, norms, applied = fp16_parts(), [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the LR schedule moving past a skipped optimizer step
        for batch in batches(x, y, 32)[:8]:
            before = [p.detach().clone() for p in by_hand.model.parameters()]
            norms.append(float(train_step(by_hand, [batch]).grad_norm))
            applied.append(any(not torch.equal(b, p) for b, p in zip(before, by_hand.model.parameters(),
                                                                      strict=True)))
        assert 0 < applied.count(False) < 8, applied  # some steps skipped, some applied
        report = Recorder()
        run(cfg, fp16_parts(), Data(lambda epoch: batches(x, y, 32)), report)
    metrics = report.reports[-1][0]
    assert metrics["grad_norm"] == pytest.approx(sum(n for n, a in zip(norms, applied, strict=True) if a)
                                                 / applied.count(True), rel=1e-6)
    assert metrics["skipped_steps"] == applied.count(False)
    assert metrics["nonfinite_skipped"] == 0  # the scaler's skips are not non-finite losses
