"""The autopilot's global-setting candidates (issue 57's review): torch threads are searched on CPU ranks only (a GPU
step's speed does not depend on them: there they measure noise), and a candidate that changes a setting torch.compile
guards (threads, TF32, the autocast precision) recompiles a compiled model, so under compile it is measured only where
the budget left covers a compile, as the compile candidate is. Compiles are counted with the eager backend (dynamo
traces and guards as for inductor; nothing is code-generated). In-process, on CPU: a GPU run's candidates are
generated for a Parts that names a CUDA device (nothing runs on it)."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from test_autopilot import _config, _parts
from test_autopilot import one_thread as one_thread  # its autouse fixture: one torch thread, flushing on
from test_autopilot_tf32 import _options, _pilot
from test_peaks import tf32_flags as tf32_flags  # torch's TF32 flags as they were, after each test
from torch._dynamo.utils import counters

from orchestrator.training import autopilot
from orchestrator.training.checkpoint import Progress
from orchestrator.training.knobs import Knobs, Settings
from orchestrator.training.parts import compile_model
from orchestrator.training.step import first_compiled_step, train_step

pytestmark = pytest.mark.usefixtures("tf32_flags")
GUARDED = ("torch_threads", "tf32", "precision")  # what dynamo's guards read: a new value recompiles


@pytest.fixture
def eager_compile(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch.compile with the eager backend, and dynamo's caches and counters empty before and after."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def _walked(pilot: autopilot.Autopilot, budget_s: float) -> list[Settings]:
    """The candidates the walk yields from the start, each losing to it (no micro-batch options in these runs)."""
    pilot.best = autopilot.Trial(pilot.start)
    pilot.budget_s = budget_s
    return list(pilot._walk())


def _changed(start: Settings, candidates: list[Settings]) -> list[str]:
    return [key for s in candidates for key in GUARDED if getattr(s, key) != getattr(start, key)]


def test_threads_are_searched_on_a_cpu_rank_and_never_on_a_gpu() -> None:
    cfg = _config("scaling.cpus_per_worker=2")
    gpu_cfg = _config("scaling.use_gpu=true", "scaling.cpus_per_worker=8")
    assert [k for k, _ in _options(_pilot(cfg, "cpu", "fp32")) if k == "torch_threads"] == ["torch_threads"]
    assert "torch_threads" not in [k for k, _ in _options(_pilot(gpu_cfg, "cuda", "fp32"))]
    assert "torch_threads" not in _changed(_pilot(gpu_cfg, "cuda", "fp32").start,
                                           _walked(_pilot(gpu_cfg, "cuda", "fp32"), 1e9))


@pytest.mark.parametrize("compiled", [False, True])
def test_under_compile_a_guarded_candidate_needs_the_budget_of_a_compile(compiled: bool) -> None:
    """On a GPU in fp32 under precision auto's bf16: precision and TF32 are guarded settings. With the budget left
    short of a compile they are measured on an eager model only; with a compile's budget, under compile too."""
    cfg = _config("scaling.use_gpu=true", "autopilot.allow=[tf32]", "train.precision=auto")
    short, ample = autopilot.COMPILE_GUESS_S / 2, 10 * autopilot.COMPILE_GUESS_S
    for budget_s in (short, ample):
        pilot = _pilot(cfg, "cuda", "bf16")
        pilot.start = replace(pilot.start, compile=compiled)
        changed = _changed(pilot.start, _walked(pilot, budget_s))
        assert changed == ([] if compiled and budget_s == short else ["precision"]), (budget_s, changed)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a threads candidate needs two CPUs")
@pytest.mark.parametrize("budget_s", [1.0, 1e9], ids=["short", "ample"])
def test_a_compiled_model_recompiles_only_for_a_threads_candidate_the_budget_covers(eager_compile: None,
                                                                                   budget_s: float) -> None:
    """The search's candidates applied to a compiled model and stepped, each put back after (as a losing one is):
    frame compiles stay at the first one where the budget left is short of a compile; with a compile's budget the
    threads candidate runs, and its step recompiles the model (the cost the budget was checked for)."""
    cfg = _config("train.compile=true", "train.global_batch_size=3", "train.micro_batch_size=3",
                  "scaling.cpus_per_worker=2")  # micro-batch 3 of 3: no micro-batch candidates (no new shapes)
    parts = _parts(cfg, torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)))
    compile_model(parts)
    knobs = Knobs(parts, 3, cfg.train.flush_denormal, cfg.train.local_sgd)  # type: ignore[arg-type]
    batch = [{"x": torch.randn(3, 16), "labels": torch.tensor([0, 1, 2])}]
    first_compiled_step(parts, batch)
    assert counters["frames"]["ok"] == 1
    pilot = autopilot.Autopilot(cfg, Progress(), knobs, knobs.read(parts, 3), 3)
    assert pilot.start.compile and pilot.start.torch_threads == 1
    candidates = []
    for settings in _walked(pilot, budget_s):
        knobs.apply(parts, settings)
        train_step(parts, batch)
        knobs.apply(parts, pilot.start)
        candidates.append(settings)
    train_step(parts, batch)  # the start's settings again: its compiled frame, from dynamo's cache
    threads = [s.torch_threads for s in candidates if s.torch_threads != 1]
    assert (threads, counters["frames"]["ok"]) == (([], 1) if budget_s == 1.0 else ([2], 2)), candidates
