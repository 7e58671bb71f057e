"""TF32 as an autopilot candidate (autopilot.allow=[tf32], training/autopilot.py and knobs.py): offered only when
allowed, on a GPU, where the run trains in fp32 (measured only while the best so far is fp32); the candidate's
setting flips both of torch's TF32 flags (matmuls and cuDNN's convolutions); the choice is kept by a resume like the
others, and a checkpoint saved before tf32 was a setting keeps the config's; the config refuses it where it can
never run. In-process, on CPU: a GPU run's candidates are generated for a Parts that names a CUDA device (nothing
runs on it)."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import pytest
import torch
from test_autopilot import Net, _config, _parts
from test_autopilot import one_thread as one_thread  # its autouse fixture: one torch thread, flushing on
from test_peaks import tf32_flags as tf32_flags  # torch's TF32 flags as they were, after each test

from orchestrator.config import Config, load_config
from orchestrator.errors import ConfigError
from orchestrator.training import autopilot
from orchestrator.training.candidates import other_options
from orchestrator.training.checkpoint import Progress
from orchestrator.training.knobs import Knobs, Settings

PER_WORKER = 64  # _config's global batch on one worker, in micro-batches of 4

pytestmark = pytest.mark.usefixtures("tf32_flags")


def _flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def _knobs(cfg: Config, device: str = "cpu") -> tuple[Any, Knobs]:
    parts = _parts(cfg, Net())
    parts.device = torch.device(device)  # the candidates depend on the device's type only; nothing runs here
    return parts, Knobs(parts, 4, cfg.train.flush_denormal, cfg.train.local_sgd)  # type: ignore[arg-type]


def _pilot(cfg: Config, device: str, precision: str, tf32: bool = False) -> autopilot.Autopilot:
    parts, knobs = _knobs(cfg, device)
    start = replace(knobs.read(parts, PER_WORKER), precision=precision, tf32=tf32)
    return autopilot.Autopilot(cfg, Progress(), knobs, start, PER_WORKER)


def _options(pilot: autopilot.Autopilot) -> list[tuple[str, list[Any]]]:
    """The settings besides the micro-batch that `pilot` may measure, with their values."""
    return other_options(pilot.cfg, pilot.start, pilot.knobs, pilot.flush_ok)


def _tf32_options(pilot: autopilot.Autopilot) -> list[list[Any]]:
    return [values for key, values in _options(pilot) if key == "tf32"]


def test_tf32_is_a_candidate_only_when_allowed_on_a_gpu_in_fp32() -> None:
    gpu, allowed = "scaling.use_gpu=true", "autopilot.allow=[tf32]"
    # Allowed, on a GPU, in fp32: flipped from the config's setting (off unless train.tf32 turned it on).
    assert _tf32_options(_pilot(_config(gpu, allowed), "cuda", "fp32")) == [[True]]
    assert _tf32_options(_pilot(_config(gpu, allowed, "train.tf32=true"), "cuda", "fp32", tf32=True)) == [[False]]
    # Not allowed: it changes the math, so never measured without consent.
    assert _tf32_options(_pilot(_config(gpu), "cuda", "fp32")) == []
    # Not on a GPU (CPUs have no TF32; the config refuses this, the autopilot would not offer it either).
    assert _tf32_options(_pilot(_config(gpu, allowed), "cpu", "fp32")) == []
    # precision auto chose bf16 on this GPU: offered, since the fp32 candidate may win (see the walk below).
    assert _tf32_options(_pilot(_config(gpu, allowed, "train.precision=auto"), "cuda", "bf16")) == [[True]]


@pytest.mark.parametrize("fp32_wins", [False, True])
def test_under_auto_tf32_is_measured_only_once_fp32_beat_bf16(fp32_wins: bool) -> None:
    """The walk yields each candidate from the best so far: TF32 only when the best runs fp32 (under bf16 autocast
    the matrix products it would change already run in bf16)."""
    pilot = _pilot(_config("scaling.use_gpu=true", "autopilot.allow=[tf32]", "train.precision=auto"), "cuda", "bf16")
    pilot.best = autopilot.Trial(pilot.start)
    pilot.budget_s = 1e9  # covers a compile: every dimension is walked
    candidates = []
    for settings in pilot._walk():  # each candidate loses, but fp32 against bf16 where `fp32_wins`
        candidates.append(settings)
        if settings.precision != pilot.best.settings.precision and fp32_wins:
            pilot.best = autopilot.Trial(settings)  # adopted, as _close does
    assert replace(pilot.start, precision="fp32") in candidates
    tf32 = [s for s in candidates if s.tf32]
    assert tf32 == ([replace(pilot.start, precision="fp32", tf32=True)] if fp32_wins else []), candidates


def test_a_tf32_candidate_flips_both_of_torchs_flags_and_reads_back() -> None:
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True  # torch's defaults
    parts, knobs = _knobs(_config())
    start = knobs.read(parts, PER_WORKER)
    assert start.tf32 is False
    knobs.apply(parts, replace(start, tf32=True))
    assert _flags() == (True, True) and knobs.read(parts, PER_WORKER).tf32 is True
    assert replace(start, tf32=True).line().endswith("| fp32 | tf32") and "tf32" not in start.line()
    knobs.apply(parts, start)
    # Off means strict fp32 everywhere: cuDNN's convolutions too (torch runs them in TF32 by default).
    assert _flags() == (False, False) and knobs.read(parts, PER_WORKER).tf32 is False


def _resume(cfg: Config, chosen: dict[str, Any]) -> dict[str, Any] | None:
    parts, knobs = _knobs(cfg)
    start = asdict(knobs.read(parts, PER_WORKER))
    progress = Progress(autopilot={"start": start, "chosen": start | chosen, "world": 1, "predicted_speedup": 1.2})
    pilot, report = autopilot.begin(cfg, parts, progress)
    assert pilot is None  # applied, not searched
    return report


def test_a_resume_applies_a_chosen_tf32_and_an_older_checkpoint_keeps_the_configs() -> None:
    cfg = _config("scaling.use_gpu=true", "autopilot.allow=[tf32]", "train.tf32=true")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    report = _resume(cfg, {"tf32": True})
    assert report is not None and report["from_checkpoint"] and report["chosen"]["tf32"] is True
    assert _flags() == (True, True)
    # A choice saved before tf32 was a setting has no such key: the run keeps what its config set (train.tf32=true,
    # applied by the worker before the loop), as it keeps the configured train.sync.
    old = {key: value for key, value in asdict(Settings(4, 16, False, 1, True, "fp32")).items() if key != "tf32"}
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    parts, knobs = _knobs(cfg)
    pilot, report = autopilot.begin(cfg, parts, Progress(autopilot={"start": old, "chosen": old, "world": 1}))
    assert pilot is None and report is not None and report["chosen"]["tf32"] is True and _flags() == (True, True)


def test_the_config_refuses_tf32_where_the_autopilot_could_never_measure_it() -> None:
    with pytest.raises(ConfigError, match=r"autopilot.allow=\[tf32\] needs a GPU .*set scaling.use_gpu=true"):
        load_config(None, ["autopilot.allow=[tf32]"])
    for narrow in ("bf16", "fp16"):
        with pytest.raises(ConfigError, match=rf"has no effect with train.precision={narrow} .*fp32 or auto"):
            load_config(None, ["autopilot.allow=[tf32]", "scaling.use_gpu=true", f"train.precision={narrow}"])
    for precision in ("fp32", "auto"):
        cfg = load_config(None, ["autopilot.allow=[tf32, sync]", "scaling.use_gpu=true",
                                 f"train.precision={precision}"])
        assert cfg.autopilot.allow == ["tf32", "sync"]
