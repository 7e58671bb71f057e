"""MLflow on the driver, one file per concern (import from the file, this package re-exports
nothing):

- `tracker.py`: the Tracker a run logs through: its protocol, NullTracker (tracking off),
start_tracker and
  closed_on_error.
- `client.py`: MlflowTracker, one MLflow run per `orchestrator train`: its params, metrics, summary
table and final
  status; a failing call warns, never stops training, a store that stops answering is skipped for a
  while.
- `lineage.py`: what the run's figures are linked to: its datasets (dataset_entity) and its
checkpoints' models.
- `store.py`: whether the store can be used: reachable before Ray starts, the error when it is not,
an outage mid-run.
- `view.py`: what is charted and what is summarised: each figure's MLflow key, the headline section,
the summary
  table's rows and the run's description. What the first screen shows is decided here.
- `uri.py`: the tracking URI: resolved (configured, $MLFLOW_TRACKING_URI, the local SQLite file),
its password masked.
- `links.py`: the MLflow UI: the command that opens it and the URLs of an experiment and a run.
- `context.py`: the run's name, its context tags (source, user, git commit) and its params (the
resolved config).
- `read.py`: reading a run back (doctor, tests): its summary table and its metrics by MLflow key.
- `flavour.py`: the final weights as the run's MLflow Model "model", rebuilt on the driver from the
final checkpoint.
- `pyfunc.py`: that model's `python_function` flavour, shipped inside the saved model (its code/
folder).
- `checkpoint_models.py`: each checkpoint Ray Train commits as an MLflow LoggedModel of the run.
"""
