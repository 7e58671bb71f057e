"""Reading a run back from MLflow (doctor, tests): its summary table as {figure: value}, and every
metric's values in step order under its MLflow key, the summary table's numbers as one-value
histories."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from orchestrator.tracking.view import SUMMARY_TABLE, canonical_key, mlflow_key


def read_summary(client: Any, run_id: str) -> dict[str, Any]:
    """The run's summary table as {figure: value}; {} when it has none."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = client.download_artifacts(run_id, SUMMARY_TABLE, tmp)
            table = json.loads(Path(path).read_text())
    except Exception:  # no table: a run still going, or one from before the table existed
        return {}
    columns = table.get("columns", [])
    at = columns.index("figure") if "figure" in columns else 0
    value = columns.index("value") if "value" in columns else 1
    return {str(row[at]): row[value] for row in table.get("data", [])}


def read_metrics(client: Any, run_id: str) -> dict[str, list[float]]:
    """Every metric's values in step order (a headline chart's under its own MLflow key), and each
    number of the summary table as a one-value history, all under their MLflow keys: what
    `RunRecord.values(name)` looks up as `mlflow_key(name)`."""
    run = client.get_run(run_id)
    metrics, last_step = {}, None
    for key in run.data.metrics:
        history = sorted(client.get_metric_history(run_id, key),
                         key=lambda m: (m.step, m.timestamp))
        metrics[canonical_key(key)] = [m.value for m in history]
        last_step = max([last_step or 0, *(m.step for m in history)])
    for key, value in read_summary(client, run_id).items():
        if key not in metrics and isinstance(value, int | float) and not isinstance(value, bool):
            metrics[key] = [float(value)]
    # a run still going: its table comes at the end
    if mlflow_key("step") not in metrics and last_step is not None:
        metrics[mlflow_key("step")] = [float(last_step)]
    return metrics
