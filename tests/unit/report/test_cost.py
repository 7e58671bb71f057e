"""The cost ledger against hand-made report histories, and pricing from the price table."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator.config import load_config
from orchestrator.errors import ConfigError
from orchestrator.report.cost import PARTS, Ledger, Pricing, build_ledger, largest_world, resolve_pricing, study_metrics

PRICED = Pricing(nodes=2, usd_per_node_hour=3.6, description="2 x test")


def report(step: int, elapsed: float, interval: float = 10.0, **shares: float) -> dict[str, Any]:
    fracs = {"compute": 0.7, "sync": 0.1, "data_wait": 0.1, "eval": 0.0, "checkpoint": 0.0, "other": 0.1} | shares
    return {"step": step, "elapsed_s": elapsed, "interval_s": interval,
            **{f"time/{k}_frac": v for k, v in fracs.items()}}


def test_healthy_run_splits_wall_time_into_startup_phases_and_shutdown() -> None:
    history = [report(10, 30.0), report(20, 40.0), report(30, 50.0, eval=0.2, compute=0.5)]
    ledger = build_ledger(history, wall_s=60.0, pricing=PRICED)
    s = ledger.seconds
    assert s["startup"] == pytest.approx(20.0)  # the first interval began 10 s before its report arrived at 30 s
    assert s["compute"] == pytest.approx(7 + 7 + 5) and s["sync"] == pytest.approx(3.0)  # share x interval
    assert ledger.frac("productive") == pytest.approx((8 + 8 + 6) / 60)  # compute + sync
    assert s["data_wait"] == pytest.approx(3.0) and s["eval"] == pytest.approx(2.0)
    assert s["shutdown"] == pytest.approx(10.0) and s["wasted"] == s["recovery"] == s["resize"] == 0.0
    assert sum(s.values()) == pytest.approx(60.0)
    assert ledger.node_hours == pytest.approx(2 * 60 / 3600)
    assert ledger.usd == pytest.approx(2 * 60 / 3600 * 3.6)
    m = ledger.metrics()
    assert m["cost/productive_usd"] == pytest.approx(m["cost/usd"] * 22 / 60)
    assert m["cost/productive_usd"] + m["cost/overhead_usd"] == pytest.approx(m["cost/usd"])
    assert sum(m[f"cost/{p}_frac"] for p in PARTS) == pytest.approx(1.0)
    assert ledger.time_line() == ("time: 60.0 s | start-up 33% | compute 32% | sync 5% | data wait 5% | eval 3% | "
                                  "other 5% | shutdown 17%")
    assert ledger.line().endswith("| productive 37% ($0.0440) | ETTR 44%")  # 22 s of the 50 s to the last step


def test_a_restart_bills_the_redone_steps_as_wasted_and_the_gap_as_recovery() -> None:
    # Step 20 was reported, the worker crashed, the group restarted from step 10's checkpoint and redid 20. The
    # first report of every (re)start carries the worker's facts (its pid): that is where a restart shows.
    history = [report(10, 30.0) | {"worker_pid": 101}, report(20, 40.0), report(20, 75.0) | {"worker_pid": 102},
               report(30, 85.0)]
    ledger = build_ledger(history, wall_s=90.0, pricing=PRICED, failures=1)
    # The superseded step-20 interval (10 s) is wasted progress; from its report at t=40 to the redone interval's
    # start at t=65, 25 s, the group was recovering; kept intervals 3 x 10 s.
    assert ledger.seconds["wasted"] == pytest.approx(10.0)
    assert ledger.seconds["recovery"] == pytest.approx(25.0)
    assert ledger.seconds["resize"] == 0.0
    assert ledger.seconds["compute"] + ledger.seconds["sync"] == pytest.approx(3 * 8.0)
    assert sum(ledger.seconds.values()) == pytest.approx(90.0)
    assert "wasted progress 11% | recovery 28%" in ledger.time_line()
    # ETTR: productive time over the wall clock from the command to the last committed step (85 s, not 90).
    assert ledger.ettr == pytest.approx(24.0 / 85.0)
    assert ledger.metrics()["cost/ettr"] == pytest.approx(24.0 / 85.0)
    assert f"ETTR {24 / 85:.0%}" in ledger.line()


def test_a_restart_at_another_world_size_is_a_resize() -> None:
    # An elastic group grew from 1 to 2 workers: it restarted from step 10's checkpoint at the new size.
    history = [report(10, 30.0) | {"worker_pid": 101, "world_size": 1}, report(20, 40.0) | {"world_size": 1},
               report(20, 62.0) | {"worker_pid": 102, "world_size": 2}, report(30, 72.0) | {"world_size": 2}]
    ledger = build_ledger(history, wall_s=75.0, pricing=PRICED)
    assert ledger.seconds["resize"] == pytest.approx(12.0)  # 52 (the new interval's start) - 40
    assert ledger.seconds["wasted"] == pytest.approx(10.0)
    assert ledger.seconds["recovery"] == 0.0
    assert sum(ledger.seconds.values()) == pytest.approx(75.0)


def test_unpriced_run_logs_node_hours_but_no_dollars() -> None:
    ledger = build_ledger([report(5, 12.0)], wall_s=20.0, pricing=Pricing(1, None, "1 node"))
    assert ledger.usd is None and "cost/usd" not in ledger.metrics()
    assert ledger.metrics()["cost/node_hours"] == pytest.approx(20 / 3600)
    assert ledger.line().startswith("cost: unpriced (set cost.node_type or cost.price_per_hour)")


def test_a_run_without_reports_is_all_startup() -> None:
    assert build_ledger([], wall_s=9.0, pricing=PRICED).seconds["startup"] == 9.0


def test_study_sums_its_trials() -> None:
    a = Ledger(3600.0, Pricing(1, 2.0, "a"), {"compute": 1800.0, "startup": 1800.0})
    b = Ledger(1800.0, Pricing(2, 2.0, "b"), {"compute": 1200.0, "sync": 600.0})
    m = study_metrics([a, b])
    assert m["cost/usd"] == pytest.approx(2.0 + 2.0)
    assert m["cost/node_hours"] == pytest.approx(2.0)
    assert m["cost/productive_frac"] == pytest.approx((1800 + 3600) / 7200)


def test_pricing_from_the_table_counts_nodes_from_gpus() -> None:
    cfg = load_config(None, ["scaling.num_workers=16", "scaling.use_gpu=true", "cost.node_type=gpu_a100"])
    p = resolve_pricing(cfg)
    assert p.nodes == 2 and p.usd_per_node_hour == pytest.approx(32.77)
    assert "on-demand" in p.description
    spot = resolve_pricing(load_config(None, ["scaling.use_gpu=true", "cost.node_type=gpu_spot"]))
    assert spot.nodes == 2 and "spot" in spot.description  # gpu_spot launches as spot: its spot price
    forced = resolve_pricing(load_config(None, ["scaling.use_gpu=true", "cost.node_type=gpu_a100", "cost.spot=true",
                                                "cost.cloud=gcp"]))
    assert forced.usd_per_node_hour == pytest.approx(8.82)
    assert resolve_pricing(load_config(None, ["cost.price_per_hour=1.5", "cost.nodes=3"])).nodes == 3


def test_pricing_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cost.node_type=gpu_b300 is not in the aws price table"):
        resolve_pricing(load_config(None, ["cost.node_type=gpu_b300"]))
    with pytest.raises(ConfigError, match="price table .* not found"):
        resolve_pricing(load_config(None, ["cost.node_type=head", f"cost.prices_file={tmp_path}/none.yaml"]))
    with pytest.raises(ConfigError, match="cost.spot and cost.prices_file have no effect without cost.node_type"):
        load_config(None, ["cost.spot=true"])


# ---- a study whose trials search scaling.num_workers: each trial is billed for its own nodes ----

def _trial_study() -> tuple[dict[str, Any], dict[str, Any]]:
    from orchestrator.tuning.search import user_tree
    from pipelines.sources import DatasetInfo

    # gpu_spot nodes hold one GPU each: 2 workers occupy 2 nodes, 8 workers 8 nodes.
    base = load_config(None, ["train.max_steps=100", "scaling.use_gpu=true", "cost.node_type=gpu_spot",
                              "tune.space.scaling.num_workers.choice=[2, 8]", "tune.rank_by=metric_per_dollar"])
    infos = {"train": DatasetInfo("train", [], num_rows=4096, num_bytes=0, feature_dim=64, num_classes=10)}
    return user_tree(base), infos


def _tune_reports(wall: float) -> list[dict[str, Any]]:
    """What Tune records for a trial: its reports, each with the trial's clock (time_total_s)."""
    return [{**report(step, elapsed=wall * step / 100), "time_total_s": wall * step / 100} for step in (50, 100)]


def test_study_bills_each_trial_for_its_own_searched_worker_count() -> None:
    import pandas as pd

    from orchestrator.tuning.plan import TrialPlanner
    from orchestrator.tuning.results import pick_best, summaries

    tree, infos = _trial_study()
    results = []
    for trial_id, workers, accuracy in (("small", 2, 0.90), ("large", 8, 0.92)):
        rows = _tune_reports(wall=3600.0)
        results.append(SimpleNamespace(
            metrics={**rows[-1], "trial_id": trial_id, "done": True, "val_accuracy": accuracy},
            config={"scaling.num_workers": workers}, metrics_dataframe=pd.DataFrame(rows), error=None,
            path=f"/tmp/{trial_id}"))
    small, large = summaries(results, TrialPlanner(tree, infos), "val_accuracy")
    assert (small.cost.pricing.nodes, large.cost.pricing.nodes) == (2, 8)
    assert large.usd == pytest.approx(4 * small.usd)  # same wall time, four times the nodes
    # 0.92 per 8 node-hours is a worse buy than 0.90 per 2: billed at the base size, "large" would win.
    assert pick_best([small, large], "max", "metric_per_dollar") is small


def test_study_callback_logs_each_trial_ledger_at_its_own_size() -> None:
    from orchestrator.tuning.plan import TrialPlanner
    from orchestrator.tuning.trials import StudyCallback, StudyFacts

    tree, infos = _trial_study()
    study = StudyFacts("s", TrialPlanner(tree, infos), ("scaling.num_workers",), "val_accuracy", 100)
    callback = StudyCallback(study, verbose=False)
    logged: dict[str, dict[str, float]] = {}
    for trial_id, workers in (("small", 2), ("large", 8)):
        trial = SimpleNamespace(trial_id=trial_id, config={"scaling.num_workers": workers}, status="RUNNING",
                                last_result={"step": 100, "done": True}, error_file=None,
                                run_metadata=SimpleNamespace(start_time=1000.0, last_result_time=4600.0))
        callback._runs[trial_id] = SimpleNamespace(  # stands in for the trial's MLflow child run
            log_metrics=lambda metrics, step, trial_id=trial_id: logged.setdefault(trial_id, metrics),
            set_tags=lambda tags: None, finish=lambda status: None)
        for row in _tune_reports(wall=3600.0):
            callback.on_trial_result(0, [trial], trial, row)
        callback.on_trial_complete(0, [trial], trial)
    assert (logged["small"]["cost/nodes"], logged["large"]["cost/nodes"]) == (2.0, 8.0)
    assert logged["large"]["cost/usd"] == pytest.approx(4 * logged["small"]["cost/usd"])


def test_time_blocked_in_reports_is_its_own_part_not_recovery() -> None:
    # Intervals include the time their workers sat in the previous report (here 4 s of each 10 s): with a failure
    # in the run, only the real restart gap is billed as recovery, and the blocked time shows as "report".
    blocked = {"compute": 0.4, "report": 0.4, "data_wait": 0.05, "other": 0.05}
    history = [report(10, 30.0, **blocked), report(20, 40.0, **blocked), report(30, 65.0, **blocked)]
    ledger = build_ledger(history, wall_s=70.0, pricing=PRICED, failures=1)
    assert ledger.seconds["report"] == pytest.approx(12.0)
    assert ledger.seconds["recovery"] == pytest.approx(15.0)  # 65 - 20 (start-up) - 3 x 10 (intervals)
    assert "report 17%" in ledger.time_line()


def test_elastic_run_is_billed_at_the_largest_world_size_it_reached() -> None:
    # gpu_spot nodes hold one GPU each, so nodes = workers; 120 divides by every size from 2 to 6.
    cfg = load_config(None, ["scaling.num_workers=[2, 6]", "train.global_batch_size=120", "scaling.use_gpu=true",
                             "cost.node_type=gpu_spot"])
    assert resolve_pricing(cfg).nodes == 2  # before any report: the group's minimum
    grown = resolve_pricing(cfg, world_size=4)
    assert grown.nodes == 4 and grown.description.startswith("4 x gpu_spot")
    assert build_ledger([], 3600.0, grown).usd == pytest.approx(4 * 0.485)  # an hour of 4 spot nodes
    # The driver takes the largest world size among the reports, not the first or the last.
    history = [{**report(step, elapsed=10.0 * step), "world_size": world}
               for step, world in ((10, 2), (20, 4), (30, 3))]
    assert largest_world(history) == 4 and largest_world([report(10, elapsed=100.0)]) is None
    # An explicit node count is what the user said the run holds, whatever the world size.
    pinned = load_config(None, ["scaling.num_workers=[2, 6]", "train.global_batch_size=120", "scaling.use_gpu=true",
                                "cost.node_type=gpu_spot", "cost.nodes=3"])
    assert resolve_pricing(pinned, world_size=6).nodes == 3


def test_a_resumed_run_is_one_ledger_across_its_attempts() -> None:
    from orchestrator.report.cost import attempt_record, ledger_across_attempts

    # Attempt 1 began at t=1000 (epoch seconds), reported steps 10 and 20, then its driver was killed (last record
    # at t=1045). Attempt 2 (`--resume`) began at t=1100 from step 10's checkpoint, redid step 20, reached 30, and
    # ended at t=1150. Each attempt's `elapsed_s` counts from its own command's start.
    first = attempt_record(1000.0, [report(10, 30.0) | {"worker_pid": 101}, report(20, 40.0)], ended=1045.0)
    second = attempt_record(1100.0, [report(20, 35.0) | {"worker_pid": 102}, report(30, 45.0)], ended=1150.0)
    ledger = ledger_across_attempts([second, first], PRICED)  # in any order: sorted by when each began
    s = ledger.seconds
    # The commands' own time, 45 s + 50 s: the 55 s between them (nothing ran: the user had not resumed yet) is
    # not the run's.
    assert ledger.wall_s == pytest.approx(95.0)
    assert s["startup"] == pytest.approx(20.0)  # attempt 1's first interval began at t=1020
    assert s["wasted"] == pytest.approx(10.0)  # attempt 1's step 20, trained again by attempt 2
    # From attempt 1's last report (t=1040) to its end (5 s), and attempt 2's start-up to its first kept interval
    # (began t=1125, 25 s in): what the stop cost. A restart to the first step again is recovery.
    assert s["recovery"] == pytest.approx(30.0)
    assert s["compute"] + s["sync"] == pytest.approx(3 * 8.0)  # steps 10 (attempt 1), 20 and 30 (attempt 2)
    assert s["shutdown"] == pytest.approx(5.0)
    assert sum(s.values()) == pytest.approx(95.0)
    assert ledger.ettr == pytest.approx(24.0 / 90.0)
    # Attempts that overlap (a second driver started before the first one's last record) bill each moment once.
    overlapping = attempt_record(1040.0, [report(20, 25.0) | {"worker_pid": 103}], ended=1070.0)
    assert ledger_across_attempts([first, overlapping], PRICED).wall_s == pytest.approx(70.0)
    # A record keeps what the ledger needs, and survives JSON (it is written beside the run in storage).
    import json

    assert json.loads(json.dumps(first)) == first and "val_loss" not in json.dumps(first)


def test_a_studys_goodput_is_its_trials_productive_time_over_the_slots_its_wall_clock_held() -> None:
    from orchestrator.tuning.results import TrialSummary, study_goodput

    def trial(status: str, productive: float, wall: float, started: float) -> TrialSummary:
        ledger = Ledger(wall, Pricing(1, None, "1 node"), {"compute": productive * 0.75, "sync": productive * 0.25,
                                                           "startup": wall - productive})
        return TrialSummary(f"t{started:g}", {}, status, 10, 0.5, cost=ledger, started_at=started,
                            ended_at=started + wall)

    # Two trials at a time over a 100 s study: 200 trial-seconds the study could have trained. Productive: 30 + 20
    # in completed trials, 10 in the trial ASHA stopped (which held 25 s).
    trials = [trial("completed", 30.0, 60.0, 10.0), trial("stopped", 10.0, 25.0, 12.0),
              trial("completed", 20.0, 50.0, 40.0)]
    g = study_goodput(trials, wall_s=100.0)
    assert g["study/slots"] == 2 and g["study/wall_s"] == 100.0
    assert g["study/goodput"] == pytest.approx(60.0 / 200.0)
    assert g["study/stopped_trials_frac"] == pytest.approx(25.0 / 200.0)  # apart: what ASHA's stopped trials held
    assert g["study/stopped_productive_frac"] == pytest.approx(10.0 / 200.0)
    assert study_goodput([], wall_s=100.0) == {}
    from orchestrator.tuning.results import goodput_line

    assert goodput_line(g) == ("study goodput 30%: productive trial time over 100 s x 2 trial slots | trials ASHA "
                               "stopped held 12% (5% productive)")
    small = study_goodput([trial("completed", 0.047, 60.0, 10.0)], wall_s=100.0)
    assert goodput_line(small) == "study goodput 0.047%: productive trial time over 100 s of the study's wall clock"


def test_the_readmes_laptop_check_of_the_gpu_recipe_is_not_priced_as_gpu_nodes() -> None:
    # README "From laptop to GPU cluster", step 3: examples/cluster-gpu.yaml (cost.node_type: gpu_spot) run on the
    # laptop's CPUs with scaling.use_gpu=false. Its node-hours are a CPU's, never the GPU node type's price.
    import shlex

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    start = readme.index("orchestrator train --config examples/cluster-gpu.yaml --set scaling.use_gpu=false")
    command = shlex.split(readme[start:readme.index("```", start)].replace("\\\n", " "))
    config, overrides = command[command.index("--config") + 1], [
        command[i + 1] for i, word in enumerate(command) if word == "--set"]
    laptop = load_config(Path(__file__).resolve().parents[3] / config, overrides)
    assert laptop.cost.node_type == "gpu_spot" and not laptop.scaling.use_gpu
    pricing = resolve_pricing(laptop)
    assert pricing.usd_per_node_hour is None, pricing
    assert "$" not in pricing.description and "gpu_spot" in pricing.description  # says why it is unpriced
    line = build_ledger([report(5, 12.0)], wall_s=20.0, pricing=pricing).line()
    assert line.startswith("cost: unpriced") and "0.485" not in line, line
    # On the cluster (the recipe as written) it is the GPU node's spot price; a price the user gives always counts.
    assert resolve_pricing(load_config(Path(__file__).resolve().parents[3] / config)).usd_per_node_hour == 0.485
    given = resolve_pricing(load_config(Path(__file__).resolve().parents[3] / config,
                                        [*overrides, "cost.price_per_hour=0.1"]))
    assert given.usd_per_node_hour == 0.1


def test_metric_per_dollar_is_refused_for_a_study_its_pricing_leaves_unpriced() -> None:
    # CPU trials on a GPU node type are unpriced (above): ranking them by dollars would divide by nothing.
    from orchestrator.tuning.plan import check_rank_by

    ranked = ["tune.metric=val_accuracy", "tune.rank_by=metric_per_dollar", "cost.node_type=gpu_spot"]
    check_rank_by(load_config(None, [*ranked, "scaling.use_gpu=true"]))  # priced: accepted
    with pytest.raises(ConfigError, match="tune.rank_by=metric_per_dollar needs prices"):
        check_rank_by(load_config(None, ranked))
