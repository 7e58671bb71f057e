"""What a tracked run's figures are linked to: the datasets they are measured on (the run's inputs,
the UI's Dataset column) and the models of the checkpoints Ray Train commits (external LoggedModels,
see checkpoint_models.py). The validation figures and the training loss of a step are linked to that
step's checkpoint model and dataset, whichever of the report and the checkpoint's commit reaches the
driver first. MlflowTracker (client.py) takes these methods from `Lineage`."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from orchestrator.tracking.view import canonical_key, mlflow_key

if TYPE_CHECKING:
    from orchestrator.tracking.writer import Writer
    from pipelines.sources import DatasetInfo


class Lineage:
    """MlflowTracker's checkpoint and dataset logging: the state it uses is set up by
    MlflowTracker.__init__."""

    _client: Any
    writer: Writer
    _lock: threading.Lock
    _safe: Callable[..., None]
    _models: dict[int, str]
    _sent: dict[int, list[tuple[str, str, float, int]]]
    _datasets: dict[str, tuple[str, str]]
    experiment_id: str
    run_id: str | None

    def log_checkpoint(self, step: int, uri: str) -> None:
        """A checkpoint Ray Train committed (at `uri`, of `step`) as an external LoggedModel of the
        run, with the metrics of its step linked to it: those already logged (the same points again:
        the store keeps one), the others as they are logged. Made by the writer's thread, after the
        points queued before it."""
        self.writer.put(("call", "log_checkpoint", lambda: self._create_checkpoint(step, uri)))

    def _create_checkpoint(self, step: int, uri: str) -> None:
        from mlflow.entities import Metric

        from orchestrator.tracking.checkpoint_models import create_checkpoint_model

        model = create_checkpoint_model(self._client, self.experiment_id, self.run_id, step, uri)
        with self._lock:
            self._models[step] = model
            sent = list(self._sent.get(step, []))
        linked = [Metric(chart, v, t, step, **self._link(key, step)) for key, chart, v, t in sent]
        self.writer.put(*(("metric", metric) for metric in linked))

    def keep_checkpoints(self, kept: Mapping[str, int | None]) -> None:
        """The checkpoints in storage at the run's end ({URI: step}): the models of the others
        (deleted by retention) are deleted; one the driver never heard of (committed while an
        earlier attempt's driver was going away) is made now, and one an earlier driver made but was
        killed before linking gets its links: the run's points of its step."""
        from orchestrator.tracking.checkpoint_models import delete_dropped

        self.writer.flush()  # the checkpoints' models queued so far exist in the store
        modelled: list[dict[str, Any]] = []
        self._safe("log_checkpoint", lambda: modelled.append(
            delete_dropped(self._client, self.experiment_id, self.run_id, set(kept))))
        if not modelled:
            return
        for uri, step in kept.items():
            model = modelled[0].get(uri)
            if step is None or (model is not None and model.metrics):
                continue
            if model is None:
                self._safe("log_checkpoint", self._create_checkpoint, step, uri)
            else:
                with self._lock:
                    self._models[step] = model.model_id
            if step in self._models:
                self._safe("log_metrics", self._link_logged, step)

    def _link_logged(self, step: int) -> None:
        """Link the run's points at `step` in the store (an earlier attempt's) to the step's
        checkpoint model."""
        from mlflow.entities import Metric

        keys = [key for key in self._client.get_run(self.run_id).data.metrics
                if _linkable(canonical_key(key))]
        points = [Metric(key, m.value, m.timestamp, step, **self._link(canonical_key(key), step))
                  for key in keys for m in self._client.get_metric_history(self.run_id, key)
                  if m.step == step]
        if points:
            self._client.log_batch(self.run_id, metrics=points)

    def _link(self, key: str, step: int) -> dict[str, str]:
        """Metric(...)'s arguments linking a point of series `key` at `step` to the step's
        checkpoint model and to the dataset it was measured on: the validation figures and the
        training loss; {} for anything else."""
        with self._lock:
            model = self._models.get(step)
        if not _linkable(key) or model is None:
            return {}
        split = "val" if key.startswith("val/") else "train"
        name, digest = self._datasets.get(split, (None, None))
        dataset = {"dataset_name": name, "dataset_digest": digest} if name else {}
        return {"model_id": model} | dataset

    def _remember(self, key: str, chart: str, value: float, timestamp: int, step: int) -> None:
        """A linkable point sent to the run, for the checkpoint of its step if that comes later
        (recent steps)."""
        if _linkable(key):
            with self._lock:
                self._sent.setdefault(step, []).append((key, chart, value, timestamp))
                while len(self._sent) > 256:
                    del self._sent[min(self._sent)]

    def log_datasets(self, infos: Mapping[str, DatasetInfo]) -> None:
        """The training and validation data as the run's inputs (the UI's Dataset column):
        `dataset_input` of each."""
        from mlflow.entities import DatasetInput, InputTag

        entities = {split: dataset_entity(info) for split, info in infos.items()}
        self._datasets |= {split: (entity.name, entity.digest)
                           for split, entity in entities.items()}
        inputs = [DatasetInput(entity, [InputTag("mlflow.data.context",
                                                 _CONTEXTS.get(split, split))])
                  for split, entity in entities.items()]
        if inputs:
            self._safe("log_inputs", self._client.log_inputs, self.run_id, datasets=inputs)


_CONTEXTS = {"train": "training", "val": "validation"}


def _linkable(key: str) -> bool:
    """Whether the series under MLflow key `key` is linked to the checkpoint models of its steps:
    the validation figures and the training loss."""
    return key.startswith("val/") or key == mlflow_key("train_loss")


def dataset_entity(info: DatasetInfo) -> Any:
    """An MLflow Dataset for the Parquet data `info` describes: named by its last two path parts
    (`digits/train`), its URI as source, its columns as schema, its rows, bytes and files as
    profile; the digest (8 hex digits) of the path, schema and row count tells two datasets apart in
    the UI."""
    from mlflow.entities import Dataset

    path = info.path.rstrip("/")
    name = "/".join(path.split("/")[-2:])
    columns = ([{"name": f.name, "type": str(f.type)} for f in info.schema]
               if info.schema is not None else [])
    schema = json.dumps({"mlflow_colspec": columns})
    digest = hashlib.sha256(f"{path}|{schema}|{info.num_rows}".encode()).hexdigest()[:8]
    profile = json.dumps({"num_rows": info.num_rows, "num_bytes": info.num_bytes}
                         | ({"num_files": len(info.files)} if info.files else {}))
    return Dataset(name=name, digest=digest,
                   source_type="s3" if path.startswith("s3://") else "local",
                   source=json.dumps({"uri": path}), schema=schema, profile=profile)
