"""run/launch.py carries the plan out: the bill of a resumed run spans the earlier attempts the plan read and this
one, without reading storage again. No Ray."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator.report.cost import Pricing, attempt_record
from orchestrator.run import launch
from orchestrator.run.result import TrainResult

PRICED = Pricing(nodes=1, usd_per_node_hour=3.6, description="1 x test")


class NoStorage:
    """A run place whose storage must not be read at the end: the plan has what the bill needs."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the bill read the run's place ({name})")


def _result(history: list[dict[str, Any]]) -> TrainResult:
    return TrainResult(config=None, metrics={}, checkpoint_path=None, run_dir="runs/r", run_id=None,  # type: ignore[arg-type]
                       tracking_uri=None, history=history)


def _plan(resume: Any) -> Any:
    return SimpleNamespace(resume=resume, place=NoStorage(), pricing_at=lambda world: PRICED)


def test_a_resumed_runs_bill_spans_the_planned_attempts_and_this_one() -> None:
    now = time.time()
    earlier = attempt_record(now - 100.0, [{"step": 10, "elapsed_s": 20.0, "interval_s": 20.0}], now - 70.0)
    began = now - 30.0
    result = _result([{"step": 20, "elapsed_s": 25.0, "interval_s": 20.0}])
    launch._bill(_plan(SimpleNamespace(attempts=(earlier,))), result, began, failures=0)
    assert result.attempts == 2 and result.run_cost is not None
    # The earlier attempt's 30 s and this one's 30 s (to now), the 40 s between the commands left out.
    assert result.run_cost.wall_s == pytest.approx(60.0, abs=1.0)
    assert result.cost.wall_s == pytest.approx(30.0, abs=1.0)


def test_a_new_runs_bill_is_its_own() -> None:
    result = _result([{"step": 20, "elapsed_s": 25.0, "interval_s": 20.0}])
    launch._bill(_plan(None), result, time.time() - 30.0, failures=0)
    assert result.attempts == 1 and result.run_cost is None
    assert result.cost.wall_s == pytest.approx(30.0, abs=1.0)
