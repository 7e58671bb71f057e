"""`orchestrator doctor RUN_ID`: read a run's metric histories from MLflow and name what to change,
rule by rule.

Each rule is a small function of a `RunRecord` (metric histories, params, tags) returning a
`Finding` or None; findings are sorted by severity, then by how strongly the rule fired. The files:
- `record.py`: `RunRecord` and its small readers (a phase's share of the training, a study's trial
counts, the
  run's workers), `Finding` and its severities;
- `rules/`: the rules, grouped by what they look at: `speed.py` (data pipeline, memory, model state,
precision,
  compile, gradient sync, uneven workers), `run_health.py` (non-finite steps, start-up, checkpoint
  reports and interval, evaluation, bookkeeping), `study.py` (study size, the search space's edge);
- `engine.py`: `RULES`, the rules in the order they run, and `diagnose`. Add a rule by writing it in
the file of
  `rules/` that fits it and appending it to `RULES`;
- `load.py`: `load_run`, a run read back from MLflow;
- `report.py`: the printed report and the `doctor`/`summary` entry points the CLI calls.
Metrics are read by the name the loop (or the driver) reports them under; `tracking.view.mlflow_key`
maps it to MLflow's.
"""
