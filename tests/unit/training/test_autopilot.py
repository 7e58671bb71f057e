"""The autopilot (training/autopilot.py) in-process and on two gloo ranks: its measured steps are real steps (the final
weights equal a run configured with the chosen settings from the start, up to the float tolerance of another
micro-batch split), every rank makes the one choice and counts the slowest rank's time, a candidate out of memory on
one rank is dropped on all, the budget is kept against a slow candidate, and a resume applies the saved choice
without searching.

No test here times the machine (its speed and load are bench/'s to measure): the autopilot's clock is a ModelClock
that moves only by the costs the test models (a forward's fixed cost and its rows', a slow candidate's extra second,
a slow rank's extra step time, a wait for data), so every figure the search measures, and what it chooses, follows
from the model."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo import run_two_ranks
from test_loop import Recorder
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from orchestrator.config import Config, load_config
from orchestrator.training import autopilot
from orchestrator.training.checkpoint import Progress, load_state, restore
from orchestrator.training.knobs import Knobs
from orchestrator.training.loop import Data, run
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision, cpu_supports_bf16
from orchestrator.training.step import train_step
from pipelines.batches import split_batches

CPU = torch.device("cpu")
ROWS = 2048  # 32 steps of 64 rows per epoch
# The modelled cost of a forward: a fixed part (as a kernel launch's), which makes fewer, larger forwards cheaper,
# and a part per row. Powers of two: the clock's sums of them are exact.
FORWARD_S, ROW_S = 2.0**-10, 2.0**-14


def _step_s(micro: int, rows: int = 64) -> float:
    """The modelled seconds of a step of `rows` rows per rank in forwards of `micro` rows."""
    return rows // micro * FORWARD_S + rows * ROW_S


class ModelClock:
    """The autopilot's clock in these tests (`autopilot.time`): it stands still but for the costs the test spends
    on it. On two ranks each has its own, and a collective a rank waits in for the other (the autopilot's meeting
    before a step, DDP's gradient all-reduce: see `_meeting_ddp`) leaves both at the later one's time, as a real
    clock would find them."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds

    def meet(self) -> None:
        if autopilot.ranks.world()[1] > 1:
            latest = torch.tensor([self.now], dtype=torch.float64)
            dist.all_reduce(latest, op=dist.ReduceOp.MAX)
            self.now = float(latest.item())


def _spend(seconds: float) -> None:
    autopilot.time.spend(seconds)  # type: ignore[attr-defined]


@contextmanager
def modelled_clock() -> Iterator[ModelClock]:
    """A ModelClock as the autopilot's clock, its meeting before a step a meeting of the ranks' clocks too; both
    put back after."""
    clock, real_time, real_meet = ModelClock(), autopilot.time, autopilot.ranks.meet

    def meet(device: torch.device) -> None:
        real_meet(device)
        clock.meet()

    autopilot.time, autopilot.ranks.meet = clock, meet  # type: ignore[assignment]
    try:
        yield clock
    finally:
        autopilot.time, autopilot.ranks.meet = real_time, real_meet  # type: ignore[assignment]


@pytest.fixture(autouse=True)
def model_clock() -> Iterator[ModelClock]:
    """Every test in-process on a modelled clock (each rank of a two-rank group installs its own)."""
    with modelled_clock() as clock:
        yield clock


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread (a one-CPU worker's) and flushing on, as every test of this process expects afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)


def _config(*overrides: str) -> Config:
    return load_config(None, ["scaling.num_workers=1", "train.global_batch_size=64", "train.micro_batch_size=4",
                              "model.hidden=[32]", "train.precision=fp32", "train.max_steps=300", "train.log_every=50",
                              "checkpoint.every=100", "train.eval_every=null", "data.val=null",
                              "optim.warmup_steps=10", "autopilot.enabled=true", "autopilot.budget=0.2", *overrides])


class Net(torch.nn.Module):
    """The MLP of the tests. `oom_above`: rows per forward past which it raises CUDA's out-of-memory error. Each
    forward spends its modelled cost on the clock (FORWARD_S, ROW_S a row: `_step_s`)."""

    def __init__(self, oom_above: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.oom_above = oom_above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.oom_above is not None and len(x) > self.oom_above:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        _spend(FORWARD_S + ROW_S * len(x))
        return self.net(x)


def _meeting_ddp(model: torch.nn.Module) -> DistributedDataParallel:
    """DDP whose gradient all-reduce is a meeting of the ranks' clocks too: a rank that reached it first waits
    there for the other."""
    ddp = DistributedDataParallel(model)

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none (future strings)
        autopilot.time.meet()  # type: ignore[attr-defined]
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    ddp.register_comm_hook(None, hook)
    return ddp


def _parts(cfg: Config, model: torch.nn.Module) -> Parts:
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.train.max_steps or 1)
    return Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU, cfg.optim.max_grad_norm)


def _source(rank: int, micro: int) -> Any:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own rows, as a sharded dataset gives
    x = torch.randn(ROWS, 16, generator=g)
    y = x[:, :4].argmax(dim=1)
    return lambda epoch: [{"x": x[i:i + micro], "labels": y[i:i + micro]} for i in range(0, ROWS, micro)]


class Resizable:
    """A rank's training data as RankBatches cuts it: one pass of chunks cut into micro-batches of the size
    `resize` last set (the autopilot's choice, from the next micro-batch on); records the size of each it serves."""

    def __init__(self, rank: int, micro: int) -> None:
        self.micro, self.served = micro, []
        self.epochs = _source(rank, 256)  # chunks of 256 rows, the fetch size of this small micro-batch

    def __call__(self, epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        for batch in split_batches(self.epochs(epoch), lambda: self.micro, drop_last=True):
            self.served.append(len(batch["x"]))
            yield batch

    def resize(self, micro: int) -> None:
        self.micro = micro


WAIT_S = 0.1  # a slow read's wait before a step (`_waiting`)


def _waiting(rank: int, micro: int, wait_s: float = WAIT_S, steps: int = 20) -> Any:
    """A rank's data that makes it wait `wait_s` (on its clock) before each of its first `steps` steps (8
    micro-batches each), as a slow read does: under DDP the other rank's step then waits for it in the first
    collective they meet at (the autopilot's meeting, else the gradient all-reduce)."""
    source = _source(rank, micro)

    def epochs(epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        for i, batch in enumerate(source(epoch)):
            if epoch == 0 and i % 8 == 0 and i < 8 * steps:
                _spend(wait_s)
            yield batch

    return epochs


def _chosen_config(cfg: Config, chosen: dict[str, Any]) -> Config:
    """The run configured with the chosen settings from the start (autopilot off)."""
    return _config(*_overrides(cfg), "autopilot.enabled=false", f"train.micro_batch_size={chosen['micro_batch_size']}",
                   f"train.flush_denormal={str(chosen['flush_denormal']).lower()}",
                   f"train.torch_threads={chosen['torch_threads']}")


def _overrides(cfg: Config) -> list[str]:
    return [f"train.max_steps={cfg.train.max_steps}", f"scaling.num_workers={cfg.scaling.num_workers}",
            f"autopilot.budget={cfg.autopilot.budget}", f"train.flush_denormal={str(cfg.train.flush_denormal).lower()}"]


def _train(cfg: Config, model: torch.nn.Module, rank: int = 0, progress: Progress | None = None,
           recorder: Recorder | None = None, data: Any = None) -> tuple[Parts, Recorder]:
    parts, recorder = _parts(cfg, model), recorder or Recorder()
    if cfg.train.torch_threads:  # what the worker's set-up does (worker.rank_config)
        torch.set_num_threads(cfg.train.torch_threads)
    torch.set_flush_denormal(cfg.train.flush_denormal)
    source = data or _source(rank, cfg.train.micro_batch_size)  # type: ignore[arg-type]
    run(cfg, parts, Data(source, resize=getattr(data, "resize", None)), recorder, progress)
    return parts, recorder


def _table(recorder: Recorder) -> dict[str, Any]:
    tables = [m["autopilot"] for m, _ in recorder.reports if "autopilot" in m]
    assert len(tables) == 1, "exactly one report carries the autopilot's table"
    return tables[0]


def _weights(parts: Parts) -> list[torch.Tensor]:
    return [p.detach().clone() for p in parts.model.parameters()]


def test_an_autopilot_run_ends_with_the_weights_of_its_choice_configured_from_the_start() -> None:
    cfg = _config("train.max_steps=200", "train.flush_denormal=false")  # flushing is a candidate only from off
    data = Resizable(0, 4)  # the data cut at the choice once it is made, as a worker's RankBatches is
    piloted, recorder = _train(cfg, Net(), data=data)
    table = _table(recorder)
    chosen = table["chosen"]
    # Every step after the search takes whole micro-batches of the chosen size: nothing joined or cut in the step.
    searched = table["search_steps"] + 1  # the first step, then the search's
    after = data.served[searched * 16:]
    assert after and set(after) == {chosen["micro_batch_size"]}, (chosen, data.served[searched * 16 - 2:][:4])
    # Micro-batch 4 of 64 is a deliberately poor start: each forward's fixed cost makes every larger one cheaper, the
    # whole batch in one forward cheapest; the threads and flushing cost nothing in the model, so they stay.
    assert chosen["micro_batch_size"] == 64, table
    assert table["predicted_speedup"] == pytest.approx(_step_s(4) / _step_s(64), rel=1e-12)
    # Every figure in the table is the modelled cost of its step.
    measured = [r for r in table["rows"] if r["status"] == "ok"]
    assert len(measured) > 1 and all(
        r["samples_per_s"] == pytest.approx(64 / _step_s(r["settings"]["micro_batch_size"]), rel=1e-12)
        for r in measured), table
    assert [r["chosen"] for r in table["rows"]].count(True) == 1
    # No candidate costs more than the best it is measured against: the search ends within its budget.
    assert table["search_steps"] > 0 and 0 < table["budget_spent_s"] <= table["budget_s"]
    later = [m["micro_batch_size"] for m, _ in recorder.reports if m["step"] > table["search_steps"] + 1]
    assert later and set(later) == {chosen["micro_batch_size"]}  # the rest of the run trains with the choice
    direct, _ = _train(_chosen_config(cfg, chosen), Net())
    start, _ = _train(_config(*_overrides(cfg), "autopilot.enabled=false"), Net())
    # The float tolerance of another micro-batch split: how far the start's split ends from the chosen one's.
    tolerance = max(float((a - b).abs().max()) for a, b in zip(_weights(start), _weights(direct), strict=True))
    for a, b in zip(_weights(piloted), _weights(direct), strict=True):
        torch.testing.assert_close(a, b, atol=max(2 * tolerance, 1e-6), rtol=0, msg=lambda m: f"{m}\n{table}")


def test_a_run_too_short_to_pay_for_the_search_says_so_and_trains_as_configured() -> None:
    cfg = _config("train.max_steps=30", "autopilot.budget=0.05", "checkpoint.every=10", "train.log_every=10")
    _, recorder = _train(cfg, Net())
    table = _table(recorder)
    assert table["skipped"].startswith("run too short to pay for the search")
    assert table["rows"] == [] and table["search_steps"] == 0 and table["chosen"] == table["start"]
    assert "autopilot" in recorder.reports[0][0]  # said with the first report
    assert {m["micro_batch_size"] for m, _ in recorder.reports} == {4}


def test_the_budget_is_kept_against_a_slow_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every micro-batch from 8 up costs 1 s more a step: the search must stop at the first step past its budget.
    slow_s, real = 1.0, autopilot.train_step

    def slow_from_8(parts: Parts, batch: list[Any], timer: Any = None) -> Any:
        result = real(parts, batch, timer)
        if 4 * parts.state.join // parts.state.split >= 8:
            _spend(slow_s)
        return result

    monkeypatch.setattr(autopilot, "train_step", slow_from_8)
    _, recorder = _train(_config("autopilot.budget=0.05", "train.max_steps=200"), Net())
    table = _table(recorder)
    assert table["budget_s"] < slow_s  # so that one slow step overruns it
    # The candidates' steps (the start's are the run's own) overran it by at most the one step that reached it:
    # micro-batch 8's warm-up step, its modelled cost and the extra second.
    assert table["budget_spent_s"] <= table["budget_s"] + slow_s
    assert table["budget_spent_s"] == pytest.approx(_step_s(8) + slow_s, rel=1e-12), table
    last = table["rows"][-1]
    assert last["settings"]["micro_batch_size"] == 8 and not last["chosen"]
    assert last["status"].startswith("stopped: the budget ran out")
    assert table["chosen"]["micro_batch_size"] == 4


def test_a_resume_applies_the_saved_choice_without_searching(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    cfg = _config()

    class Keep(Recorder):
        def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
            super().checkpoint(metrics, checkpoint_dir)
            if checkpoint_dir and metrics["step"] == 200:
                shutil.copytree(checkpoint_dir, tmp_path / "step200")

    straight, recorder = _train(cfg, Net(), recorder=Keep())  # uninterrupted, keeping its step-200 checkpoint
    state = load_state(tmp_path / "step200")
    saved = state["progress"]["autopilot"]["chosen"]
    assert saved == _table(recorder)["chosen"]

    def no_search(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a resume with a saved choice must not search")

    monkeypatch.setattr(autopilot.Autopilot, "step", no_search)
    torch.set_num_threads(2)  # a restarted process starts from its own settings
    resumed_parts = _parts(cfg, Net())
    progress = restore(resumed_parts, state)
    resumed = Recorder()
    run(cfg, resumed_parts, Data(_source(0, 4)), resumed, progress)
    table = _table(resumed)
    assert table["from_checkpoint"] is True and table["rows"] == [] and table["chosen"] == saved
    assert torch.get_num_threads() == saved["torch_threads"]
    assert {m["micro_batch_size"] for m, _ in resumed.reports} == {saved["micro_batch_size"]}
    for a, b in zip(_weights(straight), _weights(resumed_parts), strict=True):
        assert torch.equal(a, b)  # where the uninterrupted run ended, bitwise


def test_a_resized_group_keeps_the_saved_choice_but_measures_the_micro_batch_again() -> None:
    cfg = _config("train.max_steps=200")
    settings = {"micro_batch_size": 16, "grad_accum_steps": 4, "compile": False, "torch_threads": 1,
                "flush_denormal": False, "precision": "fp32", "sync": "ddp", "tf32": False}
    progress = Progress(autopilot={"start": settings, "chosen": settings, "world": 2, "predicted_speedup": 2.0})
    _, recorder = _train(cfg, Net(), progress=progress)
    table = _table(recorder)
    assert table["from_checkpoint"] is False and len(table["rows"]) > 1
    # Only the micro-batch is searched, from the config's; the rest of the saved choice holds.
    assert table["start"] == settings | {"micro_batch_size": 4, "grad_accum_steps": 16}
    varied = {key for row in table["rows"] for key, value in row["settings"].items() if table["start"][key] != value}
    assert varied == {"micro_batch_size", "grad_accum_steps"}
    assert progress.autopilot["world"] == 1 and table["chosen"]["micro_batch_size"] == 64  # type: ignore[index]
    # What a later resume's summary measures the choice against: the start as this search measured it.
    start_rate = progress.autopilot["start_samples_per_s"]  # type: ignore[index]
    assert start_rate == table["rows"][0]["samples_per_s"] == pytest.approx(64 / _step_s(4), rel=1e-12)


def test_a_restarted_worker_builds_its_data_at_the_chosen_micro_batch() -> None:
    cfg = _config("scaling.num_workers=2", "train.global_batch_size=64")
    state = {"progress": {"autopilot": {"chosen": {"micro_batch_size": 16}, "world": 2}}}
    kept = autopilot.kept_config(cfg, state, 2)
    assert (kept.train.micro_batch_size, kept.train.grad_accum_steps) == (16, 2)
    # At another world size the micro-batch is the config's again (the rest of the choice holds: loop.run applies it).
    assert autopilot.kept_config(cfg, state, 1).train.micro_batch_size == 4
    off = cfg.model_copy(update={"autopilot": cfg.autopilot.model_copy(update={"enabled": False})})
    assert autopilot.kept_config(off, state, 2).train.micro_batch_size == 4
    # An allowed sync choice holds at any world size: the group's model is built with it (build_parts), so the
    # checkpoint's local-SGD state is restored into it; a choice saved before sync was searched keeps the config's.
    assert autopilot.kept_config(cfg, state, 2).train.sync == "ddp"
    local = {"progress": {"autopilot": {"chosen": {"micro_batch_size": 16, "sync": "local_sgd"}, "world": 2}}}
    assert [autopilot.kept_config(cfg, local, world).train.sync for world in (2, 3)] == ["local_sgd"] * 2


# ---- two ranks -------------------------------------------------------------------------------------------------


LAG_S = 0.05  # rank 1's extra step time from micro-batch 8 up (`_two_rank_runs`)


def _two_rank_runs(rank: int, shared: Path) -> dict[str, Any]:
    """On each rank, on its modelled clock: (1) an autopilot run where rank 1's clock finds micro-batches from 8 up
    50 ms a step slower (a slowness rank 0's own clock never sees: under DDP it would wait for rank 1 somewhere, and
    only the slowest rank's figure says where), then the run configured with its choice from the start; (2) an
    autopilot run whose model runs out of memory past 4 rows per forward on rank 1 only, whose data makes rank 1
    wait before each of its first steps."""
    with modelled_clock():
        return _two_rank_runs_timed(rank)


def _two_rank_runs_timed(rank: int) -> dict[str, Any]:
    cfg = _config("scaling.num_workers=2", "autopilot.budget=0.3")
    real = autopilot.train_step

    def slow_on_rank_1(parts: Parts, batch: list[Any], timer: Any = None) -> Any:
        result = real(parts, batch, timer)  # after its gradient all-reduce: rank 0 does not wait for this
        if rank == 1 and 4 * parts.state.join // parts.state.split >= 8:
            _spend(LAG_S)
        return result

    autopilot.train_step = slow_on_rank_1  # type: ignore[assignment]
    try:
        progress = Progress()
        piloted, recorder = _train(cfg, _meeting_ddp(Net()), rank, progress)
    finally:
        autopilot.train_step = real  # type: ignore[assignment]
    dist.barrier()
    chosen = progress.autopilot["chosen"]  # type: ignore[index]
    direct, _ = _train(_chosen_config(cfg, chosen), DistributedDataParallel(Net()), rank)
    oom_progress = Progress()
    oomed, oom_recorder = _train(cfg, _meeting_ddp(Net(oom_above=4 if rank == 1 else None)), rank,
                                 oom_progress, data=_waiting(rank, 4) if rank == 1 else None)
    # (3) With train.sync opted in: local SGD measured as a candidate beside DDP.
    synced, sync_recorder = _train(_config("scaling.num_workers=2", "autopilot.budget=0.5", "autopilot.allow=[sync]",
                                           "train.micro_batch_size=32"), DistributedDataParallel(Net()), rank)
    # (4) Local SGD then back to DDP, as a search that measured local SGD and chose DDP ends: each rank's optimizer
    # state drifted apart under local SGD (its own gradients), and DDP's one model needs one optimizer state too.
    back = _parts(cfg, DistributedDataParallel(Net()))
    knobs = Knobs(back, 32, True, cfg.train.local_sgd)  # type: ignore[arg-type]
    start = knobs.read(back, 32)
    batches = _source(rank, 32)(0)
    for i, sync in enumerate(["local_sgd"] * 3 + ["ddp"] * 3):
        knobs.apply(back, replace(start, sync=sync))
        train_step(back, [batches[i]])
    return {"piloted": _weights(piloted), "direct": _weights(direct), "saved": progress.autopilot,
            "back_to_ddp": _weights(back),
            "table": _table(recorder) if rank == 0 else None, "oom_saved": oom_progress.autopilot,
            "oom_table": _table(oom_recorder) if rank == 0 else None, "oomed": _weights(oomed),
            "micro": [m["micro_batch_size"] for m, _ in recorder.reports], "synced": _weights(synced),
            "sync_table": _table(sync_recorder) if rank == 0 else None}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_two_ranks(_two_rank_runs, tmp_path_factory.mktemp("autopilot"))


def test_every_rank_makes_the_one_choice_by_the_slowest_ranks_time(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["saved"] == ranks[1]["saved"] and ranks[0]["micro"] == ranks[1]["micro"]
    assert ranks[1]["table"] is None  # the table goes with rank 0's report only
    chosen = ranks[0]["saved"]["chosen"]
    # Rank 0's own clock finds micro-batches from 8 faster (fewer forwards of 32 rows a rank); rank 1's finds them
    # 50 ms a step slower, and the slowest rank counts.
    assert _step_s(8, 32) < _step_s(4, 32) < _step_s(8, 32) + LAG_S
    assert chosen["micro_batch_size"] == 4, ranks[0]["table"]
    slow = [r for r in ranks[0]["table"]["rows"] if r["settings"]["micro_batch_size"] >= 8]
    assert slow and all(not r["chosen"] for r in slow)
    assert [r["ratio"] for r in slow] == pytest.approx([_step_s(4, 32) / (_step_s(8, 32) + LAG_S)], rel=1e-9), slow


def test_two_ranks_end_with_the_weights_of_the_choice_configured_from_the_start(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        for a, b in zip(result["piloted"], result["direct"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for a, b in zip(ranks[0]["piloted"], ranks[1]["piloted"], strict=True):
        assert torch.equal(a, b)  # DDP: one model


def test_a_candidate_out_of_memory_on_one_rank_is_dropped_on_all(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["oom_saved"] == ranks[1]["oom_saved"]
    assert ranks[0]["oom_saved"]["chosen"]["micro_batch_size"] == 4  # 8 does not fit, 2 costs more (`_step_s`)
    failed = [r for r in ranks[0]["oom_table"]["rows"] if r["status"].startswith("failed: out of memory")]
    # Rank 0 never ran out of memory itself: it drops the candidate because rank 1 did.
    assert [r["settings"]["micro_batch_size"] for r in failed] == [8]
    # Rank 1's data waited 0.1 s before each of these steps: a step's time starts when every rank is at it, so a
    # rank's wait for data is not counted as the step's: the start's figure is its 8 forwards of 4 rows a rank, not
    # 64 / (that + 0.1).
    start = ranks[0]["oom_table"]["rows"][0]
    assert start["samples_per_s"] == pytest.approx(64 / _step_s(4, 32), rel=1e-9), start
    assert not failed[0]["chosen"] and failed[0]["samples_per_s"] is None
    for a, b in zip(ranks[0]["oomed"], ranks[1]["oomed"], strict=True):
        assert torch.equal(a, b)


def test_train_sync_is_measured_only_when_allowed_and_the_replicas_end_as_one(ranks: list[dict[str, Any]]) -> None:
    """Local SGD changes the math: measured only with autopilot.allow=[sync], its row with the loss over its steps;
    whichever mode is chosen, the ranks' replicas are averaged back into one model (DDP's, or local SGD's last
    average at the run's end)."""
    table = ranks[0]["sync_table"]
    local = [r for r in table["rows"] if r["settings"]["sync"] == "local_sgd"]
    assert local and all(r["candidate"].endswith(" | local_sgd") for r in local) and local[0]["status"] == "ok", table
    assert all(r["loss"] is not None and r["loss"] > 0 for r in table["rows"] if r["status"] == "ok")
    assert table["chosen"]["sync"] in ("ddp", "local_sgd")
    for a, b in zip(ranks[0]["synced"], ranks[1]["synced"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    # Not allowed (the other runs of these ranks): never a candidate.
    assert all(r["settings"]["sync"] == "ddp" for t in ("table", "oom_table") for r in ranks[0][t]["rows"])


def test_back_to_ddp_after_local_sgd_the_ranks_share_one_model_and_one_optimizer_state(
        ranks: list[dict[str, Any]]) -> None:
    """A search that measured local SGD and chose DDP: DDP's steps after it leave both ranks with one model."""
    for a, b in zip(ranks[0]["back_to_ddp"], ranks[1]["back_to_ddp"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


class OomInFp32(Net):
    """Runs out of memory past 8 rows per forward in fp32 only, as a GPU whose chosen micro-batch fits in bf16
    but not in fp32's twice-as-large activations."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(x) > 8 and not torch.is_autocast_enabled("cpu"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(x)


def _fp32_runs_out(rank: int, shared: Path) -> dict[str, Any]:
    """precision auto (bf16 here): micro-batches up to the whole per-worker batch (one piece, DDP's synced one) are
    searched in bf16, then fp32 at the chosen one, which does not fit."""
    with modelled_clock():
        return _fp32_runs_out_timed(rank)


def _fp32_runs_out_timed(rank: int) -> dict[str, Any]:
    cfg = _config("scaling.num_workers=2", "train.precision=auto", "autopilot.budget=0.5")
    model = _meeting_ddp(OomInFp32())  # fewer, larger forwards are cheaper (the modelled cost of a forward)
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.train.max_steps or 1)
    parts = Parts(model, optimizer, scheduler, Precision("bf16", CPU), CPU, cfg.optim.max_grad_norm)
    recorder, progress, data = Recorder(), Progress(), Resizable(rank, 4)
    run(cfg, parts, Data(data, resize=data.resize), recorder, progress)
    return {"saved": progress.autopilot, "table": _table(recorder) if rank == 0 else None}


@pytest.mark.skipif(not cpu_supports_bf16(), reason="precision auto resolves to bf16 only where the CPU runs it")
def test_a_wider_precision_that_runs_out_of_memory_is_dropped_and_the_search_goes_on(tmp_path: Path) -> None:
    ranks = run_two_ranks(_fp32_runs_out, tmp_path)
    assert ranks[0]["saved"] == ranks[1]["saved"]
    rows = ranks[0]["table"]["rows"]
    assert ranks[0]["saved"]["chosen"]["precision"] == "bf16", rows
    fp32 = [r for r in rows if r["settings"]["precision"] == "fp32"]
    assert fp32 and all(r["status"].startswith("failed: out of memory") for r in fp32), fp32
    # The bf16 choice (one piece per step: the synced one) that the fp32 candidate could not fit.
    assert ranks[0]["saved"]["chosen"]["micro_batch_size"] == 32, rows
