"""How much of a full grid's training ASHA spends to find a configuration as good as the grid's best, and what each
trial costs beyond its training.

The same small grid (learning rates x warmups, digits, 1-worker trials) is run twice, each study as a user runs it
(`tune()` with the product's defaults: it starts its own local Ray cluster, trials at once as the cluster allows,
checkpoints every `checkpoint.every` steps): once with every trial trained to the end (FIFO), once with ASHA
stopping weak trials early. Printed:

    trial-steps ratio = trial-steps the ASHA study spent / trial-steps of the full grid   (target <= 0.4)
    wall ratio        = the ASHA study's wall clock / the full grid's                    (target <= 0.5)
    fixed part        = a study's wall outside its trials' span (Ray's start, Tune's set-up, shutdown), and the wall
                        ratio it leaves even if trials cost only their steps: the floor under the wall ratio
    per-trial overhead = a trial's wall (Tune's start to its last result) minus its training and evaluation
                         (its cost ledger's phases), median over the trials                (target <= 3 s)

The ratios count only if ASHA's best trial is within 1% of the full grid's best (else the search failed).

    .venv/bin/python bench/tune.py [--steps 120 --lrs 3e-4,1e-3,3e-3,1e-2,3e-2,1e-1 --warmups 0,50 --grace 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from _common import scratch_run  # noqa: E402

from orchestrator import load_config, tune  # noqa: E402
from orchestrator.tuning.results import TrialSummary  # noqa: E402
from pipelines.prepare import prepare_digits  # noqa: E402

TRAINING_PHASES = ("compute", "sync", "data_wait", "eval", "checkpoint", "report")


def run_study(name: str, root: str, data: str, args: argparse.Namespace,
              scheduler: list[str]) -> tuple[float, int, float, float]:
    """The study's best metric, its trial-steps, its wall clock and its fixed part: the wall outside its trials'
    span (Ray's start, Tune's set-up, the first trial process, the summary and Ray's shutdown)."""
    config = load_config(None, [
        f"experiment={name}", *scratch_run(data, f"{root}/runs", val=True), "data.features=[pixels]",
        "scaling.num_workers=1",
        "model.hidden=[128]", f"train.max_steps={args.steps}", "train.log_every=10", "train.eval_every=10",
        f"tune.space.optim.lr.grid=[{args.lrs}]", f"tune.space.optim.warmup_steps.grid=[{args.warmups}]",
        "tune.num_samples=1", *scheduler])
    started = time.time()
    result = tune(config, fresh=True, verbose=False)
    wall = time.time() - started
    timed = [t for t in result.trials if t.started_at is not None and t.ended_at is not None]
    span = max(t.ended_at for t in timed) - min(t.started_at for t in timed)  # type: ignore[operator]
    spent = sum(t.steps for t in result.trials)
    stopped = sum(t.status == "stopped" for t in result.trials)
    overheads = [overhead for t in result.trials if (overhead := trial_overhead(t)) is not None]
    median = f"{statistics.median(overheads):.1f} s" if overheads else "unknown"
    print(f"{name}: {len(result.trials)} trials, {stopped} stopped early, {spent} trial-steps, best val_accuracy "
          f"{result.best.metric:.4f} ({result.best.params}), {wall:.0f} s, of which {wall - span:.0f} s outside its "
          f"trials' span; per-trial overhead median {median} (target <= 3 s)", flush=True)
    return result.best.metric or 0.0, spent, wall, wall - span


def trial_overhead(trial: TrialSummary) -> float | None:
    """The trial's wall (Tune's start to its last result) less the seconds its ledger puts in training phases."""
    if trial.started_at is None or trial.ended_at is None or trial.cost is None:
        return None
    training = sum(trial.cost.seconds.get(p, 0.0) for p in TRAINING_PHASES)
    return max(0.0, trial.ended_at - trial.started_at - training)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--lrs", default="3e-4,1e-3,3e-3,1e-2,3e-2,1e-1")
    parser.add_argument("--warmups", default="0,50")
    parser.add_argument("--grace", type=int, default=10)
    parser.add_argument("--reduction", type=float, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as root:
        data = os.path.join(root, "digits")
        prepare_digits(data)
        grid_best, grid_steps, grid_s, grid_fixed = run_study("bench-grid", root, data, args, ["tune.scheduler=fifo"])
        asha_best, asha_steps, asha_s, asha_fixed = run_study("bench-asha", root, data, args, [
            "tune.scheduler=asha", f"tune.grace_period={args.grace}", f"tune.reduction_factor={args.reduction}"])
    within = asha_best >= 0.99 * grid_best
    print(f"grid: {grid_steps} trial-steps, best {grid_best:.4f}, {grid_s:.0f} s | ASHA: {asha_steps} trial-steps, "
          f"best {asha_best:.4f} ({'within' if within else 'NOT within'} 1% of the grid's best), {asha_s:.0f} s")
    if within:
        print(f"ASHA trial-steps / full grid trial-steps = {asha_steps / grid_steps:.2f} (target <= 0.4); "
              f"ASHA wall / full grid wall = {asha_s / grid_s:.2f} (target <= 0.5)")
        # The wall ratio's floor at these fixed costs: each study's fixed part plus its trials' span, were that span
        # exactly ASHA's share of the grid's (no per-trial overhead at all).
        floor = (asha_fixed + asha_steps / grid_steps * (grid_s - grid_fixed)) / grid_s
        print(f"fixed part outside the trials: grid {grid_fixed:.0f} s, ASHA {asha_fixed:.0f} s; the wall ratio with "
              f"these fixed parts and trials costing only their steps would be {floor:.2f}")
    else:
        print("ASHA did not find a configuration within 1% of the grid's best: no ratio")


if __name__ == "__main__":
    main()
