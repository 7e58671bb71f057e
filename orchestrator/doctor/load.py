"""Doctor's reading of a run from MLflow: `load_run` turns a run id (and tracking URI) into a
`RunRecord`, with errors that name the store without its password and no download progress bar
(`_quiet_downloads`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from orchestrator.doctor.record import RunRecord
from orchestrator.errors import UserError
from orchestrator.tracking.read import read_metrics
from orchestrator.tracking.uri import mask_password, resolve_uri


def load_run(run_id: str, tracking_uri: str | None = None) -> RunRecord:
    """The run's params, tags and full metric histories (finished or still running), with the
    figures of its summary table (start-up breakdown, cost ledger, whole-run shares: written when
    the run ends) as one-value histories."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient


    uri = resolve_uri(tracking_uri)
    client = MlflowClient(tracking_uri=uri)
    try:
        run = client.get_run(run_id)
    # the URI is shown masked, MLflow's own detail (which repeats it) too
    except MlflowException as exc:
        detail = mask_password(str(exc).splitlines()[0][:200])
        raise UserError(f"MLflow run '{run_id}' not found at {mask_password(uri)} "
                        f"({detail}): check the run id, or pass --tracking-uri") from None
    except Exception as exc:
        raise UserError(f"MLflow tracking at '{mask_password(uri)}' "
                        f"is unavailable ({type(exc).__name__}): pass "
                        "--tracking-uri or start the server") from None
    with _quiet_downloads():
        metrics = read_metrics(client, run_id)
    return RunRecord(metrics, dict(run.data.params), dict(run.data.tags))


@contextlib.contextmanager
def _quiet_downloads() -> Iterator[None]:
    """No MLflow progress bar for the summary table's download (doctor prints a report, not
    transfers); the user's own setting of the variable is back as it was afterwards."""
    name = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    before = os.environ.get(name)
    os.environ[name] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
