"""What the autopilot may measure (training/autopilot.py walks it, each candidate from the best so
far): the micro-batches the step can run from the pipeline's, and the values of the other settings
worth a try on this run's device, as its config allows."""

from __future__ import annotations

import os
from typing import Any

from orchestrator.config import Config
from orchestrator.training import fsdp, ranks
from orchestrator.training.knobs import Knobs, Settings


def micro_options(knobs: Knobs, per_worker: int, best: int) -> tuple[list[int], list[int]]:
    """Micro-batches the step can run from the pipeline's (joined or cut), larger than the best's
    (`best`) ascending and up to two smaller ones descending. None under FSDP, where running out of
    memory cannot be survived."""
    if fsdp.is_sharded(knobs.eager):
        return [], []
    m, accum = knobs.micro, per_worker // knobs.micro
    options = {m * k for k in range(2, accum + 1)
               if accum % k == 0 and (k & (k - 1) == 0 or k == accum)}
    options |= {m // k for k in (2, 4) if m % k == 0}
    return (sorted(o for o in options if o > best),
            sorted((o for o in options if o < best), reverse=True))


def other_options(cfg: Config, s: Settings, knobs: Knobs,
                  flush_ok: bool) -> list[tuple[str, list[Any]]]:
    """The other settings the search may change, in the order it measures them, each with the values
    it tries against the best: from the start's settings `s`, on the device of `knobs`. `flush_ok`:
    the CPU can flush denormals and a switch mid-run reaches torch's intra-op threads."""
    cpu = knobs.device.type == "cpu"
    sharded = fsdp.is_sharded(knobs.eager)
    options: list[tuple[str, list[Any]]] = []
    if "sync" in cfg.autopilot.allow and ranks.world()[1] > 1 and not sharded:
        # asked for: measured first
        options.append(("sync", ["local_sgd" if s.sync == "ddp" else "ddp"]))
    fp32 = s.precision == "fp32"
    if cfg.train.precision == "auto" and s.precision == "bf16" and not sharded:
        options.append(("precision", ["fp32"]))  # auto chose bf16: the device runs it natively
        fp32 = True
    if "tf32" in cfg.autopilot.allow and knobs.device.type == "cuda" and fp32:
        # Asked for, on a GPU, where the run trains or may train in fp32 (autopilot's `_worth`):
        # from the config's setting.
        options.append(("tf32", [not s.tf32]))
    if not sharded:
        options.append(("compile", [not s.compile]))
    # a GPU step's kernels run on the device: the host's thread count measures only noise there
    if cpu:
        cpus = max(1, int(cfg.scaling.cpus_per_worker))
        if hasattr(os, "sched_getaffinity"):
            cpus = min(cpus, len(os.sched_getaffinity(0)))
        options.append(("torch_threads", sorted({1, max(1, cpus // 2), cpus, s.torch_threads},
                                                reverse=True)))
    if cpu and flush_ok and not s.flush_denormal:
        # Only towards on: subnormals appear late in training, so the first steps cannot see what
        # flushing saves then (4x a step in bench/overhead.py), and turning it off on their figures
        # could cost that.
        options.append(("flush_denormal", [True]))
    return options
