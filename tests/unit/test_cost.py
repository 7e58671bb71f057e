"""The cost ledger against hand-made report histories, and pricing from the price table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import load_config
from orchestrator.cost import PARTS, Ledger, Pricing, build_ledger, resolve_pricing, study_metrics
from orchestrator.errors import ConfigError

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
    assert s["productive"] == pytest.approx(8 + 8 + 6)  # (compute + sync) x interval
    assert s["data_wait"] == pytest.approx(3.0) and s["eval"] == pytest.approx(2.0)
    assert s["shutdown"] == pytest.approx(10.0) and s["restarts"] == 0.0
    assert sum(s.values()) == pytest.approx(60.0)
    assert ledger.node_hours == pytest.approx(2 * 60 / 3600)
    assert ledger.usd == pytest.approx(2 * 60 / 3600 * 3.6)
    m = ledger.metrics()
    assert m["cost/productive_usd"] == pytest.approx(m["cost/usd"] * 22 / 60)
    assert m["cost/productive_usd"] + m["cost/overhead_usd"] == pytest.approx(m["cost/usd"])
    assert sum(m[f"cost/{p}_frac"] for p in PARTS) == pytest.approx(1.0)


def test_restart_time_and_redone_steps_are_billed_as_restarts() -> None:
    # Step 20 was reported, the worker crashed, the group restarted from step 10's checkpoint and redid 20.
    history = [report(10, 30.0), report(20, 40.0), report(20, 75.0), report(30, 85.0)]
    ledger = build_ledger(history, wall_s=90.0, pricing=PRICED, failures=1)
    # Kept intervals: 10 + 10 + 10 s from t=20 to t=85: 35 s is the restart gap plus the redone interval.
    assert ledger.seconds["restarts"] == pytest.approx(35.0)
    assert ledger.seconds["productive"] == pytest.approx(3 * 8.0)
    assert "restarts 39%" in ledger.line()


def test_unpriced_run_logs_node_hours_but_no_dollars() -> None:
    ledger = build_ledger([report(5, 12.0)], wall_s=20.0, pricing=Pricing(1, None, "1 node"))
    assert ledger.usd is None and "cost/usd" not in ledger.metrics()
    assert ledger.metrics()["cost/node_hours"] == pytest.approx(20 / 3600)
    assert ledger.line().startswith("cost: unpriced (set cost.node_type or cost.price_per_hour)")


def test_a_run_without_reports_is_all_startup() -> None:
    assert build_ledger([], wall_s=9.0, pricing=PRICED).seconds["startup"] == 9.0


def test_study_sums_its_trials() -> None:
    a = Ledger(3600.0, Pricing(1, 2.0, "a"), {"productive": 1800.0, "startup": 1800.0})
    b = Ledger(1800.0, Pricing(2, 2.0, "b"), {"productive": 1800.0})
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
    forced = resolve_pricing(load_config(None, ["cost.node_type=gpu_a100", "cost.spot=true", "cost.cloud=gcp"]))
    assert forced.usd_per_node_hour == pytest.approx(8.82)
    assert resolve_pricing(load_config(None, ["cost.price_per_hour=1.5", "cost.nodes=3"])).nodes == 3


def test_pricing_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cost.node_type=gpu_b300 is not in the aws price table"):
        resolve_pricing(load_config(None, ["cost.node_type=gpu_b300"]))
    with pytest.raises(ConfigError, match="price table .* not found"):
        resolve_pricing(load_config(None, ["cost.node_type=head", f"cost.prices_file={tmp_path}/none.yaml"]))
    with pytest.raises(ConfigError, match="cost.spot and cost.prices_file have no effect without cost.node_type"):
        load_config(None, ["cost.spot=true"])
