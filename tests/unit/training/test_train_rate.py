"""The headline samples/s (the run page's first throughput chart) is training's own pace: an interval that evaluates
reads as fast as the others, while the wall-clock rate the cost ledger splits stays. The loop runs in-process on a
clock stepped by hand (each batch read 10 ms, each evaluation 1 s), so every figure is exact, whatever the machine."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_loop import Recorder, config, make_parts, xy

from orchestrator.tracking.view import headline_keys, mlflow_key
from orchestrator.training import loop, timing

BATCH_S, EVAL_S = 0.01, 1.0


def run_on_a_stepped_clock(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    now = [1000.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0], time=lambda: now[0])
    monkeypatch.setattr(loop, "time", clock)
    monkeypatch.setattr(timing, "time", clock)
    cfg = config("train.max_steps=300", "train.log_every=25", "train.eval_every=100", "checkpoint.every=300")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(320, 16, generator=g)
    y = x[:, :4].argmax(dim=1)

    def train(epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(0, 320, 32):
            now[0] += BATCH_S  # reading a batch: data wait, part of training
            yield xy(x[i:i + 32], y[i:i + 32])

    def val() -> Iterator[dict[str, torch.Tensor]]:
        now[0] += EVAL_S  # a whole validation pass
        yield xy(x[:64], y[:64])

    recorder = Recorder()
    loop.run(cfg, make_parts(cfg), loop.Data(train, val), recorder)
    return [metrics for metrics, _ in recorder.reports]


def test_the_headline_samples_per_s_is_training_pace_with_evaluation_every_100_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reports = run_on_a_stepped_clock(monkeypatch)
    assert [r["step"] for r in reports] == list(range(25, 301, 25))
    # The report's figure that the headline section charts as samples/s.
    headline = headline_keys("val_accuracy")
    name = next(n for n in reports[0] if headline.get(mlflow_key(n), "").endswith("samples_per_s"))
    rates = [r[name] for r in reports]
    assert max(rates) / min(rates) < 1.3, rates  # smooth: evaluations (steps 100, 200, 300) do not dent it
    # Exactly 25 steps x 32 samples over their 25 batch reads (the first interval's first batch was read before
    # the loop began: start-up), evaluation or not.
    assert rates[0] == pytest.approx(25 * 32 / (24 * BATCH_S))
    assert rates[1:] == pytest.approx([25 * 32 / (25 * BATCH_S)] * 11)
    # Evaluation has its own figure; the wall-clock rate (the cost ledger's, the throughput's) keeps it in.
    evaluating = [r for r in reports if "val_accuracy" in r]
    assert [r["step"] for r in evaluating] == [100, 200, 300]
    assert [r["eval_s"] for r in evaluating] == pytest.approx([EVAL_S] * 3)
    assert all("eval_s" not in r for r in reports if "val_accuracy" not in r)
    assert [r["samples_per_s"] for r in evaluating] == pytest.approx([25 * 32 / (25 * BATCH_S + EVAL_S)] * 3)
    assert sum(r["samples_per_s"] * r["interval_s"] for r in reports) == pytest.approx(300 * 32)
