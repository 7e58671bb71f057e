"""CUDA code paths: fp16 + GradScaler, auto micro-batch probing, memory statistics, OOM recovery.
Skipped without a CUDA device (see tests/conftest.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from reads import HostReads
from test_loop import Recorder, xy

from orchestrator.config import load_config
from orchestrator.models.tasks import CausalLM
from orchestrator.models.zoo import GPT, mlp
from orchestrator.training.evaluation import evaluate
from orchestrator.training.loop import Data, run
from orchestrator.training.memory import GIB, cuda_memory_stats, fit_micro_batch_cuda, restart_peak, under_pressure
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts, build_parts
from orchestrator.training.precision import Precision, resolve_precision
from orchestrator.training.step import train_step

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def cuda_parts(model: torch.nn.Module, mode: str) -> Parts:
    cfg = load_config(None, ["scaling.num_workers=1", "scaling.use_gpu=true"])
    model = model.to(CUDA)
    optimizer, scheduler = build_optimizer(model, cfg.optim, 100)
    return Parts(model, optimizer, scheduler, Precision(mode, CUDA), CUDA, 1.0)  # type: ignore[arg-type]


def test_fp16_uses_a_grad_scaler_and_counts_skipped_steps() -> None:
    parts = cuda_parts(mlp(16, 4, hidden=[32]), "fp16")
    assert parts.precision.scaler is not None and parts.optimizer.defaults.get("fused")
    # A first loss scale so large that the fp16 backward overflows while the loss itself is finite: the scaler
    # skips the update (inside the fused kernel) and lowers its scale, read nowhere but here.
    parts.precision.scaler = torch.amp.GradScaler("cuda", init_scale=2.0**40)
    x, y = torch.randn(64, 16, device=CUDA), torch.randint(0, 4, (64,), device=CUDA)
    before = [p.detach().clone() for p in parts.model.parameters()]
    result = train_step(parts, [xy(x, y)])
    assert torch.isfinite(result.loss_sum) and float(result.overflowed) == 1.0 and float(result.skipped) == 0.0
    assert parts.precision.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, parts.model.parameters(), strict=True))
    for _ in range(40):  # the scale backs off until the steps apply
        train_step(parts, [xy(x, y)])
    assert not all(torch.equal(a, b) for a, b in zip(before, parts.model.parameters(), strict=True))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_gpt_trains_between_reports_without_a_single_device_sync(precision: str) -> None:
    """torch raises on any synchronisation in the steps between reports (set_sync_debug_mode("error")), every value
    read back from the device is counted, and so is every blocking CUDA runtime call the profiler records (what the
    sync debug mode misses: torch.cuda.synchronize, Event.synchronize, a synchronous cudaMemcpy): none in the steps,
    a few at each report. The CPU twin: test_step_waits.py's first test."""
    cfg = load_config(None, [
        "scaling.num_workers=1", "scaling.use_gpu=true", "model.name=gpt", "model.d_model=64", "model.n_layer=2",
        "model.n_head=2", "data.label=null", "task.name=causal_lm", "model.num_classes=128",
        f"train.precision={precision}", "train.global_batch_size=16", "train.micro_batch_size=8",
        "train.max_steps=40", "train.log_every=10", "data.val=null", "train.eval_every=null",
        "optim.warmup_steps=2"])
    parts = build_parts(cfg, 32, CUDA)
    tokens = torch.randint(0, 128, (640, 33))
    x, y = tokens[:, :-1].contiguous().pin_memory(), tokens[:, 1:].contiguous().pin_memory()  # as RankBatches
    report = Recorder()
    with HostReads(sync_debug=True, profile=True).around_loop() as reads:
        run(cfg, parts, Data(lambda epoch: [{"x": x[i:i + 8], "labels": y[i:i + 8]} for i in range(0, 640, 8)]),
            report)
    assert reads.steps == 40 and len(report.reports) == 4
    assert reads.counts.get("step", 0) == 0 and reads.syncs.get("step", 0) == 0, (reads.counts, reads.syncs)
    assert not {k: n for k, n in reads.waits.items() if k[0] == "step"}, reads.waits
    assert sum(n for (where, name), n in reads.waits.items() if where == "report" and name.startswith("cuda")), \
        reads.waits  # the reports' reads wait for the device: the counter sees CUDA's waits
    assert all(math.isfinite(m["train_loss"]) for m, _ in report.reports)
    assert report.reports[-1][0]["time/compute_frac"] > 0  # the phases, timed by events read at the report


def test_an_out_of_memory_error_from_a_real_allocation_is_retried_with_smaller_pieces() -> None:
    class Hungry(torch.nn.Module):
        """Asks for twice the device's memory when a forward gets more than 4 rows."""

        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(16, 4, hidden=[32])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if len(x) > 4:
                torch.empty(2 * torch.cuda.get_device_properties(x.device).total_memory, dtype=torch.uint8,
                            device=x.device)
            return self.net(x)

    parts = cuda_parts(Hungry(), "bf16")
    x, y = torch.randn(8, 16, device=CUDA), torch.randint(0, 4, (8,), device=CUDA)
    with pytest.warns(UserWarning, match="out of memory: retrying the step"):
        result = train_step(parts, [xy(x, y)])
    assert (parts.state.split, parts.state.oom_retries) == (2, 1) and torch.isfinite(result.loss_sum)


def test_an_evaluation_keeps_the_cache_and_an_out_of_memory_step_still_empties_it() -> None:
    """With plenty of the device free, the blocks cached before an evaluation are still cached after it (the next
    steps reuse them, no cudaMalloc); after an out-of-memory error the step hands the cache back before retrying.
    The error is raised by the model, not by the allocator, whose own retry would empty the cache first."""
    parts = cuda_parts(mlp(16, 4, hidden=[32]), "bf16")
    x, y = torch.randn(64, 16, device=CUDA), torch.randint(0, 4, (64,), device=CUDA)
    train_step(parts, [xy(x, y)])
    evaluate(parts, [xy(x, y)])  # its own blocks cached once
    cached = 256 * 1024**2
    torch.empty(cached, dtype=torch.uint8, device=CUDA)  # freed at once: 256 MiB cached, unused
    reserved = torch.cuda.memory_reserved(CUDA)
    assert not under_pressure(*torch.cuda.mem_get_info(CUDA)), "the test needs a device mostly free"
    evaluate(parts, [xy(x, y)])
    assert torch.cuda.memory_reserved(CUDA) >= reserved

    forward, failed = parts.model.forward, []

    def fails_once(batch: torch.Tensor) -> torch.Tensor:
        if len(batch) > 8 and not failed:
            failed.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(batch)

    parts.model.forward = fails_once  # type: ignore[method-assign]
    with pytest.warns(UserWarning, match="out of memory: retrying the step"):
        train_step(parts, [xy(x, y)])
    assert parts.state.oom_retries == 1 and torch.cuda.memory_reserved(CUDA) < reserved - cached // 2


def test_auto_precision_prefers_bf16_on_cuda() -> None:
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    assert resolve_precision("auto", CUDA) == expected


def test_probe_finds_a_micro_batch_and_memory_stats_are_logged() -> None:
    model = GPT(256, 256, d_model=256, n_layer=2, n_head=4).to(CUDA)
    optimizer = torch.optim.AdamW(model.parameters())

    def try_step(size: int) -> None:
        tokens = torch.randint(0, 256, (size, 257), device=CUDA)
        CausalLM().loss_sum(model(tokens[:, :-1]), {"labels": tokens[:, 1:]}).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    assert fit_micro_batch_cuda(64, try_step, CUDA) == 64  # a small model: the whole batch fits
    stats = cuda_memory_stats(CUDA)
    assert stats["memory/reserved_gb"] >= stats["memory/allocated_gb"] >= 0
    assert stats["memory/reserved_unused_gb"] == pytest.approx(
        stats["memory/reserved_gb"] - stats["memory/allocated_gb"])


def test_a_reports_peak_covers_a_candidate_the_autopilot_measured_in_its_interval() -> None:
    """The autopilot starts each candidate's peak afresh (restart_peak, as Autopilot._open does): the candidate
    reads its own, and the report's memory/peak_allocated_gb still covers the interval's earlier candidates."""
    cuda_memory_stats(CUDA)  # a report: the interval starts
    big = 512 * 1024**2
    torch.empty(big, dtype=torch.uint8, device=CUDA)  # a candidate's step: allocated, then freed
    restart_peak(CUDA)
    torch.empty(1024**2, dtype=torch.uint8, device=CUDA)  # the next candidate's
    assert torch.cuda.max_memory_allocated(CUDA) < torch.cuda.memory_allocated(CUDA) + big // 2
    assert cuda_memory_stats(CUDA)["memory/peak_allocated_gb"] * GIB >= big


def test_a_search_steps_clock_starts_once_the_device_has_passed_the_ranks_meeting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under NCCL the meeting all-reduce returns before it completes: each timed search step waits for the device
    right after it (and at its end), never the run's own steps. Recorded in order on one GPU."""
    from orchestrator.training import autopilot, ranks

    order: list[str] = []
    meet, synchronize = ranks.meet, torch.cuda.synchronize
    monkeypatch.setattr(autopilot.ranks, "meet", lambda device: (order.append("meet"), meet(device))[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (order.append("sync"), synchronize(*a))[1])
    cfg = load_config(None, ["scaling.num_workers=1", "scaling.use_gpu=true", "model.hidden=[64]",
                             "model.num_classes=4", "train.global_batch_size=64", "train.micro_batch_size=8",
                             "train.max_steps=200", "train.log_every=50", "data.val=null", "train.eval_every=null",
                             "autopilot.enabled=true", "autopilot.budget=0.2", "optim.warmup_steps=2"])
    parts = build_parts(cfg, 16, CUDA)
    x, y = torch.randn(512, 16).pin_memory(), torch.randint(0, 4, (512,)).pin_memory()
    run(cfg, parts, Data(lambda epoch: [xy(x[i:i + 8], y[i:i + 8]) for i in range(0, 512, 8)]), Recorder())
    meetings = [i for i, what in enumerate(order) if what == "meet"]
    assert meetings and all(order[i + 1] == "sync" for i in meetings), order[:20]


@pytest.mark.parametrize("padded", [True, False])
def test_every_host_micro_batch_is_pinned_and_its_copy_does_not_wait_for_the_device(padded: bool) -> None:
    """A GPU rank's micro-batches, as RankBatches hands them to the loop's copy (trimmed views, batches across two
    chunks, a replayed pass, validation), are pinned and contiguous; so their non_blocking copies are queued behind
    a long kernel without the host waiting for it (from pageable memory each copy would wait for the kernel)."""
    import numpy as np

    pa = pytest.importorskip("pyarrow", reason="a bare GPU machine has no Arrow: run under the full .venv")
    from pipelines.feed import RankBatches, RankOrder
    from pipelines.tensors import pinned, to_device

    rng = np.random.default_rng(0)
    if padded:
        tokens = [list(rng.integers(1, 50, n)) for n in rng.integers(2, 30, 300)]
        table = pa.table({"tokens": pa.array(tokens, pa.list_(pa.int64()))})
        columns = ["data.features=[tokens]", "data.label=null"]
    else:
        features = pa.FixedSizeListArray.from_arrays(rng.normal(size=300 * 4).astype(np.float32), 4)
        table = pa.table({"features": features, "label": rng.integers(0, 3, 300)})
        columns = ["data.features=[features]"]

    class Shard:  # Ray Data's iter_torch_batches: collated chunks of 37 rows, pinned when asked
        def iter_torch_batches(self, *, collate_fn: Any, pin_memory: bool = False, **_: Any) -> Any:
            for start in range(0, table.num_rows, 37):
                chunk = collate_fn(table.slice(start, 37))
                yield pinned(chunk) if pin_memory else chunk

    data = load_config(None, columns).data
    batches = RankBatches(data, Shard(), Shard(), 8, RankOrder(seed=0, rank=0, replay=True), named=padded,
                          schema=table.schema, pin_memory=True)
    handed = [b for epoch in range(2) for b in batches.train(epoch)] + list(batches.val())
    assert all(v.is_pinned() and v.is_contiguous() for b in handed for v in b.values())
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of one busy kernel
    slept = torch.cuda.Event()
    slept.record()
    copies = [to_device(b, CUDA) for b in handed]
    assert not slept.query()  # the host queued every copy while the kernel still ran
    torch.cuda.synchronize()
    assert all(torch.equal(c[k].cpu(), b[k]) for b, c in zip(handed, copies, strict=True) for k in b)


def test_a_reshuffled_replay_never_rewrites_rows_a_queued_copy_has_yet_to_read() -> None:
    """Epochs of two micro-batches, each copy queued behind a busy kernel: the host runs epochs ahead of the device,
    and a pinned buffer's turn comes again (two epochs on) while copies from it may still be queued. The replay
    waits for them (the event it recorded when they were all queued): every copy holds the rows its batch held
    when it was handed out."""
    from pipelines.batches import EpochReplay
    from pipelines.tensors import pinned, to_device

    rows = pinned({"x": torch.arange(8.0).unsqueeze(1), "labels": torch.arange(8)})
    replay = EpochReplay(keep=True, reshuffle=lambda epoch: epoch, micro=4, pin=True)
    handed, copies = [], []
    torch.cuda.synchronize()
    for epoch in range(8):
        for batch in replay(lambda: [rows], epoch):
            assert all(value.is_pinned() for value in batch.values())
            torch.cuda._sleep(20_000_000)  # about 10 ms of one busy kernel before each copy
            handed.append({key: value.clone() for key, value in batch.items()})
            copies.append(to_device(batch, CUDA))
    torch.cuda.synchronize()
    orders = [torch.cat([h["labels"] for h in handed[i:i + 2]]).tolist() for i in range(0, len(handed), 2)]
    assert all(sorted(order) == list(range(8)) for order in orders) and orders[1] != orders[2]  # reshuffled
    assert all(torch.equal(c[k].cpu(), h[k]) for h, c in zip(handed, copies, strict=True) for k in h)
