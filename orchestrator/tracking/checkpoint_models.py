"""Each checkpoint Ray Train commits is an MLflow 3 LoggedModel of the run: the UI's Models tab
lists them, and `mlflow.search_logged_models(..., order_by=[{"field_name": "metrics.val/loss"}])`
finds the best one.

A checkpoint model is external (MLflow's `mlflow.model.isExternal` tag): its files stay in run
storage, where Ray wrote them, and nothing is uploaded; its `checkpoint` param and tag hold their
URI. Its step is a param and the step of the run's output that names it; the metrics of that step
are linked to it by the tracker (tracking/lineage.py, `log_metric(..., model_id=...)` with the
dataset they were measured on). The run's final weights stay the loadable MLflow Model `model`
(tracking/flavour.py). Only the driver calls this; the tracker makes every call best-effort."""

from __future__ import annotations

from typing import Any

CHECKPOINT_TAG = "orchestrator.checkpoint"  # the checkpoint's URI (local path or s3://...)
MODEL_TYPE = "checkpoint"


def create_checkpoint_model(client: Any, experiment_id: str, run_id: str, step: int,
                            uri: str) -> str:
    """The LoggedModel of the checkpoint at `uri` (step `step`) in the run: READY at once (no
    files to upload), or FAILED when a call after its creation fails (which raises). Returns its
    model id."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_IS_EXTERNAL

    # checkpoint_00000050_3fa2c1: sorts by step, as in storage
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    model = client.create_logged_model(experiment_id, name=name, source_run_id=run_id,
                                       model_type=MODEL_TYPE,
                                       tags={MLFLOW_MODEL_IS_EXTERNAL: "true", CHECKPOINT_TAG: uri},
                                       params={"step": str(step), "checkpoint": uri})
    try:
        # the run's Models column
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=step)])
    except BaseException:
        try:
            client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
        except Exception:  # noqa: BLE001, S110 - the first failure is the one to report
            pass
        raise
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    return str(model.model_id)


def delete_dropped(client: Any, experiment_id: str, run_id: str, kept: set[str]) -> dict[str, Any]:
    """Delete the run's checkpoint models whose checkpoint is not in `kept` (URIs): Ray's
    retention (`checkpoint.keep`) deleted their files, and a model that cannot be loaded must not
    be found as the best. Returns the models of the kept checkpoints that have one, by URI."""
    query = f"source_run_id = '{run_id}' AND model_type = '{MODEL_TYPE}'"
    token = None
    models = []
    while True:
        page = client.search_logged_models([experiment_id], filter_string=query, page_token=token)
        models += list(page)
        token = page.token
        if not token:
            break
    for model in models:
        if model.tags.get(CHECKPOINT_TAG) not in kept:
            client.delete_logged_model(model.model_id)
    return {model.tags[CHECKPOINT_TAG]: model for model in models
            if model.tags.get(CHECKPOINT_TAG) in kept}
