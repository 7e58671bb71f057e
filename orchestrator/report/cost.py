"""The cost ledger (driver side): node-hours of a run or Tune trial times a price per node-hour,
split into productive training and the overheads around it.

The split comes from the reports: each carries its interval's wall seconds (`interval_s`) and the
shares of that interval per phase (`time/<phase>_frac`), plus when it reached the driver
(`elapsed_s` since the run started, or Tune's `time_total_s`). From those: start-up is everything
before the first interval began; wasted progress is the intervals whose steps were trained again
after a restart from an earlier checkpoint; recovery is the time from the last report before a
restart to the first interval after it (a resize, when the group came back at another world size);
shutdown is everything after the last report (teardown, final artifacts). The first report of every
(re)start carries the worker's facts (its pid among them, `RESTART_MARK`): that is how a restart is
recognised.

These are the terms of ML goodput (Google's goodput library, Meta's ETTR): the effective training
time ratio is the productive time (the optimizer steps kept) over the wall clock from the command to
the last kept step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.config import Config, CostConfig, read_yaml_mapping
from orchestrator.errors import ConfigError

# Ledger parts, in display order; they add up to the wall clock. Compute + sync is the training
# itself (`productive`); `report` is time the workers spent blocked registering checkpoints with Ray
# Train.
PARTS = ("startup", "compute", "sync", "data_wait", "eval", "checkpoint", "report", "wasted",
         "recovery", "resize", "other", "shutdown")
PRODUCTIVE = ("compute", "sync")
RESTARTS = ("wasted", "recovery", "resize")  # what failures and resizes cost
# in the first report of every (re)start only (training/worker.py's facts)
RESTART_MARK = "worker_pid"
REPORTED_AT = "at/report"  # when a Tune trial made a report (epoch seconds; tuning/trial.py)
_LABELS = {"startup": "start-up", "compute": "compute", "sync": "sync", "data_wait": "data wait",
           "eval": "eval", "checkpoint": "checkpoint", "report": "report",
           "wasted": "wasted progress", "recovery": "recovery", "resize": "resize",
           "other": "other", "shutdown": "shutdown"}
_PHASES = ("compute", "sync", "data_wait", "eval", "checkpoint", "report", "other")


@dataclass(frozen=True)
class Pricing:
    """What one node-hour costs and how many nodes the run holds (picklable: Tune ships it with the
    callback)."""

    nodes: int
    usd_per_node_hour: float | None  # None: unpriced, node-hours only
    description: str  # e.g. "2 x gpu_a100 (aws, on-demand, $32.77/h)"


def default_prices_file() -> Path:
    """cluster/prices.yaml of this checkout; on a cluster job, the one in the working directory."""
    checkout = Path(__file__).resolve().parents[2] / "cluster" / "prices.yaml"
    return checkout if checkout.is_file() else Path.cwd() / "cluster" / "prices.yaml"


def load_prices(path: str | Path | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """cloud -> node type -> prices, from cluster/prices.yaml or `path`."""
    return read_yaml_mapping(path or default_prices_file(), "price table",
                             ": set cost.prices_file, or "
                             "cost.price_per_hour instead of cost.node_type")


def resolve_pricing(config: Config, world_size: int | None = None) -> Pricing:
    """The run's nodes and price per node-hour, from the config and the price table; raises
    ConfigError naming a missing node type or price. `world_size` (elastic runs: the largest size
    seen) overrides the config's."""
    cost: CostConfig = config.cost
    s = config.scaling
    workers = world_size or (s.num_workers if isinstance(s.num_workers, int)
                             else min(s.num_workers))
    if cost.node_type is None:
        nodes = cost.nodes or 1
        price = cost.price_per_hour
        what = (f"{nodes} node{'s' * (nodes > 1)}"
                + (f" at ${price:g}/h" if price is not None else ""))
        return Pricing(nodes, price, what)
    table = load_prices(cost.prices_file).get(cost.cloud) or {}
    entry = table.get(cost.node_type)
    if not isinstance(entry, dict):
        raise ConfigError(f"cost.node_type={cost.node_type} is not in the "
                          f"{cost.cloud} price table; known: {sorted(table)}")
    if entry.get("gpus") and not s.use_gpu and cost.price_per_hour is None:
        # CPU workers (the GPU recipe checked on a laptop with scaling.use_gpu=false) do not run on
        # this GPU node: its price would bill GPUs the run never held.
        nodes = cost.nodes or 1
        return Pricing(nodes, None, f"{nodes} node{'s' * (nodes > 1)} of CPU workers, "
                                    f"not priced as {cost.node_type}, a GPU node type")
    spot = cost.spot if cost.spot is not None else entry.get("market") == "spot"
    market = "spot" if spot else "on_demand"
    price = cost.price_per_hour if cost.price_per_hour is not None else entry.get(market)
    if price is None:
        raise ConfigError(f"the price table has no {market} price for {cost.cloud} "
                          f"{cost.node_type}: add it or set cost.price_per_hour")
    nodes = cost.nodes or _nodes_for(workers, s.use_gpu, s.cpus_per_worker, entry)
    market_name = "spot" if spot else "on-demand"
    return Pricing(nodes, float(price), f"{nodes} x {cost.node_type} ({cost.cloud}, "
                                        f"{market_name}, ${price:g}/h)")


def largest_world(history: list[dict[str, Any]]) -> int | None:
    """The largest worker group the reports saw: an elastic run is billed at it (None before the
    first report)."""
    return max((int(r["world_size"]) for r in history if "world_size" in r), default=None)


def _nodes_for(workers: int, use_gpu: bool, cpus_per_worker: float, entry: dict[str, Any]) -> int:
    if use_gpu and entry.get("gpus"):
        return max(1, math.ceil(workers / entry["gpus"]))  # one GPU per worker
    cpus = entry.get("cpus") or 1
    return max(1, math.ceil(workers * cpus_per_worker / cpus))


@dataclass
class Ledger:
    wall_s: float
    pricing: Pricing
    seconds: dict[str, float] = field(default_factory=dict)  # per part; they sum to wall_s

    @property
    def node_hours(self) -> float:
        return self.pricing.nodes * self.wall_s / 3600

    @property
    def usd(self) -> float | None:
        price = self.pricing.usd_per_node_hour
        return None if price is None else self.node_hours * price

    @property
    def ettr(self) -> float:
        """Effective training time ratio: productive seconds over the wall clock up to the last kept
        step (the shutdown after it is not training time lost)."""
        until_done = self.wall_s - self.seconds.get("shutdown", 0.0)
        return (sum(self.seconds.get(p, 0.0) for p in PRODUCTIVE) / until_done
                if until_done > 0 else 0.0)

    def frac(self, part: str) -> float:
        if part == "productive":
            return sum(self.frac(p) for p in PRODUCTIVE)
        return self.seconds.get(part, 0.0) / self.wall_s if self.wall_s > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        """MLflow metrics: cost/usd, cost/productive_usd, cost/overhead_usd, cost/node_hours,
        cost/<part>_frac."""
        out = {"cost/wall_s": self.wall_s, "cost/node_hours": self.node_hours,
               "cost/nodes": float(self.pricing.nodes)}
        out |= {f"cost/{part}_frac": self.frac(part) for part in (*PARTS, "productive")}
        out["cost/ettr"] = self.ettr
        usd = self.usd
        if usd is not None:
            out |= {"cost/usd": usd,
                    "cost/usd_per_node_hour": float(self.pricing.usd_per_node_hour or 0.0),
                    "cost/productive_usd": usd * self.frac("productive"),
                    "cost/overhead_usd": usd * (1 - self.frac("productive"))}
        return out

    def time_line(self) -> str:
        """'time: 31.2 s | start-up 40% | compute 31% | sync 4% | data wait 2% | ... | shutdown 6%':
        the wall clock from the command's start to its end, every part of it."""
        shares = [f"{_LABELS[p]} {self.frac(p):.0%}" for p in PARTS
                  if p in PRODUCTIVE or self.frac(p) >= 0.005]
        return " | ".join([f"time: {self.wall_s:.1f} s", *shares])

    def line(self) -> str:
        """'cost: $0.0183 for 0.0022 node-hours (2 x gpu_a100 ...) | productive 41% ($0.0075)'"""
        usd = self.usd
        priced = (f"cost: ${usd:.4f}" if usd is not None
                  else "cost: unpriced (set cost.node_type or cost.price_per_hour)")
        head = (f"{priced} for {self.node_hours:.4f} node-hours ({self.pricing.description}, "
                f"{self.wall_s:.0f} s)")
        productive = f"productive {self.frac('productive'):.0%}"
        if usd is not None:
            productive += f" (${usd * self.frac('productive'):.4f})"
        return f"{head} | {productive} | ETTR {self.ettr:.0%}"


def build_ledger(history: list[dict[str, Any]], wall_s: float, pricing: Pricing, failures: int = 0,
                 elapsed_key: str = "elapsed_s") -> Ledger:
    """Split `wall_s` by the reports (see the module docstring). A report whose step is reported
    again later (work redone after a restart) counts as restart time, not as its phases."""
    seconds = dict.fromkeys(PARTS, 0.0)
    timed = [r for r in history if elapsed_key in r and "interval_s" in r]
    if not timed:
        seconds["startup"] = wall_s
        return Ledger(wall_s, pricing, seconds)
    last_index = {int(r["step"]): i for i, r in enumerate(timed)}  # the kept report of every step
    kept = [r for i, r in enumerate(timed) if last_index[int(r["step"])] == i]
    first, last = timed[0], timed[-1]
    seconds["startup"] = max(0.0, first[elapsed_key] - first["interval_s"])
    for report in kept:
        for phase in _PHASES:
            seconds[phase] += report.get(f"time/{phase}_frac", 0.0) * report["interval_s"]
    seconds["wasted"] = sum(r["interval_s"] for i, r in enumerate(timed)
                            if last_index[int(r["step"])] != i)
    # Between two reports, what the later one's interval does not cover: report transport in a
    # healthy run; a restart's recovery (or resize) before the first report of a (re)start.
    # Histories without the restart mark bill every gap of a run that failed or redid steps as
    # recovery.
    marked = any(RESTART_MARK in r for r in timed)
    unmarked = "recovery" if not marked and (failures or len(kept) < len(timed)) else "other"
    for before, after in zip(timed, timed[1:], strict=False):
        gap = max(0.0, after[elapsed_key] - before[elapsed_key] - after["interval_s"])
        if RESTART_MARK in after:
            resized = before.get("world_size", after.get("world_size")) != after.get("world_size")
            seconds["resize" if resized else "recovery"] += gap
        else:
            seconds[unmarked] += gap
    seconds["shutdown"] = max(0.0, wall_s - last[elapsed_key])
    # Clock skew between worker intervals and driver arrivals can overshoot by a little: keep the
    # sum = wall_s.
    total = sum(seconds.values())
    if total > wall_s > 0:
        seconds = {k: v * wall_s / total for k, v in seconds.items()}
    else:
        seconds["other"] += wall_s - total
    return Ledger(wall_s, pricing, seconds)


def attempt_record(began: float, history: list[dict[str, Any]], ended: float) -> dict[str, Any]:
    """One driver attempt of a run (a command, or its `--resume`) as the ledger needs it: when the
    command began and when it was last seen (epoch seconds), and its reports' steps, intervals,
    phase shares and restart marks, their arrival made absolute. Kept in storage beside the run
    (runs.ATTEMPTS_DIR) so a later `--resume` can bill the whole run; plain JSON."""
    keep = ("step", "interval_s", "world_size", RESTART_MARK)
    reports = [{k: v for k, v in r.items()
                if k in keep or (k.startswith("time/") and k.endswith("_frac"))}
               | {"at": began + r["elapsed_s"]}
               for r in history if "elapsed_s" in r and "interval_s" in r]
    return {"began": began, "ended": ended, "reports": reports}


def ledger_across_attempts(attempts: list[dict[str, Any]], pricing: Pricing) -> Ledger:
    """The run's ledger over every attempt: the commands' own time, each from its start to its end,
    on one clock with the time between commands taken out (nothing of the run ran then: the user had
    not resumed it yet). Steps an attempt trained again after an earlier one had reported them are
    wasted progress; from one attempt's last report to its end (the driver's death) and the next
    one's start-up to its first interval is recovery."""
    ordered = sorted(attempts, key=lambda a: a["began"])
    history: list[dict[str, Any]] = []
    t0, seen_to, idle = ordered[0]["began"], ordered[0]["began"], 0.0
    for attempt in ordered:
        idle += max(0.0, attempt["began"] - seen_to)  # no command ran: not the run's time
        seen_to = max(seen_to, attempt["ended"])
        history += [r | {"elapsed_s": r["at"] - t0 - idle} for r in attempt["reports"]]
    return build_ledger(history, seen_to - t0 - idle, pricing)


def study_metrics(ledgers: list[Ledger]) -> dict[str, float]:
    """Summed over a study's trials: what the trials held (concurrent trials each count their own
    nodes)."""
    if not ledgers:
        return {}
    wall = sum(ledger.wall_s * ledger.pricing.nodes for ledger in ledgers)
    out = {"cost/node_hours": sum(ledger.node_hours for ledger in ledgers),
           "cost/trials": float(len(ledgers))}
    if wall > 0:
        for part in PARTS:
            out[f"cost/{part}_frac"] = sum(ledger.seconds.get(part, 0.0) * ledger.pricing.nodes
                                           for ledger in ledgers) / wall
        out["cost/productive_frac"] = sum(out[f"cost/{part}_frac"] for part in PRODUCTIVE)
    usds = [ledger.usd for ledger in ledgers]
    if all(u is not None for u in usds):
        total = sum(u for u in usds if u is not None)
        out |= {"cost/usd": total,
                "cost/productive_usd": total * out.get("cost/productive_frac", 0.0),
                "cost/overhead_usd": total * (1 - out.get("cost/productive_frac", 0.0))}
    return out
