"""The line that says what runs, before the first step: rank 0's figures (training/worker.py `what_runs`) as the
driver prints them (report/progress.py `setup_line`), each checked against an independent count. No Ray."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from orchestrator.config import load_config
from orchestrator.models.zoo import build_model
from orchestrator.report.progress import setup_line
from orchestrator.training.micro_batch import for_world_size
from orchestrator.training.parts import build_parts
from orchestrator.training.precision import resolve_precision
from orchestrator.training.worker import Seat, what_runs

ROOT = Path(__file__).resolve().parents[3]
CPU = torch.device("cpu")
TRAIN_ROWS = 1438  # the digits training split's


@pytest.mark.parametrize(("accumulation", "micro"), [(1, 64), (2, 32)])
def test_the_line_before_the_first_step_says_what_runs(accumulation: int, micro: int) -> None:
    cfg = for_world_size(load_config(str(ROOT / "examples" / "digits.yaml"), [
        "model.num_classes=10", f"train.grad_accum_steps={accumulation}"]), 2)
    facts = what_runs(build_parts(cfg, 64, CPU), cfg, Seat(2, 0, CPU, 0.0), step=0)
    line = setup_line(facts, TRAIN_ROWS)
    # Parameters: the same model built apart, and its closed form (64 -> 256 -> 256 -> 10, with biases).
    built = sum(p.numel() for p in build_model("mlp", None, 64, 10, {"hidden": [256, 256]}).parameters())
    assert built == 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    assert line.startswith(f"run: {built:,} params | ")
    # The precision `auto` resolves to on this device, never `auto` itself.
    assert f" | {resolve_precision('auto', CPU)} | 2 x cpu | " in line and "auto" not in line
    # The batch as the ranks cut it: micro-batch x accumulation x workers = the configured global batch.
    found = re.search(r"micro-batch (\d+) per device x accumulation (\d+) x (\d+) devices = global batch (\d+)", line)
    assert found is not None, line
    assert [int(n) for n in found.groups()] == [micro, accumulation, 2, micro * accumulation * 2]
    assert micro * accumulation * 2 == cfg.train.global_batch_size == 128
    assert line.endswith(f"| 300 steps, about {300 * 128 / TRAIN_ROWS:.1f} epochs of 1,438 rows")


def test_a_resumed_group_says_where_it_starts() -> None:
    facts = {"params": 1_234_567, "precision": "bf16", "device": "NVIDIA H100 80GB HBM3", "workers": 8,
             "micro_batch": 16, "grad_accum_steps": 4, "global_batch": 512, "max_steps": 10_000, "from_step": 2_500}
    assert setup_line(facts, None) == ("run: 1,234,567 params | bf16 | 8 x NVIDIA H100 80GB HBM3 | micro-batch 16 per "
                                       "device x accumulation 4 x 8 devices = global batch 512 | 10,000 steps from "
                                       "step 2,500")
