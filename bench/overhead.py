"""The orchestrated run (1 Ray Train worker) vs a bare PyTorch loop, each as a command timed from start to exit.

Same model (MLP 64-512-512-10), same Parquet data, batch, precision, thread count and number of steps. The bare
loop is a fresh Python process that reads the whole dataset into tensors (its best case) and runs the same step
function with no Ray. The orchestrated run is `orchestrator train` with the product's defaults (a local Ray
cluster it starts, the cache decision `data.cache=auto` makes, checkpoints every `checkpoint.every` steps, MLflow
in a SQLite file); each override is a separate run on its own labelled line, to show what that default costs.
A third command runs the bare loop itself inside a 1-worker Ray Train run (no product: its tensors, its step):
the floor that running beside Ray's processes on this machine sets for any loop. Two ratios, side by side:

    steady state = orchestrated samples/s / bare samples/s: samples between the second and the last progress line
                   over the time between them (the lines' arrival on the wall clock: reports, checkpoints, pass
                   boundaries and data waits included), as a stopwatch on the terminal sees it
    end to end   = bare command's wall / orchestrated command's wall, for the same steps (start-up, Ray's
                   teardown and MLflow included)

Beside each orchestrated line, the CPU share (of one core) of each kind of process between the second and the last
progress line: the driver (the `orchestrator` command: reports, progress, MLflow), Ray Train's controller, Ray's
other processes (GCS, raylet, dashboard, Ray Train's synchronization actor, idle workers...) and the training
workers; `at rest` sums the driver and the controller (target <= 3%): the product starts no actor of its own.

The bare command runs before and after each round of the orchestrated ones, so drift on a shared machine hits both
sides. Single runs of the same variant differed by up to 0.25 here: `--repeat 3` gives each line the mean of 3
rounds and their range.

    .venv/bin/python bench/overhead.py [--rows 200000 --steps 1200 --batch 256 --threads 2 --repeat 1]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import scratch_run

ROOT = Path(__file__).resolve().parents[1]


def bare_loop(args: argparse.Namespace) -> None:
    """The bare command (run with --bare): prints the loop's marks (step, seconds), as JSON."""
    print(json.dumps(loop_marks(args, Path(args.bare))))


def loop_marks(args: argparse.Namespace, data: Path) -> list[tuple[int, float]]:
    """The bare loop on the whole dataset as tensors: (step, seconds) at every `log_every` steps."""
    import pyarrow.parquet as pq
    import torch

    from orchestrator.config import load_config
    from orchestrator.models.zoo import mlp
    from orchestrator.training.optim import build_optimizer
    from orchestrator.training.parts import Parts
    from orchestrator.training.precision import Precision, flush_denormals
    from orchestrator.training.step import train_step
    from pipelines.batches import collate_arrow

    cfg = load_config(None, overrides(args, data))
    flush_denormals(cfg.train.flush_denormal)  # as the product's workers do
    torch.set_num_threads(args.threads)
    x, y = collate_arrow(pq.read_table(data / "train"), ["features"], "label").values()
    torch.manual_seed(0)
    model = mlp(64, 10, hidden=[512, 512])
    optimizer, scheduler = build_optimizer(model, cfg.optim, args.steps)
    if args.kernel == "for-loop":  # the product's optimizer before it asked for torch's fused kernel
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                      foreach=False)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, scheduler.lr_lambdas[0])
    cpu = torch.device("cpu")
    parts = Parts(model, optimizer, scheduler, Precision(args.precision, cpu), cpu, cfg.optim.max_grad_norm)
    batch, interval, marks, position = args.batch, log_every(args), [], 0
    for step in range(1, args.steps + 1):
        if position + batch > len(y):
            position = 0
        loss = train_step(parts, [{"x": x[position:position + batch], "labels": y[position:position + batch]}]).loss_sum
        position += batch
        if step % interval == 0:
            float(loss)  # the host sync the orchestrated loop does at a report
            marks.append((step, time.perf_counter()))
    return marks


def ray_floor(args: argparse.Namespace) -> None:
    """The floor command (run with --floor): the bare loop itself (its tensors read with pyarrow in the worker)
    inside a 1-worker Ray Train run on a local cluster started as the product starts one: what running beside Ray's
    processes costs the loop, with none of the product's loop, data pipeline, reports, checkpoints or tracking."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from orchestrator.cluster.local import connect_ray, shutdown_local_ray, train_environment
    from orchestrator.config import load_config

    cfg = load_config(None, overrides(args, Path(args.floor)))
    started = connect_ray(None, cfg)
    try:
        with tempfile.TemporaryDirectory() as runs, train_environment(cfg, private_cluster=started):
            trainer = TorchTrainer(
                _floor_worker, train_loop_config={"args": vars(args)},
                scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": args.threads}),
                run_config=ray.train.RunConfig(storage_path=runs, name="floor"))
            print(json.dumps(trainer.fit().return_value))
    finally:
        if started:
            shutdown_local_ray()


def _floor_worker(config: dict) -> list[tuple[int, float]]:
    args = argparse.Namespace(**config["args"])
    return loop_marks(args, Path(args.floor))


def host_reads(args: argparse.Namespace, data: Path) -> tuple[float, float]:
    """(reads per step between reports, reads per report): the product's loop run in this process on the same
    model, data and settings (200 steps, a report every 50), every value read back from a tensor counted
    (tests/unit/training/reads.py). In-process because the count wraps torch's methods, which a user's run does not."""
    import pyarrow.parquet as pq
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "unit" / "training"))
    from reads import HostReads

    from orchestrator.config import load_config
    from orchestrator.training.loop import Data, run
    from orchestrator.training.parts import build_parts
    from pipelines.batches import collate_arrow

    steps = 200
    cfg = load_config(None, [*overrides(args, data), f"train.max_steps={steps}", "train.log_every=50",
                             "model.num_classes=10"])
    torch.set_num_threads(args.threads)
    x, y = collate_arrow(pq.read_table(data / "train"), ["features"], "label").values()
    parts = build_parts(cfg, 64, torch.device("cpu"))
    batch = args.batch
    source = lambda epoch: [{"x": x[i:i + batch], "labels": y[i:i + batch]}  # noqa: E731
                            for i in range(0, len(y) - batch + 1, batch)]

    class Reports:
        def publish(self, metrics: dict) -> None: ...
        def checkpoint(self, metrics: dict, checkpoint_dir: str | None) -> None: ...

    with HostReads().around_loop() as reads:
        run(cfg, parts, Data(source), Reports())
    return reads.counts["step"] / (steps - 1), reads.counts["report"] / (steps // 50)


def log_every(args: argparse.Namespace) -> int:
    return max(1, args.steps // 20)


def steady(marks: list[tuple[int, float]], batch: int) -> float:
    """Samples/s from the second mark to the last: the first interval holds the first batch and warm-up."""
    (first_step, first_t), (last_step, last_t) = marks[1], marks[-1]
    return (last_step - first_step) * batch / (last_t - first_t)


def overrides(args: argparse.Namespace, data: Path) -> list[str]:
    """The experiment itself (model, batch, steps, workers): everything else stays at the product's defaults."""
    return [*scratch_run(data, data.parent / "runs"), "model.hidden=[512, 512]",
            "scaling.num_workers=1", f"scaling.cpus_per_worker={args.threads}",
            f"train.global_batch_size={args.batch}", f"train.max_steps={args.steps}",
            f"train.precision={args.precision}", f"train.log_every={log_every(args)}", "optim.warmup_steps=10"]


KINDS = {"TrainController": "controller", "RayTrainWorker": "workers"}
SHOWN = ("driver", "controller", "Ray", "workers")


def kind_of(process: psutil.Process, command_pid: int) -> str:  # noqa: F821 - psutil comes with Ray
    """A process of the command's tree by what it runs: Ray names an actor's process `ray::<Class>.<method>`."""
    if process.pid == command_pid:
        return "driver"
    title = (process.cmdline() or [""])[0]
    if title.startswith("ray::"):
        return KINDS.get(title[5:].split(".")[0].split("(")[0].strip(), "Ray")
    return "Ray"


def cpu_snapshot(command_pid: int) -> tuple[float, dict[int, tuple[str, float]]]:
    """(now, {pid: (kind, CPU seconds so far)}) for the command's process and every process under it (a local Ray
    cluster's processes are the driver's children)."""
    import psutil

    now = time.perf_counter()
    seen = {}
    try:
        root = psutil.Process(command_pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                times = process.cpu_times()
                seen[process.pid] = (kind_of(process, command_pid), times.user + times.system)
            except psutil.Error:  # gone meanwhile
                continue
    except psutil.Error:
        pass
    return now, seen


def cpu_shares(first: tuple[float, dict[int, tuple[str, float]]], last: tuple[float, dict[int, tuple[str, float]]]
               ) -> dict[str, float]:
    """Each kind's CPU share of one core between two snapshots (processes in both; the latest kind of a pid: an
    idle worker that became an actor counts as that actor)."""
    wall = last[0] - first[0]
    shares = dict.fromkeys(SHOWN, 0.0)
    for pid, (kind, cpu) in last[1].items():
        if pid in first[1] and wall > 0:
            shares[kind] = shares.get(kind, 0.0) + (cpu - first[1][pid][1]) / wall
    return shares


def cpu_line(rounds: list[dict[str, float]]) -> str:
    """`driver 1.2 | controller 0.8 | ... | at rest 2.6`: each kind's median share over the rounds, in % of a core."""
    rounds = [shares for shares in rounds if shares]
    if not rounds:
        return "not measured (fewer than two progress lines)"
    median = {kind: 100 * statistics.median(r.get(kind, 0.0) for r in rounds) for kind in SHOWN}
    rest = 100 * statistics.median(sum(r.get(k, 0.0) for k in ("driver", "controller")) for r in rounds)
    return " | ".join(f"{kind} {share:.1f}" for kind, share in median.items()) + f" | at rest {rest:.1f} (target <= 3)"


def timed(command: list[str]) -> tuple[float, list[tuple[float, str]], dict[str, float]]:
    """The command's wall seconds, its stdout lines, each with when it arrived (seconds since the start), and the CPU
    share of each kind of its processes between its second and last progress lines."""
    started = time.perf_counter()
    lines = []
    marks: list[tuple[float, dict[int, tuple[str, float]]]] = []  # at the second progress line, and the latest
    progress = 0
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) as proc:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append((time.perf_counter() - started, line.rstrip("\n")))
            if re.match(r"step \d+/\d+ \|", line):
                progress += 1
                if progress >= 2:
                    marks = [*marks[:1], cpu_snapshot(proc.pid)]
        err = proc.stderr.read()  # type: ignore[union-attr]
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"{' '.join(command[:3])} ... failed:\n" + "\n".join(t for _, t in lines) + f"\n{err}")
    return wall, lines, (cpu_shares(marks[0], marks[1]) if len(marks) == 2 else {})


def progress_marks(lines: list[tuple[float, str]]) -> list[tuple[int, float]]:
    """(step, arrival) of every progress line `step N/M | ...`."""
    return [(int(m.group(1)), at) for at, text in lines if (m := re.match(r"step (\d+)/\d+ \|", text))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every variant, interleaved (the machine's "
                        "noise between single runs is as large as the differences between variants)")
    parser.add_argument("--kernel", default="default", help=argparse.SUPPRESS)  # internal: the bare loop's optimizer
    parser.add_argument("--bare", help=argparse.SUPPRESS)  # internal: run the bare loop on this data directory
    parser.add_argument("--floor", help=argparse.SUPPRESS)  # internal: the bare loop inside a Ray Train run
    args = parser.parse_args()
    if args.bare:
        bare_loop(args)
        return
    if args.floor:
        ray_floor(args)
        return

    from pipelines.prepare import prepare_synthetic

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        prepare_synthetic(str(data), rows=args.rows, shards=8, features=64, classes=10)
        flags = ["--rows", str(args.rows), "--steps", str(args.steps), "--batch", str(args.batch),
                 "--threads", str(args.threads), "--precision", args.precision]
        bare_command = [sys.executable, __file__, "--bare", str(data), *flags]
        floor_command = [sys.executable, __file__, "--floor", str(data), *flags]
        # MLflow on, in a SQLite file, as a user's run has it.
        settings = [*overrides(args, data), "tracking.enabled=true", f"tracking.uri=sqlite:///{tmp}/mlflow.db"]
        variants = {"product defaults": [],
                    "with data.cache=memory": ["data.cache=memory"],
                    f"with checkpoint.every={args.steps} (only the last)": [f"checkpoint.every={args.steps}"],
                    "with tracking.enabled=false": ["tracking.enabled=false"]}
        for_loop_command = [*bare_command, "--kernel", "for-loop"]
        bare_walls, bare, floor, for_loop = [], [], [], []
        runs: dict[str, list[tuple[float, list[tuple[float, str]], dict[str, float]]]] = {
            label: [] for label in variants}

        def run_bare() -> None:
            wall, out, _ = timed(bare_command)
            bare_walls.append(wall)
            bare.append(steady(json.loads(out[-1][1]), args.batch))

        run_bare()
        for _ in range(args.repeat):  # one round of every variant after another, so drift hits them alike
            for label, extra in variants.items():
                command = [str(ROOT / ".venv" / "bin" / "orchestrator"), "train",
                           *(arg for setting in [*settings, *extra] for arg in ("--set", setting))]
                runs[label].append(timed(command))
            floor.append(steady(json.loads(timed(floor_command)[1][-1][1]), args.batch))
            for_loop.append(steady(json.loads(timed(for_loop_command)[1][-1][1]), args.batch))
            run_bare()
        per_step, per_report = host_reads(args, data)
    bare_rate, bare_wall, floor_rate = statistics.fmean(bare), statistics.fmean(bare_walls), statistics.fmean(floor)
    print(f"model MLP 64-512-512-10, batch {args.batch}, {args.precision}, {args.threads} threads, "
          f"{args.steps} steps, {args.rows:,} rows; steady state = samples from the second progress line to the "
          "last over the time between them")
    print(f"bare PyTorch loop         : {bare_rate:10,.0f} samples/s, command {bare_wall:.1f} s "
          f"(mean of {len(bare)} runs)")
    print(f"Ray Train floor           : {floor_rate:10,.0f} samples/s | {floor_rate / bare_rate:.3f} of the bare loop: "
          f"the bare loop itself inside a 1-worker Ray Train run, no product (mean of {len(floor)} runs)")
    for_loop_rate = statistics.fmean(for_loop)
    print(f"bare loop, for-loop AdamW : {for_loop_rate:10,.0f} samples/s | the fused kernel the product asks for "
          f"runs {bare_rate / for_loop_rate:.2f}x its samples/s (torch's default on CPU: one tensor at a time)")
    print(f"host reads (the product's loop in-process, same model and data): {per_step:.2f} per step between "
          f"reports (target 0), {per_report:.1f} per report")
    for label, rounds in runs.items():
        rates = [steady(progress_marks(lines), args.batch) for _, lines, _ in rounds]
        rate, orch_wall = statistics.fmean(rates), statistics.fmean(wall for wall, _, _ in rounds)
        spread = f" (runs {min(rates) / bare_rate:.3f} to {max(rates) / bare_rate:.3f})" if len(rates) > 1 else ""
        print(f"orchestrated, {label:<40}: {rate:10,.0f} samples/s, command {orch_wall:.1f} s | steady state "
              f"{rate / bare_rate:.3f}{spread} (target >= 0.85), {rate / floor_rate:.3f} of the floor "
              f"(target >= 0.97) | end to end {bare_wall / orch_wall:.3f}")
        print(f"    CPU between reports, % of one core (median of {len(rounds)}): {cpu_line([r[2] for r in rounds])}")
        for _, text in rounds[-1][1]:
            if text.startswith(("start-up ", "time: ", "cost: ")):
                print(f"    {text}")


if __name__ == "__main__":
    main()
