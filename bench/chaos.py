"""Goodput under failure, measured in one invocation on a 2-node local Ray cluster (`ray start` head + one worker
node, each holding one of the run's 2 training workers; MLP 64-1024-1024-10, AdamW, global batch 256):

1. the training run without faults, then the same run (same steps) under faults: a training worker SIGKILLed by
   PID every --kill-every seconds, and once, in place of a kill, the worker node drained with notice as a spot
   reclaim (`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`): a replacement node is started on the notice, as
   an autoscaler does, and the drained one is killed at its deadline;
2. Ray Train's own floor: an empty function on 2 workers, a worker SIGKILLed, seconds until it runs again.

It prints each run's wall clock and ETTR (the product's cost ledger), every badput bucket of the faulty run (they
sum to its wall clock), for each fault the seconds to the first training step again, split into stages by the
restarted workers' `at/*` facts, the steps redone, whether the final weights equal the clean run's bit for bit,
the global batch and loss curves around the drain, and fault -> first step over Ray's floor (target <= 1.5x).
With --grid, instead: the same faulty run (kills only) once per checkpoint interval given, fixed ones and `auto`,
side by side in one invocation: wall clock and ETTR of each, and how far `auto` is from the best fixed one.

Product defaults but for the settings the header prints (a worker per node, one torch thread each, unlimited
restarts, the interval under test); no environment variable set (the README's set-up has RAY_AUTH_MODE=token, as
`ray start` wants it); the nodes it started are killed by PID at the end, also on error or Ctrl+C.

    .venv/bin/python bench/chaos.py [--minutes 10 --kill-every 120 --drain-notice 30 --every auto]
    .venv/bin/python bench/chaos.py --grid 50,200,800,auto --minutes 3 --kill-every 45
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# `ray start` turns token auth on where ~/.ray/auth_token exists (the product's warm cluster makes one): this process
# then joins with the token, as the product's error tells a user to (cluster/README.md). Set before Ray is imported.
if "RAY_AUTH_MODE" not in os.environ and (Path.home() / ".ray" / "auth_token").exists():
    os.environ["RAY_AUTH_MODE"] = "token"

import psutil  # noqa: E402
import torch  # noqa: E402
from _common import free_port, scratch_run, train_workers, wait_for

from orchestrator import load_config, train
from orchestrator.cluster.local import train_environment
from orchestrator.config import Config, config_from_dict, to_dict
from orchestrator.report.cost import PARTS, RESTART_MARK
from orchestrator.run.result import TrainResult, checkpoint_interval_line
from orchestrator.training.checkpoint import load_state
from pipelines.prepare import prepare_synthetic

RAY = Path(sys.executable).with_name("ray")
CPUS_PER_WORKER = 2  # one training worker per node: no node holds two
GLOBAL_BATCH = 256
# The restarted group's marks (rank 0's), in order: the stage each one ends.
LAST_IN = "last worker in, after rank 0"
STAGES = (("at/worker", "detection + group restart"), ("at/checkpoint_read", "imports + checkpoint read"),
          ("at/checkpoint_loaded", "model set-up + restore"), ("at/loop", "data shards"),
          ("at/first_batch", "first batch"), ("at/first_step", "first step"))


class Cluster:
    """A head and worker nodes as `ray start --block` processes of this machine, each killed with its process tree
    by PID (never `ray stop`: other Ray instances may run here)."""

    def __init__(self, root: Path) -> None:
        self.root, self.gcs = root, f"127.0.0.1:{free_port()}"
        self.started: list[subprocess.Popen[bytes]] = []  # every `ray start` process, the head first
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}  # node id -> its `ray start` process (killed ones too)
        self.head = ""
        # Nodes started later (the replacement) get this environment, not what a run sets in this process meanwhile.
        self.env = dict(os.environ)

    def start(self, head_cpus: int) -> None:
        """The head node (with the dashboard: Ray's state API), joined by this process."""
        import ray

        head = self._launch(["--head", "--port", self.gcs.split(":")[1], "--num-cpus", str(head_cpus),
                             "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
                             "--dashboard-port", str(free_port()), "--ray-client-server-port", str(free_port()),
                             "--temp-dir", str(self.root)])
        wait_for(lambda: socket.create_connection(("127.0.0.1", int(self.gcs.split(":")[1])), timeout=1),
                 "the Ray head", 120)
        ray.init(address=self.gcs, logging_config=ray.LoggingConfig(log_level="WARNING"))
        self.head = self._register(head)

    def add_node(self, cpus: int) -> str:
        """Start a worker node; its node id once it joined."""
        return self._register(self._launch(["--address", self.gcs, "--num-cpus", str(cpus)]))

    def _launch(self, args: list[str]) -> subprocess.Popen[bytes]:
        common = ["--block", "--disable-usage-stats", "--min-worker-port", "0", "--max-worker-port", "0",
                  "--dashboard-agent-listen-port", str(free_port()), "--metrics-export-port", str(free_port())]
        self.started.append(subprocess.Popen([str(RAY), "start", *args, *common], env=self.env,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                             start_new_session=True))
        return self.started[-1]

    def _register(self, process: subprocess.Popen[bytes]) -> str:
        import ray

        def joined() -> str | None:
            new = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - set(self.nodes)
            return next(iter(new), None)

        node = wait_for(joined, "the new node", 120)
        self.nodes[node] = process
        return node

    def kill_node(self, node: str) -> None:
        """The node is lost: its `ray start` process and every process under it SIGKILLed."""
        kill_tree(self.nodes[node])

    def stop(self, keep_logs: bool = False) -> None:
        for process in reversed(self.started):  # the worker nodes, then the head
            kill_tree(process)
        if keep_logs:
            print(f"Ray's logs kept in {self.root}/session_latest/logs", file=sys.stderr)
        else:
            shutil.rmtree(self.root, ignore_errors=True)


def kill_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process we started and everything under it (listed first, so that none is reparented away)."""
    if process.poll() is not None:  # gone already (its pid may be another process's by now)
        return
    for proc in [*psutil.Process(process.pid).children(recursive=True), psutil.Process(process.pid)]:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait(timeout=30)


def settings(every: int | str) -> list[str]:
    """What the runs set beyond the data and the run's length: the model, and where they leave the defaults."""
    return ["scaling.num_workers=2", f"scaling.cpus_per_worker={CPUS_PER_WORKER}",  # a worker per node
            "train.torch_threads=1",  # one thread per worker: 2 workers on this 2-core machine
            f"train.global_batch_size={GLOBAL_BATCH}", "model.hidden=[1024, 1024]",
            f"checkpoint.every={every}", "failure.max_failures=-1"]  # a long run on spot nodes restarts as needed


def config(data: Path, runs: Path, steps: int, every: int | str) -> Config:
    return load_config(None, [*scratch_run(data, runs), *settings(every), f"train.max_steps={steps}"])


@dataclass
class Fault:
    kind: str  # kill | drain
    at: float  # epoch seconds: the SIGKILL, or the drain notice
    lost_at: float | None = None  # a drain: when the node was killed (its deadline)
    restart: dict[str, Any] = field(default_factory=dict)  # the first report after it


def reports_since(runs: Path, since: float) -> list[dict[str, Any]]:
    """The run's reports that reached the driver after `since`, from its attempt record in storage
    (orchestrator/run/place.py)."""
    reports = []
    for record in runs.glob("*/attempts/*.json"):
        try:
            reports += [r for r in json.loads(record.read_text())["reports"] if r["at"] > since]
        except (OSError, ValueError, KeyError):  # being rewritten
            pass
    return reports


def inject_faults(cluster: Cluster, runs: Path, run: threading.Thread, started: float, every_s: float,
                  notice_s: float | None) -> list[Fault]:
    """A fault every `every_s` seconds from `started` (the 2nd one a drain with `notice_s` seconds of notice, when
    given), each once the run trains again after the previous one (a restart reported), until the run ends."""
    faults: list[Fault] = []
    while run.is_alive():
        due = started + every_s * (len(faults) + 1)
        previous = faults[-1].lost_at or faults[-1].at if faults else started
        while run.is_alive() and (time.time() < due or not any(RESTART_MARK in r or not faults
                                                                 for r in reports_since(runs, previous))):
            time.sleep(0.5)
        if not run.is_alive():
            break
        workers = sorted(train_workers(cluster.gcs), key=lambda w: w.pid)
        if not workers:  # the run is ending
            continue
        if len(faults) == 1 and notice_s is not None:
            node = next(w.node_id for w in workers if w.node_id != cluster.head)
            fault = Fault("drain", time.time())
            subprocess.run([str(RAY), "drain-node", "--address", cluster.gcs, "--node-id", node, "--reason",
                            "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim (bench/chaos.py)",
                            "--deadline-remaining-seconds", str(round(notice_s))], check=True, capture_output=True,
                           timeout=60)
            cluster.add_node(CPUS_PER_WORKER)  # the replacement, as an autoscaler starts one on the notice
            time.sleep(max(0.0, fault.at + notice_s - time.time()))
            fault.lost_at = time.time()
            cluster.kill_node(node)  # reclaimed at the deadline
        else:
            fault = Fault("kill", time.time())
            os.kill(workers[len(faults) % len(workers)].pid, signal.SIGKILL)
        faults.append(fault)
        print(f"  fault {len(faults)}: {fault.kind} at {fault.at - started:.0f} s", flush=True)
    return faults


def in_background(cfg: Config, address: str) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = train(cfg, address=address, verbose=False)
        except BaseException as exc:  # re-raised by the main thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def _floor_fn(config: dict[str, Any]) -> None:
    """Ray's floor: mark the entry, then wait until the bench says stop."""
    marks = Path(config["marks"])
    (marks / f"{os.getpid()}.start").write_text(repr(time.time()))
    while not (marks / "stop").exists():
        time.sleep(0.05)


def ray_floor(cfg: Config, root: Path, kills: int) -> list[float]:
    """Seconds from a worker's SIGKILL to the empty function running again on both workers (Ray Train V2,
    FailureConfig(max_failures), the product's Ray Train settings and worker size), `kills` times."""
    import ray.train
    from ray.train.torch import TorchTrainer

    marks = root / "marks"
    marks.mkdir(parents=True)

    def started(seen: set[int]) -> dict[int, float] | None:
        """The group that entered the function since the kills of `seen`: pid -> when, once both ranks did."""
        group = {int(p.stem): float(p.read_text()) for p in marks.glob("*.start") if p.stat().st_size}
        group = {pid: t for pid, t in group.items() if pid not in seen}
        return group if len(group) == 2 else None

    seconds = []
    with train_environment(cfg, private_cluster=False):
        trainer = TorchTrainer(_floor_fn, train_loop_config={"marks": str(marks)},
                               scaling_config=ray.train.ScalingConfig(
                                   num_workers=2, resources_per_worker={"CPU": CPUS_PER_WORKER}),
                               run_config=ray.train.RunConfig(
                                   name="floor", storage_path=str(root / "runs"),
                                   failure_config=ray.train.FailureConfig(max_failures=kills)))
        thread = threading.Thread(target=trainer.fit, daemon=True)
        thread.start()
        seen: set[int] = set()
        group = wait_for(lambda: started(seen), "the empty group", 300)
        for _ in range(kills):
            seen = seen | set(group)
            killed_at = time.time()
            os.kill(max(group), signal.SIGKILL)
            group = wait_for(lambda: started(seen), "the restarted group", 300)  # noqa: B023 - called right here
            seconds.append(max(group.values()) - killed_at)  # running again on both workers
        (marks / "stop").touch()
        thread.join(timeout=120)
    return seconds


def weights(result: TrainResult) -> dict[str, torch.Tensor]:
    state = load_state(result.checkpoint_path)  # type: ignore[arg-type]
    return {k: v for k, v in state["model"].items() if not k.endswith("_extra_state")}


def resumed_from(report: dict[str, Any]) -> int:
    """The step a restart resumed from: its first report's step less the steps of its interval."""
    return report["step"] - round(report["samples_per_s"] * report["interval_s"] / GLOBAL_BATCH)


def attach_restarts(history: list[dict[str, Any]], faults: list[Fault]) -> list[Fault]:
    """Each fault with the first report of the restart after it (and the last step reported before that)."""
    starts = [i for i, r in enumerate(history) if RESTART_MARK in r][1:]
    for fault in faults:
        index = next((i for i in starts if history[i]["at/worker"] > (fault.lost_at or fault.at)), None)
        if index is None:
            print(f"the {fault.kind} at {fault.at:.0f} came as the run ended: no restart after it")
        else:
            fault.restart = history[index] | {"before": max(r["step"] for r in history[:index])}
    return [f for f in faults if f.restart]


def print_ledgers(clean: TrainResult, faulty: TrainResult) -> None:
    ledgers = {name: result.run_cost or result.cost for name, result in (("clean", clean), ("faulty", faulty))}
    for name, result in (("clean", clean), ("faulty", faulty)):
        print(f"{name:6} run: wall clock {ledgers[name].wall_s:6.1f} s | ETTR {ledgers[name].ettr:.3f} | "
              f"{result.metrics['step']} steps | {sum(RESTART_MARK in r for r in result.history) - 1} restarts")
    faulty_ledger = ledgers["faulty"]
    print(f"ETTR faulty / clean: {faulty_ledger.ettr / ledgers['clean'].ettr:.3f} (target >= 0.85)")
    for name, ledger in ledgers.items():
        print(f"{name} run's buckets (s): " + " | ".join(f"{p} {ledger.seconds[p]:.1f}" for p in PARTS))
    total = sum(faulty_ledger.seconds.values())
    off = abs(total - faulty_ledger.wall_s) / faulty_ledger.wall_s
    print(f"  their sum {total:.1f} s vs the wall clock {faulty_ledger.wall_s:.1f} s: {off:.2%} apart "
          f"({'within' if off <= 0.02 else 'NOT within'} 2%)")


def print_faults(faults: list[Fault], began: float) -> list[float]:
    """One row per fault: when, the step resumed from, steps redone, seconds to the first step again and per stage
    (from the restarted group's `at/*` marks, rank 0's). Returns the kills' seconds to the first step."""
    def row(seconds: list[float]) -> str:
        return " | ".join(f"{s:{len(name)}.1f}" for s, (_, name) in zip(seconds, STAGES, strict=True))

    # Beside the stages (rank 0's): how long after rank 0 the group's last worker entered. Rank 0's set-up waits for
    # it in the model's first broadcast, so a late worker (a replacement node's) shows as "model set-up" there.
    print(f"{'fault':13}{'at (s)':>7}{'resumed':>8}{'redone':>7}{'-> step (s)':>12}   "
          + " | ".join(name for _, name in STAGES) + f" || {LAST_IN}")
    kills, stages = [], []
    for n, fault in enumerate(faults, 1):
        r, began_stage = fault.restart, fault.lost_at or fault.at
        seconds = []
        for key, _ in STAGES:  # no checkpoint to load (a restart from step 0): those stages take 0 s
            seconds.append(r.get(key, began_stage) - began_stage)
            began_stage = r.get(key, began_stage)
        total = r["at/first_step"] - (fault.lost_at or fault.at)
        if fault.kind == "kill":
            kills.append(total)
            stages.append(seconds)
        redone = max(0, r["before"] - resumed_from(r))
        late = r.get("at/last_worker", r["at/worker"]) - r["at/worker"]
        print(f"{n} {fault.kind:11}{fault.at - began:7.0f}{resumed_from(r):8d}{redone:7d}{total:12.1f}   "
              + row(seconds) + f" || {late:{len(LAST_IN)}.1f}")
        if fault.lost_at:
            print(f"  (the drain: notice at {fault.at - began:.0f} s, node lost {fault.lost_at - fault.at:.0f} s "
                  f"later; from the notice to the first step again {r['at/first_step'] - fault.at:.1f} s)")
    if stages:
        medians = [statistics.median(column) for column in zip(*stages, strict=True)]
        print(f"{'kills, median':35}{statistics.median(kills):12.1f}   " + row(medians))
    return kills


def print_drain(clean: TrainResult, faulty: TrainResult, drain: Fault) -> None:
    r = drain.restart
    saved = [x["step"] for x in faulty.history if x.get("drain_checkpoint")]
    first = next(x for x in clean.history if "global_batch" in x)
    print(f"drain: its checkpoint at step {saved[0] if saved else None}, resumed from {resumed_from(r)}; global batch "
          f"{first['global_batch']} clean, {r['global_batch']} after it ({r['world_size']} workers x micro-batch "
          f"{r['micro_batch_size']} x accumulation {r['grad_accum_steps']})")
    clean_loss = {x["step"]: x["train_loss"] for x in clean.history}
    faulty_loss = {x["step"]: x["train_loss"] for x in faulty.history}  # the kept (last) report of each step
    every = faulty.config.train.log_every
    print("  step   clean loss  faulty loss")
    for step in range(resumed_from(r) - 2 * every, resumed_from(r) + 4 * every + 1, every):
        if step in clean_loss and step in faulty_loss:
            print(f"  {step:5d}  {clean_loss[step]:11.4e}  {faulty_loss[step]:11.4e}")


def analyse(clean: TrainResult, faulty: TrainResult, faults: list[Fault], began: float, floor: list[float]) -> None:
    faults = attach_restarts(faulty.history, faults)
    print_ledgers(clean, faulty)
    kills = print_faults(faults, began)
    if kills and floor:
        ours, theirs = statistics.median(kills), statistics.median(floor)
        print(f"Ray Train's floor, kill -> the empty function running again on both workers: "
              f"{', '.join(f'{s:.1f}' for s in floor)} s (median {theirs:.1f} s)")
        print(f"ours, kill -> first step again: median {ours:.1f} s = {ours / theirs:.2f}x the floor (target <= 1.5x)")
    a, b = weights(clean), weights(faulty)
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"final weights bitwise equal to the clean run's: {'yes' if same else 'NO'} ({len(a)} tensors)")
    for drain in [f for f in faults if f.kind == "drain"]:
        print_drain(clean, faulty, drain)


def every_arg(value: str) -> int | str:
    return value if value == "auto" else int(value)


def under_faults(cluster: Cluster, cfg: Config, inject: Callable[[threading.Thread, float], list[Any]],
                 what: str) -> tuple[TrainResult, list[Any], float]:
    """`cfg` trained in the background while `inject(run, began)` brings its faults until the run ends: its result,
    the faults and when it began."""
    began = time.time()
    thread, outcome = in_background(cfg, cluster.gcs)
    faults = inject(thread, began)
    thread.join()
    if "error" in outcome:
        raise RuntimeError(f"the {what} run failed: {outcome['error'].__context__!r}") from outcome["error"]
    print(f"{what} run done: {outcome['result'].cost.wall_s:.0f} s", flush=True)
    return outcome["result"], faults, began


def faulty_run(cluster: Cluster, cfg: Config, runs: Path, kill_every: float, drain_notice: float | None
               ) -> tuple[TrainResult, list[Fault], float]:
    """The run under kills (and a drain with `drain_notice`): its result, the faults and when it began."""
    return under_faults(cluster, cfg, lambda run, began: inject_faults(cluster, runs, run, began, kill_every,
                                                                       drain_notice), "faulty")


def print_grid(results: dict[int | str, TrainResult]) -> None:
    """Wall clock and ETTR of the same faulty run at each checkpoint interval, and auto against the best fixed."""
    print(f"{'checkpoint.every':>16}  {'wall s':>7}  {'ETTR':>6}  {'restarts':>8}  {'checkpoint s':>12}  "
          f"{'wasted s':>8}  {'recovery s':>10}  interval used")
    for every, result in results.items():
        ledger = result.run_cost or result.cost
        restarts = sum(RESTART_MARK in r for r in result.history) - 1
        used = checkpoint_interval_line(result.config, result.history) or ""
        print(f"{every!s:>16}  {ledger.wall_s:7.1f}  {ledger.ettr:6.3f}  {restarts:8d}  "
              f"{ledger.seconds['checkpoint']:12.1f}  {ledger.seconds['wasted']:8.1f}  "
              f"{ledger.seconds['recovery']:10.1f}  {used}")
    fixed = {e: r for e, r in results.items() if e != "auto"}
    if "auto" in results and fixed:
        best = max(fixed, key=lambda e: (fixed[e].run_cost or fixed[e].cost).ettr)
        best_ettr = (fixed[best].run_cost or fixed[best].cost).ettr
        auto_ettr = (results["auto"].run_cost or results["auto"].cost).ettr
        print(f"auto: ETTR {auto_ettr:.3f} vs the best fixed interval's ({best} steps) {best_ettr:.3f}: "
              f"{auto_ettr / best_ettr:.3f}x (target >= 0.90, within 10%)")


def replica_kills(gcs: str, run: threading.Thread, started: float, every_s: float) -> list[float]:
    """failure.mode=replicas: a training worker SIGKILLed every `every_s` seconds from `started` (the two in turn,
    as in the restart run; no drain: a replica group's node loss is not handled by Ray Train 2.60's replacement),
    each once Ray has replaced the previous one. Returns when each kill was."""
    kills: list[float] = []
    killed: set[int] = set()
    while run.is_alive():
        due = started + every_s * (len(kills) + 1)
        while run.is_alive() and (time.time() < due or len({w.pid for w in train_workers(gcs)} - killed) < 2):
            time.sleep(0.5)
        workers = sorted(train_workers(gcs), key=lambda w: w.pid)
        if not run.is_alive() or len(workers) < 2:
            continue
        kills.append(time.time())
        killed.add(workers[len(kills) % 2].pid)
        os.kill(workers[len(kills) % 2].pid, signal.SIGKILL)
        print(f"  replicas fault {len(kills)}: kill at {kills[-1] - started:.0f} s", flush=True)
    return kills


def whole_again(reports: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first report with both replicas live after one with a single replica (the group was broken, then whole)."""
    alone = next((i for i, r in enumerate(reports) if r.get("replicas/live") == 1), None)
    return None if alone is None else next((r for r in reports[alone:] if r.get("replicas/live") == 2), None)


def compare_replicas(cluster: Cluster, tmp: Path, clean_cfg: Config, clean: TrainResult, kill_every: float,
                     restart: TrainResult | None) -> None:
    """The clean run's config under failure.mode=replicas, its workers killed every `kill_every` seconds: ETTR,
    and per kill the steps the survivor made while the killed replica was replaced, the seconds until the group was
    whole again (at report granularity), the steps lost (not committed, or redone); beside the restart run's."""
    tree = to_dict(clean_cfg)
    tree["failure"]["mode"], tree["storage"]["path"] = "replicas", str(tmp / "replicas")
    result, kills, began = under_faults(cluster, config_from_dict(tree),
                                        lambda run, began: replica_kills(cluster.gcs, run, began, kill_every),
                                        "replicas")
    # The full reports (the attempt record keeps only what the ledger needs), their arrival made absolute.
    history = [r | {"at": began + r["elapsed_s"]} for r in result.history if "elapsed_s" in r]
    print(f"replicas run: wall clock {result.cost.wall_s:6.1f} s | ETTR {result.cost.ettr:.3f} | "
          f"{result.metrics['step']} steps | {len(kills)} kills | ETTR replicas / clean "
          f"{result.cost.ettr / (clean.run_cost or clean.cost).ettr:.3f}"
          + (f" (restart / clean {(restart.run_cost or restart.cost).ettr / (clean.run_cost or clean.cost).ettr:.3f})"
             if restart is not None else ""))
    usual = statistics.median(r["interval_s"] for r in history)
    print(f"{'kill':5}{'at (s)':>7}{'steps alone':>12}{'-> whole (s)':>13}{'longest report interval (s)':>29}"
          f"   (usual {usual:.2f} s)")
    for n, killed in enumerate(kills, 1):
        after = [r for r in history if r["at"] > killed]
        before = max((r["step"] for r in history if r["at"] <= killed), default=0)
        back = whole_again(after)
        broken = [r for r in after if back is None or r["at"] <= back["at"]]
        alone = [r["step"] for r in broken if r.get("replicas/live") == 1]
        print(f"{n:<5}{killed - began:7.0f}{(max(alone) - before if alone else 0):12d}"
              f"{(back['at'] - killed if back else float('nan')):13.1f}"
              f"{max((r['interval_s'] for r in broken), default=float('nan')):29.2f}")
    dropped = sum(max(0, b.get("replicas/dropped_steps", 0) - a.get("replicas/dropped_steps", 0))
                  for a, b in zip(history, history[1:], strict=False))  # a replaced rank 0 counts from 0 again
    print(f"steps lost to {len(kills)} kills: {dropped} not committed (each done again at once, its rows and LR "
          f"the same), {steps_back(history)} reported again"
          + (f"; the restart run: {steps_back(restart.history)} redone" if restart is not None else ""))


def steps_back(history: list[dict[str, Any]]) -> int:
    """Steps reported again: each time the step counter goes back (a restart from a checkpoint), by how much."""
    return sum(max(0, a["step"] - b["step"]) for a, b in zip(history, history[1:], strict=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="training per run")
    parser.add_argument("--kill-every", type=float, default=120.0, help="seconds between faults")
    parser.add_argument("--drain-notice", type=int, default=30.0, help="seconds from the drain to the node's loss")
    parser.add_argument("--every", type=every_arg, default="auto", help="checkpoint.every (steps or auto, the default)")
    parser.add_argument("--grid", type=lambda v: [every_arg(e) for e in v.split(",")], default=None,
                        help="checkpoint.every values to compare under the same kills (no drain), e.g. 50,200,auto")
    parser.add_argument("--floor-kills", type=int, default=3)
    parser.add_argument("--mode", choices=("restart", "replicas", "both"), default="restart",
                        help="the faulty run's failure.mode: restart (from the last checkpoint), replicas (torchft "
                             "replica groups, kills only), or both runs")
    args = parser.parse_args()
    import ray

    print("settings beyond the product's defaults: " + " ".join(settings(args.every if args.grid is None else
                                                                          "<each of the grid>")), flush=True)
    tmp, failed = Path(tempfile.mkdtemp(prefix="chaos")), True
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="rc", dir="/tmp")))  # short: Ray's socket paths are limited
    try:
        prepare_synthetic(str(tmp / "data"), rows=50_000, shards=8, features=64, classes=10)
        cluster.start(head_cpus=CPUS_PER_WORKER + 1)  # + 1 for Ray Data's tasks
        cluster.add_node(CPUS_PER_WORKER)
        # A first short run: warms the cluster up and gives the step rate that sets the runs' length.
        warm = train(config(tmp / "data", tmp / "warm", 200, 100), address=cluster.gcs, verbose=False)
        training_s = warm.cost.wall_s - warm.cost.seconds["startup"] - warm.cost.seconds["shutdown"]
        log_every = warm.config.train.log_every
        steps = max(log_every, round(200 / training_s * args.minutes * 60 / log_every) * log_every)
        print(f"{steps} steps per run ({200 / training_s:.1f} steps/s in the warm-up run)", flush=True)
        if args.grid is not None:
            results = {}
            for every in args.grid:
                print(f"checkpoint.every={every}:", flush=True)
                results[every], _, _ = faulty_run(cluster, config(tmp / "data", tmp / f"grid-{every}", steps, every),
                                                  tmp / f"grid-{every}", args.kill_every, None)
                print_grid({every: results[every]})  # each row as it comes: a long grid may be cut short
            print_grid(results)
        else:
            clean = train(config(tmp / "data", tmp / "clean", steps, args.every), address=cluster.gcs,
                          verbose=False)
            print(f"clean run done: {clean.cost.wall_s:.0f} s", flush=True)
            faulty = None
            if args.mode != "replicas":
                faulty_cfg = config(tmp / "data", tmp / "faulty", steps, args.every)
                faulty, faults, began = faulty_run(cluster, faulty_cfg, tmp / "faulty", args.kill_every,
                                                   args.drain_notice)
                floor = ray_floor(faulty_cfg, tmp / "floor", args.floor_kills)
                analyse(clean, faulty, faults, began, floor)
            if args.mode != "restart":
                compare_replicas(cluster, tmp, clean.config, clean, args.kill_every, faulty)
        failed = False
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop(keep_logs=failed)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
