"""Efficiency features in-process: auto micro-batch, OOM retry, compile, time breakdown, MFU, GPT."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from test_loop import Recorder, xy

from orchestrator.config import load_config
from orchestrator.errors import ConfigError, UserError
from orchestrator.models.tasks import CausalLM, Classification
from orchestrator.models.zoo import GPT
from orchestrator.training.loop import Data, run
from orchestrator.training.memory import (
    activation_bytes_per_sample,
    divisors_descending,
    fit_micro_batch_cpu,
    fit_micro_batch_cuda,
    state_bytes,
)
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision
from orchestrator.training.step import train_step
from orchestrator.training.timing import PhaseTimer, peak_flops

CPU = torch.device("cpu")


def parts_for(model: torch.nn.Module, *overrides: str) -> Parts:
    cfg = load_config(None, ["scaling.num_workers=1", "optim.max_grad_norm=null", *overrides])
    optimizer, scheduler = build_optimizer(model, cfg.optim, 100)
    return Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU, cfg.optim.max_grad_norm)


def test_auto_micro_batch_fits_a_known_footprint_and_keeps_the_global_batch() -> None:
    # Linear(64 -> 1000) + cross-entropy keeps per sample: the input (64 floats), the log-softmax (1000 floats)
    # and the target (one int64) = 4264 bytes; weights + grads + 2 AdamW slots = 4 x 65,000 params x 4 bytes.
    model = torch.nn.Linear(64, 1000)
    x, y = torch.rand(8, 64), torch.randint(0, 1000, (8,))
    per_sample = activation_bytes_per_sample(
        model, 8, lambda: Classification().loss_sum(model(x), {"labels": y}))
    assert per_sample == pytest.approx(4264, rel=0.05)
    state = state_bytes(model, optimizer_slots=2)
    assert state == 65_000 * 4 * 4
    budget = state + 300 * 4264  # room for ~300 samples
    per_worker = 1024
    micro = fit_micro_batch_cpu(per_worker, state, per_sample, budget)
    assert micro == 256  # the largest divisor of 1024 that fits
    assert micro * (per_worker // micro) == per_worker  # accumulation keeps the global batch exactly
    with pytest.raises(ConfigError, match="raise the budget"):
        fit_micro_batch_cpu(per_worker, state, per_sample, state / 2)


def test_cuda_probe_logic_finds_the_largest_fitting_divisor() -> None:
    tried = []

    def try_step(size: int) -> None:
        tried.append(size)
        if size > 40:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert fit_micro_batch_cuda(96, try_step, CPU) == 32
    assert tried[0] == 1 and max(tried) <= 96
    assert divisors_descending(12) == [12, 6, 4, 3, 2, 1]

    def broken(size: int) -> None:
        raise ValueError("not an OOM")

    with pytest.raises(ValueError):
        fit_micro_batch_cuda(8, broken, CPU)


class OomAbove(torch.nn.Module):
    """Raises an out-of-memory error for batches larger than `limit`, like a GPU that is full."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(x) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return self.net(x)


def test_oom_retry_gives_the_same_weights_as_an_uninterrupted_step() -> None:
    g = torch.Generator().manual_seed(0)
    micro = [xy(torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(2)]
    reference, retried = parts_for(OomAbove(limit=1000)), parts_for(OomAbove(limit=8))
    train_step(reference, micro)
    with pytest.warns(UserWarning, match="out of memory: retrying"):
        train_step(retried, micro)
    assert (retried.state.split, retried.state.oom_retries) == (2, 1)
    for a, b in zip(reference.model.parameters(), retried.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


class OomAlways(OomAbove):
    """A model that never fits: even one row runs out of memory. Counts its calls so a retry loop that never gives
    up is stopped by the test (with a distinct error) instead of hanging it."""

    def __init__(self) -> None:
        super().__init__(limit=0)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 50:
            raise RuntimeError("still retrying after 50 forwards")
        return super().forward(x)


def test_an_oom_with_one_row_pieces_fails_in_one_line_instead_of_retrying_forever() -> None:
    g = torch.Generator().manual_seed(0)
    micro = [xy(torch.randn(4, 16, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(2)]
    parts = parts_for(OomAlways())
    with pytest.warns(UserWarning, match="out of memory: retrying"), pytest.raises(UserError) as raised:
        train_step(parts, micro)
    message = str(raised.value)
    assert "a micro-batch of 1 row" in message and "\n" not in message
    assert "train.precision" in message  # what to change
    # 4-row micro-batches: retried at 2 rows and at 1 row, then no smaller piece exists.
    assert (parts.state.split, parts.state.oom_retries) == (4, 2)


def run_digits_like(*overrides: str, delay: float = 0.0, model: torch.nn.Module | None = None,
                    eager: torch.nn.Module | None = None) -> list[dict[str, Any]]:
    cfg = load_config(None, ["scaling.num_workers=1", "train.global_batch_size=32", "train.max_steps=20",
                             "train.log_every=10", "train.eval_every=20", "checkpoint.every=20",
                             "train.precision=fp32", "optim.warmup_steps=5", *overrides])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=g)
    y = x[:, :4].argmax(dim=1)
    torch.manual_seed(0)
    if model is None:
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    parts = parts_for(model, *overrides)
    parts.eager_model = eager

    def batches(epoch: int) -> Any:
        for i in range(0, 256, 32):
            time.sleep(delay)  # a slow reader
            yield xy(x[i:i + 32], y[i:i + 32])

    recorder = Recorder()
    run(cfg, parts, Data(batches, lambda: [xy(x, y)]), recorder)
    return [metrics for metrics, _ in recorder.reports]


def test_time_breakdown_adds_up_and_data_wait_rises_with_a_slow_reader() -> None:
    fast = run_digits_like()
    slow = run_digits_like(delay=0.1)
    for metrics in (fast[-1], slow[-1]):
        shares = [v for k, v in metrics.items() if k.startswith("time/")]
        assert sum(shares) == pytest.approx(1.0, abs=1e-6)
        assert metrics["time/compute_frac"] > 0 and metrics["time/eval_frac"] > 0
        assert metrics["data_wait_frac"] == metrics["time/data_wait_frac"]
    # The last interval (steps 11-20) waited for 10 batches, each after the reader's time.sleep(0.1), which sleeps
    # at least that long: at least 1 s of it is data wait, however slowly the rest ran on a loaded machine (a share
    # of the interval is not: compute stretches under load too). Share x interval seconds is the data wait, up to
    # the microseconds between the two readings of the clock, which only add to it.
    data_wait_s = slow[-1]["time/data_wait_frac"] * slow[-1]["interval_s"]
    assert data_wait_s >= 10 * 0.1, (data_wait_s, slow[-1]["interval_s"])
    assert data_wait_s <= slow[-1]["interval_s"]
    # Counted, not estimated: forward 2 x (16x64 + 64x4); backward 2 x 2 x 64x4 for the last layer but only the
    # weight gradient (2 x 16x64) for the first, whose input needs no gradient.
    assert fast[0]["flops_per_sample"] == 2 * (16 * 64 + 64 * 4) + 4 * 64 * 4 + 2 * 16 * 64
    assert "mfu" not in fast[0]  # no known peak for a CPU
    assert any(k.startswith("system/") and k.endswith("/cpu_percent") for k in fast[0])


def test_mfu_with_a_configured_peak() -> None:
    metrics = run_digits_like("train.peak_tflops=0.001")[-1]
    expected = metrics["flops_per_sample"] * metrics["samples_per_s"] / 1e9
    assert metrics["mfu"] == pytest.approx(expected)
    assert peak_flops(CPU, 2.0) == 2e12 and peak_flops(CPU, None) is None


def test_phase_timer_bills_time_to_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from orchestrator.training import timing

    # The timer's own clock, stepped by hand: exact seconds, whatever the scheduler does meanwhile.
    now = [100.0]
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    timer = PhaseTimer(CPU)  # the interval starts at 100
    now[0] = 101.0
    with timer.phase("eval"):
        now[0] = 104.0  # 3 s of eval
    with timer.phase("data_wait"):
        now[0] = 105.0  # 1 s waiting for data
    with timer.phase("eval"):
        now[0] = 106.0  # 1 s more eval: phases accumulate
    timer.add("compute", 2.0)  # measured elsewhere (train_step's per-piece timing)
    now[0] = 110.0
    assert dict(timer.seconds) == {"eval": 4.0, "data_wait": 1.0, "compute": 2.0}
    shares = timer.shares()  # of the 10 s since the timer started, not of the time billed to phases
    assert shares["time/eval_frac"] == pytest.approx(0.4) and shares["time/data_wait_frac"] == pytest.approx(0.1)
    assert shares["time/compute_frac"] == pytest.approx(0.2) and shares["time/other_frac"] == pytest.approx(0.3)
    assert sum(shares.values()) == pytest.approx(1.0)


@pytest.mark.slow
def test_compile_on_and_off_both_train() -> None:
    eager = run_digits_like()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    compiled = run_digits_like(model=torch.compile(net), eager=net)
    assert compiled[0]["compile_s"] > 0 and "compile_s" not in eager[0]
    assert compiled[-1]["train_loss"] < compiled[0]["train_loss"]
    assert compiled[-1]["val_accuracy"] == pytest.approx(eager[-1]["val_accuracy"], abs=0.05)


class NotCompilable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_a_model_that_fails_to_compile_falls_back_to_eager() -> None:
    net = NotCompilable()
    compiled = torch.compile(net, backend=failing_backend)
    with pytest.warns(UserWarning, match="torch.compile failed .* continuing in eager mode"):
        metrics = run_digits_like(model=compiled, eager=net)
    assert metrics[-1]["step"] == 20 and metrics[-1]["train_loss"] < metrics[0]["train_loss"]


def test_the_compile_probe_leaves_the_first_step_as_an_eager_one() -> None:
    # The probe's forward runs in training mode: BatchNorm's running statistics would move twice, and a resumed run
    # (which probes again) would no longer match an uninterrupted one. Weights and buffers equal an eager step's.
    from orchestrator.training.step import first_compiled_step

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                   torch.nn.Linear(32, 4))

    g = torch.Generator().manual_seed(0)
    micro = [xy(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(2)]
    eager = parts_for(model())
    train_step(eager, micro)
    net = model()
    compiled = parts_for(torch.compile(net, backend="eager"))
    compiled.eager_model = net
    first_compiled_step(compiled, micro)
    for a, b in zip(eager.model.state_dict().values(), net.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def failing_backend(graph: Any, example_inputs: Any) -> Any:
    raise RuntimeError("this backend cannot compile anything")


def test_gpt_learns_a_repeating_byte_sequence() -> None:
    torch.manual_seed(0)
    model = GPT(in_features=16, num_classes=256, d_model=32, n_layer=1, n_head=2)
    parts = parts_for(model, "optim.lr=0.01", "optim.warmup_steps=0")
    parts.task = CausalLM()
    text = torch.tensor(list(b"abcdefgh" * 40))
    windows = text.unfold(0, 17, 8)  # (B, 17): inputs and next-token targets
    x, y = windows[:, :-1], windows[:, 1:]
    first = float(train_step(parts, [xy(x, y)]).loss_sum) / y.numel()
    for _ in range(30):
        last = float(train_step(parts, [xy(x, y)]).loss_sum) / y.numel()
    assert last < first / 3


def test_auto_micro_batch_resumes_with_the_checkpoints_size_at_the_same_world_size() -> None:
    from orchestrator.training.micro_batch import checkpoint_micro_batch

    state = {"micro_batch_size": 8, "rng": [{}, {}]}  # written by a 2-worker group
    assert checkpoint_micro_batch(state, per_worker=32, world=2) == 8
    assert checkpoint_micro_batch(state, per_worker=64, world=1) is None  # resized: measure again
    assert checkpoint_micro_batch(state, per_worker=12, world=2) is None  # 8 does not divide the batch
    assert checkpoint_micro_batch(None, per_worker=32, world=2) is None


FLUSH_CHECK = """
import sys, threading, torch
from orchestrator.training.precision import flush_denormals
torch.set_num_threads(2)
out = {}
def train_thread():  # Ray Train runs the training function in a thread of its own, as here
    out["supported"] = flush_denormals(sys.argv[1] == "on")
    # Large enough to run on both intra-op threads, which this thread starts here.
    out["zeros"] = bool((torch.full((1 << 18,), 1e-39) * 3.0 == 0).all())
t = threading.Thread(target=train_thread)
t.start(); t.join()
print(out["supported"], out["zeros"])
"""


@pytest.mark.parametrize("setting", ["on", "off"])
def test_flush_denormals_reaches_the_intra_op_threads_of_the_training_thread(setting: str) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FLUSH_CHECK, setting], capture_output=True, text=True, check=True)
    supported, zeros = done.stdout.split()
    if supported != "True":
        pytest.skip("this CPU cannot flush subnormal floats")
    # Off: 3e-39 is a subnormal float32, kept as such. On: flushed to zero on every thread that computed a part.
    assert zeros == ("True" if setting == "on" else "False")
