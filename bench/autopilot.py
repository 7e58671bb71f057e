"""The autopilot against an exhaustive grid, side by side in one invocation, on the MLP of bench/overhead.py and the
built-in GPT, from two starting configs each: a deliberately poor one (a small micro-batch with accumulation, one
torch thread, subnormal floats not flushed) and the product's defaults.

For each model: (1) every point of the grid over the candidates the autopilot searches (the micro-batch at the fixed
global batch with its accumulation, train.compile, train.torch_threads, train.flush_denormal and train.precision,
which both starting configs leave at auto), each point a short run measured in steady state; the few best are
measured again and the grid's best is the best mean. Both starting configs are points of that grid. (2) For each
starting config an autopilot run (autopilot.enabled=true): its steady state after the search, its search seconds,
their share of the run's wall clock and what it chose.

Every run trains in this process (no Ray: one rank set up and trained by `training.worker.train_rank`, the code a
Ray Train worker and a one-worker Tune trial run, with the product's defaults for everything the experiment does not
set), each in a thread of its own started from a fresh process's torch state, its data read with pyarrow and handed
to the rank as Ray Data's shard would hand it. A run is configured for 3000 steps (the targets' run length: its
schedule and the autopilot's budget are those of a 3000-step run) and stopped once its figure is measured.

    steady state  samples from the second report after the start (after the search, for an autopilot run) to the
                  last, over the time between them (reports and checkpoints included), as bench/overhead.py counts
    3000-step run the search's seconds plus the rest of the 3000 steps at the measured steady state: an
                  extrapolation from the measured part, not a 3000-step run
    grid score    a point's samples/s over a 3000-step run with its compile seconds counted, the autopilot's own
                  criterion (compile pays only if its gain over the run exceeds its compile time)

    .venv/bin/python bench/autopilot.py [--models mlp gpt --quick --by-hand]
"""

from __future__ import annotations

import argparse
import glob
import itertools
import math
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from _common import scratch_run

from orchestrator.config import Config, load_config, to_dict
from orchestrator.run.checks import check_run
from orchestrator.training.handoff import WorkerSpec
from orchestrator.training.precision import resolve_precision
from orchestrator.training.worker import Seat, Shards, rank_config, train_rank
from orchestrator.tuning.trial import start_as_fresh_process
from pipelines.datasets import cache_decision, inspect_datasets
from pipelines.prepare import prepare_synthetic, prepare_text

ROOT = Path(__file__).resolve().parents[1]
RUN_STEPS = 3000  # the run length the targets speak of
CPU = torch.device("cpu")


@dataclass
class Experiment:
    """One model's experiment: everything the bench sets (model, data, batch, steps, one worker); the rest stays at
    the product's defaults. `poor` holds the deliberately poor starting config's keys."""

    name: str
    overrides: list[str]
    poor: list[str]
    cfg: Config = field(init=False)
    spec: dict[str, Any] = field(init=False)
    table: pa.Table = field(init=False)

    def __post_init__(self) -> None:
        cfg = load_config(None, self.overrides)
        infos = inspect_datasets(cfg.data, named=cfg.model.inputs is not None)
        checked = check_run(cfg, infos)
        self.cfg = checked.config
        # What the driver hands a worker (trainer.build_inputs), with the cache decision a local cluster's default
        # object store (30% of the memory) makes for this data; no epoch clock (no Ray).
        store = 0.3 * psutil.virtual_memory().total
        self.spec = WorkerSpec({}, checked.in_features, cache_decision=cache_decision(cfg.data, infos, store),
                               sample=infos["train"].sample)
        columns = [*cfg.data.features, *([cfg.data.label] if cfg.data.label else [])]
        self.table = pq.read_table(cfg.data.train, columns=columns)  # the shards in path order, as the run reads

    @property
    def per_worker(self) -> int:
        return self.cfg.train.global_batch_size // self.cfg.scaling.max_workers

    @property
    def cpus(self) -> int:
        return int(self.cfg.scaling.cpus_per_worker)


class TableShard:
    """Stands in for the rank's Ray Data shard: the table's rows in order, in chunks through the rank's own collate,
    all collated when the pass starts (the first batch is start-up, outside every measured interval), as Ray Data's
    prefetching threads have chunks ready for a loop that never waits on its data."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table

    def iter_torch_batches(self, batch_size: int, collate_fn: Callable[[pa.Table], Any], **_: Any) -> Iterator[Any]:
        chunks = [collate_fn(self.table.slice(start, batch_size))
                  for start in range(0, self.table.num_rows, batch_size)]
        yield from chunks


class Enough(Exception):  # noqa: N818  (not an error: the figure is measured, the run stops here)
    """Raised from a report once the run's figure is measured."""


class Marks:
    """The loop's Reporter in this bench: every report's step and arrival; stops the run once `done(self)` says.
    A checkpoint is written by the loop as in any run; there is no Ray Train to register it with."""

    def __init__(self, done: Callable[[Marks], bool]) -> None:
        self.done = done
        self.reports: list[tuple[float, dict[str, Any]]] = []

    def publish(self, metrics: dict[str, Any]) -> None:
        self.reports.append((time.perf_counter(), metrics))
        if self.done(self):
            raise Enough

    def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        pass

    def save_sharded(self, parts: Any, progress: Any, micro_batch_size: int | str | None) -> Any:
        raise NotImplementedError("the bench trains with train.parallel=ddp")

    def steady(self, batch: int, after: int = 0) -> tuple[float, int]:
        """Samples/s from the second report at or after report index `after` to the last, and the steps between."""
        (t0, first), (t1, last) = self.reports[after + 1], self.reports[-1]
        steps = last["step"] - first["step"]
        return steps * batch / (t1 - t0), steps

    def compile_s(self) -> float:
        return float(next((m["compile_s"] for _, m in self.reports if "compile_s" in m), 0.0))

    def autopilot(self) -> tuple[int, dict[str, Any]] | None:
        """The index of the report carrying the autopilot's table, and the table; None before it."""
        return next(((i, m["autopilot"]) for i, (_, m) in enumerate(self.reports) if "autopilot" in m), None)


def train_here(exp: Experiment, settings: list[str], done: Callable[[Marks], bool]) -> Marks:
    """One run of `exp` with `settings`, trained in a thread of its own until `done`; returns its reports."""
    cfg = load_config(None, [*exp.overrides, *settings])
    spec = replace(exp.spec, config=to_dict(cfg.model_copy(update={"model": exp.cfg.model})))  # num_classes resolved
    marks, failure = Marks(done), []

    def rank() -> None:
        try:
            start_as_fresh_process()
            torch.set_num_threads(exp.cpus)  # what Ray's OMP_NUM_THREADS gives a worker of cpus_per_worker
            rank_cfg = rank_config(spec, world=1)
            train_rank(spec, rank_cfg, Seat(1, 0, CPU, time.time()), lambda: None,
                       Shards(TableShard(exp.table), None), marks, notices=None)
        except Enough:
            pass
        except BaseException as exc:  # noqa: BLE001  (reported by the caller's thread)
            failure.append(exc)

    thread = threading.Thread(target=rank, name="bench-rank")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return marks


def measured_enough(window_steps: int, window_s: float, after: Callable[[Marks], int | None] = lambda m: 0
                    ) -> Callable[[Marks], bool]:
    """Stop once the steady window (from the second report after `after`) spans `window_steps` steps, or at least
    one interval and `window_s` seconds."""
    def done(marks: Marks) -> bool:
        start = after(marks)
        if start is None or len(marks.reports) < start + 3:
            return False
        (t0, first), (t1, last) = marks.reports[start + 1], marks.reports[-1]
        steps = last["step"] - first["step"]
        intervals = len(marks.reports) - start - 2
        return steps >= window_steps or (intervals >= 1 and t1 - t0 >= window_s)
    return done


# The grid: the candidates of the autopilot's search (docs/autopilot.md), every combination.

@dataclass(frozen=True)
class Point:
    micro: int
    compile: bool
    threads: int
    flush: bool
    precision: str

    def settings(self, per_worker: int) -> list[str]:
        return [f"train.micro_batch_size={self.micro}", f"train.grad_accum_steps={per_worker // self.micro}",
                f"train.compile={str(self.compile).lower()}", f"train.torch_threads={self.threads}",
                f"train.flush_denormal={str(self.flush).lower()}", f"train.precision={self.precision}"]

    def label(self, per_worker: int) -> str:
        return (f"micro {self.micro} x {per_worker // self.micro} | compile {'on' if self.compile else 'off'} | "
                f"threads {self.threads} | flush {'on' if self.flush else 'off'} | {self.precision}")


def grid(exp: Experiment, starts: list[Point]) -> list[Point]:
    """Every combination of the values the autopilot's search can reach from either start (training/autopilot.py):
    micro-batches joined from the start's up to the per-worker batch (power-of-two multiples, and the whole) and cut
    to a half and a quarter of it, none below the smaller start's; threads 1, half and all of the worker's CPUs;
    compile and flush_denormal on and off; bf16 and fp32 (both starts leave precision at auto: bf16 on this CPU)."""
    micros: set[int] = set()
    for start in starts:
        m, accum = start.micro, exp.per_worker // start.micro
        micros |= {m} | {m * k for k in range(2, accum + 1) if accum % k == 0 and (k & (k - 1) == 0 or k == accum)}
        micros |= {m // k for k in (2, 4) if m % k == 0}
    # Below the smallest start: the search cuts micro-batches only when no larger one beat the start, and a
    # micro-batch of 2 or 4 rows runs an order of magnitude slower here while taking most of the grid's time.
    micros = {m for m in micros if m >= min(s.micro for s in starts)}
    threads = sorted({1, max(1, exp.cpus // 2), exp.cpus, *(s.threads for s in starts)})
    precisions = sorted({"fp32", *(s.precision for s in starts)})
    return [Point(*values) for values in itertools.product(sorted(micros), [False, True], threads, [True, False],
                                                           precisions)]


def start_point(exp: Experiment, settings: list[str]) -> Point:
    """The grid point a starting config is: its keys resolved as the worker resolves them."""
    cfg = load_config(None, [*exp.overrides, *settings])
    t = cfg.train
    micro = t.micro_batch_size if isinstance(t.micro_batch_size, int) else exp.per_worker // (t.grad_accum_steps or 1)
    return Point(micro, t.compile, t.torch_threads or exp.cpus, t.flush_denormal,
                 resolve_precision(t.precision, CPU))


def settings_point(settings: dict[str, Any]) -> Point:
    """The grid point of the autopilot's settings dict (its report's "chosen")."""
    return Point(settings["micro_batch_size"], settings["compile"], settings["torch_threads"],
                 settings["flush_denormal"], settings["precision"])


@dataclass
class Measure:
    rates: list[float]
    compile_s: float
    steps: int

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)

    def score(self, batch: int) -> float:
        """Samples/s over a RUN_STEPS run with the compile seconds counted."""
        return RUN_STEPS * batch / (RUN_STEPS * batch / self.rate + self.compile_s)


def measure(exp: Experiment, point: Point, args: argparse.Namespace) -> Measure:
    batch = exp.cfg.train.global_batch_size
    marks = train_here(exp, point.settings(exp.per_worker), measured_enough(args.window_steps, args.window_s))
    rate, steps = marks.steady(batch)
    return Measure([rate], marks.compile_s(), steps)


def run_grid(exp: Experiment, points: list[Point], starts: list[Point], args: argparse.Namespace
             ) -> dict[Point, Measure]:
    """Every point once, then the `args.recheck` best and the starts `args.again` times more: their figure is the
    median of their readings (on a shared machine one reading of the same config varied several-fold)."""
    batch = exp.cfg.train.global_batch_size
    results: dict[Point, Measure] = {}
    started = time.perf_counter()
    for i, point in enumerate(points, 1):
        results[point] = measure(exp, point, args)
        print(f"  grid {i:3d}/{len(points)} {point.label(exp.per_worker):<58} {results[point].rate:10,.0f} "
              f"samples/s  compile {results[point].compile_s:5.1f} s", flush=True)
    top = sorted(results, key=lambda p: -results[p].score(batch))[:args.recheck]
    for _ in range(args.again):
        for point in dict.fromkeys([*top, *starts]):
            again = measure(exp, point, args)
            results[point].rates += again.rates
            print(f"  again    {point.label(exp.per_worker):<58} {again.rate:10,.0f} samples/s", flush=True)
    print(f"  grid: {len(points)} points in {time.perf_counter() - started:.0f} s; load average "
          f"{psutil.getloadavg()[0]:.1f}", flush=True)
    return results


# The autopilot run.

@dataclass
class AutopilotRun:
    rate: float  # steady state after the search: the median over the readings
    steps: int  # steps in that steady window
    table: dict[str, Any]  # the autopilot's report (docs/autopilot.md's contract)
    wall_3000: float  # the search's seconds plus the rest of a RUN_STEPS run at `rate`
    rates: list[float] = field(default_factory=list)  # every reading's steady state, this run's first

    @property
    def search_s(self) -> float:
        return float(self.table.get("search_s") or 0.0)

    @property
    def share(self) -> float:
        return self.search_s / self.wall_3000


def autopilot_run(exp: Experiment, start: list[str], args: argparse.Namespace) -> AutopilotRun:
    batch = exp.cfg.train.global_batch_size
    after = lambda marks: (found[0] if (found := marks.autopilot()) else None)  # noqa: E731
    settings = [*start, "autopilot.enabled=true", *args.autopilot_keys]
    marks = train_here(exp, settings, measured_enough(args.window_steps, args.window_s, after))
    found = marks.autopilot()
    if found is None:  # a loop without the autopilot: the run ended without its report
        return AutopilotRun(math.nan, 0, {"skipped": "no report carried an 'autopilot' table"}, math.nan)
    index, table = found
    rate, steps = marks.steady(batch, after=index)
    search_steps = int(table.get("search_steps") or 0)
    wall = float(table.get("search_s") or 0.0) + (RUN_STEPS - search_steps) * batch / rate
    return AutopilotRun(rate, steps, table, wall, [rate])


def autopilot_runs(exp: Experiment, start: list[str], args: argparse.Namespace) -> AutopilotRun:
    """The autopilot run from `start`, repeated `args.again` times more as the grid's best is: the figure compared
    with the grid's is the median of as many readings (the first run's table and search are shown)."""
    first = autopilot_run(exp, start, args)
    for _ in range(args.again):
        first.rates.append(autopilot_run(exp, start, args).rate)
    first.rate = statistics.median(first.rates)
    return first


# The experiments.

def mlp_experiment(tmp: Path, args: argparse.Namespace) -> Experiment:
    """bench/overhead.py's: MLP 64-512-512-10 on synthetic rows, global batch 256, one worker of 2 CPUs."""
    data = tmp / "mlp"
    prepare_synthetic(str(data), rows=args.rows, shards=8, features=64, classes=10)
    return Experiment("MLP 64-512-512-10, global batch 256, 1 worker x 2 CPUs", [
        *scratch_run(data, tmp / "runs"), "model.hidden=[512, 512]", "scaling.num_workers=1",
        "scaling.cpus_per_worker=2", "train.global_batch_size=256", f"train.max_steps={RUN_STEPS}",
        "train.log_every=5", "optim.warmup_steps=10"],
        poor=["train.micro_batch_size=8", "train.torch_threads=1", "train.flush_denormal=false"])


def gpt_experiment(tmp: Path, args: argparse.Namespace) -> Experiment:
    """examples/text-gpt.yaml's GPT (d_model 128, 2 layers, 4 heads) on this checkout's own text, byte tokens,
    sequences of 128, global batch 32, one worker of 2 CPUs."""
    data = tmp / "text"
    sources = sorted(glob.glob(str(ROOT / "orchestrator" / "**" / "*.py"), recursive=True))
    prepare_text([str(ROOT / "README.md"), *sources], str(data), seq_len=128)
    return Experiment("GPT d_model 128, 2 layers, seq 128, global batch 32, 1 worker x 2 CPUs", [
        *scratch_run(data, tmp / "runs"), "data.features=[tokens]", "data.label=null", "model.name=gpt",
        "model.d_model=128", "model.n_layer=2", "model.n_head=4", "scaling.num_workers=1",
        "scaling.cpus_per_worker=2", "train.global_batch_size=32", f"train.max_steps={RUN_STEPS}",
        "train.log_every=5", "optim.warmup_steps=10"],
        poor=["train.micro_batch_size=2", "train.torch_threads=1", "train.flush_denormal=false"])


EXPERIMENTS = {"mlp": mlp_experiment, "gpt": gpt_experiment}


def versus_hand(exp: Experiment, args: argparse.Namespace) -> list[bool]:
    """The autopilot's run from each start against the same settings configured by hand, measured side by side
    (one of each after the other, `1 + args.again` rounds): the chosen run's steady state after its search over the
    by-hand run's, and what its run achieved over what it predicted (the chosen candidate's samples/s in the
    search)."""
    verdicts = []
    print(f"\n{exp.name}: the autopilot's choice vs the same settings by hand", flush=True)
    for name, keys in {"poor": exp.poor, "defaults": []}.items():
        autopilot, hand, predicted, chosen = [], [], [], None
        for _ in range(1 + args.again):
            run = autopilot_run(exp, keys, args)
            chosen = run.table.get("chosen")
            autopilot.append(run.rate)
            # The prediction: the chosen candidate's samples/s in the search (its step times).
            row = next((r for r in run.table.get("rows", []) if r.get("chosen")), {})
            predicted.append(row.get("samples_per_s") or math.nan)
            hand.append(measure(exp, settings_point(chosen), args).rate if chosen else math.nan)
        ratio = statistics.median(a / h for a, h in zip(autopilot, hand, strict=True))
        achieved = statistics.median(a / p for a, p in zip(autopilot, predicted, strict=True))
        label = settings_point(chosen).label(exp.per_worker) if chosen else "-"
        print(f"  from {name}: chose {label}\n"
              f"    autopilot {', '.join(f'{r:,.0f}' for r in autopilot)} | by hand "
              f"{', '.join(f'{r:,.0f}' for r in hand)} samples/s | chosen/by hand {ratio:.3f} (target >= 0.97) | "
              f"achieved/predicted {achieved:.3f} (predicted {', '.join(f'{r:,.0f}' for r in predicted)})",
              flush=True)
        verdicts.append(ratio >= 0.97)
    return verdicts


def bench_model(exp: Experiment, args: argparse.Namespace) -> list[bool]:
    """The grid and both autopilot runs of one model; prints its table and returns whether each start met the
    targets."""
    batch = exp.cfg.train.global_batch_size
    starts = {"poor": exp.poor, "defaults": []}
    points = {name: start_point(exp, keys) for name, keys in starts.items()}
    candidates = grid(exp, list(points.values()))
    if args.quick:  # a smoke run: the starts and one more point, nothing compiled
        candidates = [*dict.fromkeys([*points.values(), Point(exp.per_worker // 2, False, 1, True, "fp32")])]
    print(f"\n{exp.name}: grid over {len(candidates)} points", flush=True)
    results = run_grid(exp, candidates, list(points.values()), args)
    # Among the points read more than once: a single lucky reading must not be the bar.
    best = max((p for p in results if len(results[p].rates) > 1), key=lambda p: results[p].score(batch))
    runs = {}
    for name, keys in starts.items():
        runs[name] = autopilot_runs(exp, keys, args)
        print(f"  autopilot from {name}: {runs[name].rate:,.0f} samples/s (median of "
              f"{', '.join(f'{r:,.0f}' for r in runs[name].rates)}) after a {runs[name].search_s:.1f} s search of "
              f"{runs[name].table.get('search_steps')} steps; what the first run measured:", flush=True)
        for row in runs[name].table.get("rows", []):
            rate = f"{row['samples_per_s']:10,.0f}" if row.get("samples_per_s") else f"{'-':>10}"
            compiled = f" compile {row['compile_s']:.1f} s" if row.get("compile_s") else ""
            print(f"    {'*' if row.get('chosen') else ' '} {row['candidate']:<58} {rate} samples/s  {row['status']}"
                  f"{compiled}", flush=True)
    return print_table(exp, points, results, best, runs)


def print_table(exp: Experiment, points: dict[str, Point], results: dict[Point, Measure], best: Point,
                runs: dict[str, AutopilotRun]) -> list[bool]:
    per_worker = exp.per_worker
    top = results[best]
    print(f"\n{exp.name} (samples/s, steady state; grid best by samples/s over a {RUN_STEPS}-step run with "
          "compile time counted)")
    print(f"grid best: {best.label(per_worker)}: {top.rate:,.0f} (median of {len(top.rates)} readings: "
          f"{', '.join(f'{r:,.0f}' for r in top.rates)}; compile {top.compile_s:.1f} s)")
    header = (f"{'start':<9}{'start/s':>9}{'grid best':>10}{'autopilot':>10}{'ap/start':>9}{'ap/best':>8}"
              f"{'search s':>9}{'share':>7}  chose")
    print(header)
    verdicts = []
    for name, point in points.items():
        start, run = results[point].rate, runs[name]
        chosen = run.table.get("chosen")
        chose = settings_point(chosen).label(per_worker) if chosen else "-"
        print(f"{name:<9}{start:>9,.0f}{top.rate:>10,.0f}{run.rate:>10,.0f}{run.rate / start:>9.2f}"
              f"{run.rate / top.rate:>8.3f}{run.search_s:>9.1f}{run.share:>7.1%}  {chose}")
        same = "the grid's best" if chosen and settings_point(chosen) == best else "not the grid's best"
        print(f"{'':<9}chose {same}; start: {point.label(per_worker)}; search {run.table.get('search_steps')} steps; "
              f"{run.steps} steps measured after it; {RUN_STEPS}-step run extrapolated: {run.wall_3000:.0f} s"
              + (f"; skipped: {run.table['skipped']}" if run.table.get("skipped") else ""))
        verdicts.append(run.rate >= 0.95 * top.rate and run.share <= 0.05)
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(EXPERIMENTS), choices=list(EXPERIMENTS))
    parser.add_argument("--rows", type=int, default=200_000, help="MLP rows (781 steps a pass at batch 256)")
    parser.add_argument("--window-steps", type=int, default=200, help="steps in a steady-state window at most")
    parser.add_argument("--window-s", type=float, default=2.0, help="seconds a window needs at least otherwise")
    parser.add_argument("--recheck", type=int, default=4, help="best grid points measured again")
    parser.add_argument("--again", type=int, default=2, help="more readings of those and of the starts")
    parser.add_argument("--quick", action="store_true", help="a smoke run: the MLP only, tiny windows")
    parser.add_argument("--by-hand", action="store_true", help="no grid: each start's autopilot run against its "
                        "choice configured by hand, side by side")
    args = parser.parse_args()
    args.autopilot_keys = []
    if args.quick:
        args.models, args.rows, args.window_steps, args.window_s = ["mlp"], 20_000, 20, 0.0
        args.recheck, args.again = 1, 1
        # A search of a step or two's time: never a compile's guessed 30 s on a slow shared machine.
        args.autopilot_keys = ["autopilot.budget=0.01"]
    print(f"autopilot vs an exhaustive grid; every run in this process, configured for {RUN_STEPS} steps; torch "
          f"{torch.__version__}, {psutil.cpu_count()} CPUs", flush=True)
    verdicts = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            verdicts += (versus_hand if args.by_hand else bench_model)(EXPERIMENTS[name](Path(tmp), args), args)
    if args.by_hand:
        print(f"\ntarget (the chosen run >= 0.97 of its settings by hand): {'holds' if all(verdicts) else 'NOT met'}")
        return
    held = all(verdicts)
    print(f"\ntargets (autopilot's steady state >= 0.95 of the grid's best; search <= 5% of a {RUN_STEPS}-step "
          f"run's wall clock, extrapolated from the measured search and steady state): "
          f"{'hold' if held else 'NOT met'} ({sum(verdicts)} of {len(verdicts)} starts)")


if __name__ == "__main__":
    main()
