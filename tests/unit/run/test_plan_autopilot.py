"""The plan's autopilot section (orchestrator/run/plan.py, docs/autopilot.md): what `show-config --plan` and `plan.yaml`
say the autopilot will measure is only what it measures for that run: train.sync (opted in with autopilot.allow)
only where the run has two workers or more, train.tf32 only when opted in too, train.precision only when left auto,
train.flush_denormal (turned off in the config: the autopilot only ever turns it on) only on CPU, nothing when the
autopilot is off. Through plan_run on the digits data, as the CLI plans a run. No Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.config import load_config
from orchestrator.run.plan import plan_run

ALWAYS = ["train.micro_batch_size (at the global batch)", "train.compile"]
CPU = [*ALWAYS, "train.torch_threads"]  # a CPU run's: threads measure noise on a GPU


def _planned(tmp_path: Path, digits_dir: str, *sets: str) -> dict[str, Any]:
    config = load_config(None, [f"data.train={digits_dir}/train", f"data.val={digits_dir}/val",
                                f"storage.path={tmp_path}/runs", "tracking.enabled=false", "autopilot.enabled=true",
                                "train.global_batch_size=64", *sets])
    shown = yaml.safe_load(plan_run(config, verbose=False).to_yaml())["autopilot"]
    assert shown["enabled"] is True
    return shown


@pytest.mark.parametrize(("workers", "listed"), [("1", False), ("2", True), ("[1, 2]", True)])
def test_the_plan_lists_train_sync_only_where_the_autopilot_measures_it(
        tmp_path: Path, digits_dir: str, workers: str, listed: bool) -> None:
    shown = _planned(tmp_path, digits_dir, f"scaling.num_workers={workers}", "autopilot.allow=[sync]",
                     "train.precision=fp32", "train.flush_denormal=false")
    # One worker has no gradient sync to trade: local SGD is never measured there (an elastic run may grow to 2).
    assert shown["searches"] == [*CPU, "train.flush_denormal", *(["train.sync (allowed)"] if listed else [])]
    # Not opted in: never a candidate, at any size.
    assert "train.sync (allowed)" not in _planned(tmp_path, digits_dir, f"scaling.num_workers={workers}")["searches"]


def test_the_plan_lists_precision_only_when_left_auto(tmp_path: Path, digits_dir: str) -> None:
    assert "train.precision" in _planned(tmp_path, digits_dir, "train.precision=auto")["searches"]
    for fixed in ("fp32", "bf16"):
        searches = _planned(tmp_path, digits_dir, f"train.precision={fixed}")["searches"]
        assert "train.precision" not in searches and searches[:3] == CPU


def test_the_plan_of_a_gpu_run_leaves_threads_and_flush_denormal_out(tmp_path: Path, digits_dir: str) -> None:
    """Torch threads and subnormal flushing are CPU settings: a GPU step's kernels run on the device, and the
    autopilot never measures either there."""
    assert _planned(tmp_path, digits_dir, "scaling.use_gpu=true", "train.precision=bf16")["searches"] == ALWAYS
    assert "train.flush_denormal" in _planned(tmp_path, digits_dir, "train.precision=bf16",
                                              "train.flush_denormal=false")["searches"]


def test_the_plan_of_a_run_without_the_autopilot_lists_nothing(tmp_path: Path, digits_dir: str) -> None:
    config = load_config(None, [f"data.train={digits_dir}/train", f"data.val={digits_dir}/val",
                                f"storage.path={tmp_path}/runs", "tracking.enabled=false"])
    assert yaml.safe_load(plan_run(config, verbose=False).to_yaml())["autopilot"] == {"enabled": False}


def test_the_plan_lists_train_tf32_only_when_allowed(tmp_path: Path, digits_dir: str) -> None:
    """TF32 changes fp32's math: measured on a GPU run in fp32 only with autopilot.allow=[tf32] (the config refuses
    it without a GPU or in bf16/fp16, tests/unit/training/test_autopilot_tf32.py)."""
    gpu = ("scaling.use_gpu=true", "train.precision=fp32")
    assert _planned(tmp_path, digits_dir, *gpu, "autopilot.allow=[tf32]")["searches"] == [*ALWAYS,
                                                                                          "train.tf32 (allowed)"]
    assert _planned(tmp_path, digits_dir, *gpu)["searches"] == ALWAYS
