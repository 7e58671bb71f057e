"""The final weights as an MLflow Model in the run:
`mlflow.pytorch.load_model("runs:/<run_id>/model")` gives the trained module back,
`mlflow.pyfunc.load_model(...).predict(frame)` takes the feature columns by name and answers in
the task's terms (tracking/pyfunc.py), and `mlflow.register_model("runs:/<run_id>/model", name)`
registers it.

The model is rebuilt on the driver's CPU from the resolved config, given the final checkpoint's
weights, and saved with an input example and a signature from real rows (the training data's
sample) run through it. Logging is best-effort like the rest of tracking: a failure is one
warning line and the run goes on."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from orchestrator.config import Config
from orchestrator.models.inputs import in_features
from orchestrator.tracking.client import MlflowTracker
from orchestrator.tracking.tracker import Tracker
from pipelines.sources import DatasetInfo

MODEL_NAME = "model"  # runs:/<run_id>/model
# the model's entries in a sharded (DCP) checkpoint: "model.<parameter name>"
SHARDED_MODEL_KEY = "model"


def checkpoint_weights(directory: str | Path) -> dict[str, Any]:
    """The whole model's state dict from a local checkpoint directory: DDP's `state.pt`, or under
    train.parallel=fsdp the ranks' shards (torch.distributed.checkpoint) put together in this one
    process, on the CPU (no process group: the driver reads every shard itself)."""
    from orchestrator.training.checkpoint import STATE_FILE, load_state

    if (Path(directory) / STATE_FILE).is_file():
        return load_state(directory)["model"]
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(directory))
    prefix = f"{SHARDED_MODEL_KEY}."
    # Empty full-size tensors named and shaped by the checkpoint's metadata: DCP fills each from the
    # shards that cover it, whatever world size wrote them.
    weights = {key[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype, device="cpu")
               for key, meta in reader.read_metadata().state_dict_metadata.items()
               if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    if not weights:
        raise ValueError(f"checkpoint {directory} holds no model weights (neither {STATE_FILE} nor "
                         "model shards)")
    state = {SHARDED_MODEL_KEY: weights}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader)
    return state[SHARDED_MODEL_KEY]


def log_final_model(tracker: Tracker, config: Config, info: DatasetInfo,
                    weights: Callable[[], dict[str, Any]]) -> None:
    """Log the model of `config` with the state dict `weights()` returns (read from the final
    checkpoint) into the tracker's run as an MLflow Model named "model". Nothing (not even the
    read) without MLflow tracking; a failure warns (one line on stderr, or the tracker's own
    warning for the store) and never raises."""
    if not isinstance(tracker, MlflowTracker) or tracker.run_id is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / MODEL_NAME
        try:
            # In the user's working directory: a builder may read files relative to it.
            predicting = _pyfunc_settings(config, info)
            model, example, output = _rebuild(config, info, weights())
            with _working_directory(tmp):
                _save(model, example, output, path)
                if predicting is not None:
                    _add_task_pyfunc(model, path, *predicting)
        # A model that cannot be saved must not fail a finished run.
        except Exception as exc:  # noqa: BLE001
            detail = (str(exc).splitlines() or [""])[0][:300]
            print("warning: the final model was not logged as an MLflow Model "
                  f"({type(exc).__name__}: {detail}); its weights are in the run's final "
                  "checkpoint", file=sys.stderr)
            return
        # The store's calls through the tracker: skipped while the store is down, warned about once.
        with _working_directory(tmp):
            tracker._safe("log_model", _upload, tracker, path)


@contextmanager
def _working_directory(directory: str) -> Iterator[None]:
    """In `directory` for the block: MLflow and torch.export read the working directory, and
    under `ray job submit` it is the job's working_dir package, which Ray may already have
    removed when the run's workers ended. Only around MLflow's calls: the user's builder runs in
    the user's directory."""
    try:
        before: str | None = os.getcwd()
    except FileNotFoundError:
        before = None
    os.chdir(directory)
    try:
        yield
    finally:
        if before is not None and os.path.isdir(before):
            os.chdir(before)


def _rebuild(config: Config, info: DatasetInfo, weights: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The model on the CPU with `weights`, in eval mode; its input on the sample rows (the `x`
    array, or a dict of arrays by forward argument) and its logits there, as numpy. With
    model.pretrained, in the architecture of its saved config.json (what the workers'
    from_pretrained built), not the builder's default."""
    # torch and the model's modules at the run's end, where the model is rebuilt: not with the
    # command's start.
    import torch

    from orchestrator.models.tasks import logits_of
    from orchestrator.models.zoo import build_model, pretrained_config, with_saved_architecture
    from pipelines.batches import collate_sample

    pretrained = config.model.pretrained
    # With model.pretrained only the builder's class is needed: its default build on the meta device
    # (no memory), then the saved architecture for real.
    with torch.device("meta") if pretrained else nullcontext():
        model = build_model(config.model.name, config.model.entrypoint, in_features(config, info),
                            config.model.num_classes, config.model.kwargs)
    if pretrained:
        saved = pretrained_config(pretrained, config.data.s3)
        model = with_saved_architecture(model, saved, config.model.entrypoint or config.model.name)
    # from_pretrained keeps the saved dtype (bf16 weights train as bf16): the model in the weights'
    # one dtype.
    dtypes = {value.dtype for value in weights.values()
              if torch.is_tensor(value) and value.is_floating_point()}
    if len(dtypes) == 1:
        model.to(dtypes.pop())
    model.load_state_dict(weights)
    model.eval()
    if info.sample is None or info.sample.num_rows == 0:
        raise ValueError("the training data has no sample rows for the input example")
    named = config.model.inputs is not None
    batch = collate_sample(info.sample, config.data, named)
    with torch.no_grad():
        if not named:
            x = batch["x"]
            # torch.export keeps a batch dimension of size 1 fixed: give it two rows
            if len(x) == 1:
                x = torch.cat([x, x])
            example: Any = x.numpy()
            output = model(x)
        else:
            inputs = {argument: batch[key]
                      for argument, key in (config.model.input_map or {}).items()}
            example = {argument: value.numpy() for argument, value in inputs.items()}
            output = model(**inputs)
    return model, example, logits_of(output).float().numpy()


def _pyfunc_settings(config: Config, info: DatasetInfo) -> tuple[dict[str, Any], Any] | None:
    """pyfunc.py's settings for this model and an input example (the sample rows' feature columns
    as a DataFrame); None where a row's columns cannot be stacked as they come (a variable-length
    list, whose padding and mask training's collate makes): then MLflow's own pytorch pyfunc (one
    array in, the raw output out)."""
    import pyarrow as pa

    inputs = config.model.input_map
    columns = list(config.data.features) if inputs is None else list(inputs.values())
    if (info.sample is None or info.schema is None or not set(columns) <= set(config.data.features)
            or any(pa.types.is_list(info.schema.field(c).type)
                   or pa.types.is_large_list(info.schema.field(c).type) for c in columns)):
        return None
    # a user's own task: its raw output
    task = config.task.name if config.task.kind is not None else None
    settings = {"task": task, "columns": columns, "inputs": inputs,
                "tokens": inputs is None and config.data.label is None}
    frame = info.sample.select(columns).slice(0, 5).to_pandas()
    # stored windows hold one token more than the model is fed (x = tokens[:-1])
    if settings["tokens"]:
        frame[columns[0]] = frame[columns[0]].map(lambda window: window[:-1])
    # torch.export keeps a batch dimension of size 1 fixed: the example has two rows
    if len(frame) == 1:
        frame = frame.loc[[0, 0]].reset_index(drop=True)
    return settings, frame


def _add_task_pyfunc(model: Any, path: Path, settings: dict[str, Any], frame: Any) -> None:
    """Make the saved model's `python_function` flavour pyfunc.py's (shipped in the model's code/
    folder): its signature names the feature columns and the task's outputs, from the example run
    through it here."""
    from mlflow.models import Model, infer_signature
    from mlflow.models.utils import _save_example

    from orchestrator.tracking.pyfunc import LOADER_MODULE, SETTINGS_FILE, TaskPredictor

    mlmodel = Model.load(str(path))
    flavor = mlmodel.flavors.get("python_function")
    if flavor is None:
        return
    output = TaskPredictor(model, settings).predict(frame)
    # integer columns "cannot represent missing values": ids and classes never miss
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        signature = infer_signature(frame, output)
    (path / "code").mkdir(exist_ok=True)
    shutil.copyfile(Path(__file__).with_name("pyfunc.py"), path / "code" / f"{LOADER_MODULE}.py")
    (path / SETTINGS_FILE).write_text(json.dumps(settings))
    flavor["loader_module"], flavor["code"] = LOADER_MODULE, "code"
    # the tensor example pt2 was traced with
    for name in ("input_example.json", "serving_input_example.json"):
        (path / name).unlink(missing_ok=True)
    mlmodel.saved_input_example_info, mlmodel.signature = None, signature
    _save_example(mlmodel, frame, str(path))
    mlmodel.save(str(path / "MLmodel"))


def _is_transformers(model: Any) -> bool:
    return hasattr(model, "save_pretrained") and type(model).__module__.startswith("transformers")


def _save(model: Any, example: Any, output: Any, path: Path) -> None:
    """The MLflow Model in the local directory `path` (uploaded by `_upload`)."""
    import mlflow.pytorch
    from mlflow.models import Model, infer_signature

    signature = infer_signature(example, output)
    requirements = _pip_requirements(model)
    kwargs: dict[str, Any] = {"signature": signature, "pip_requirements": requirements}
    # A Hugging Face model is saved as a torch module too: mlflow.transformers wants a tokenizer or
    # a pipeline.
    if isinstance(example, dict) or _is_transformers(model):
        # Pickled: "pt2" (torch.export) takes positional arrays only, and the pyfunc flavour cannot
        # call a model by keyword (its predict takes one array), so a dict input gets a signature
        # and no input example. Loading a pickled model needs
        # MLFLOW_ALLOW_PICKLE_DESERIALIZATION=true (MLflow's warning saying so is muted here).
        with _quiet("mlflow.pytorch"):
            mlflow.pytorch.save_model(model, str(path), mlflow_model=Model(),
                                      serialization_format="pickle",
                                      input_example=None if isinstance(example, dict) else example,
                                      **kwargs)
        return
    try:
        # "pt2": the traced graph with its weights, loadable without the model's code and without
        # pickle.
        mlflow.pytorch.save_model(model, str(path), mlflow_model=Model(),
                                  serialization_format="pt2", input_example=example, **kwargs)
    # A model torch.export cannot trace (data-dependent control flow...): pickled.
    except Exception:  # noqa: BLE001
        import shutil

        shutil.rmtree(path, ignore_errors=True)
        with _quiet("mlflow.pytorch"):
            mlflow.pytorch.save_model(model, str(path), mlflow_model=Model(),
                                      serialization_format="pickle", input_example=example,
                                      **kwargs)


def _pip_requirements(model: Any) -> list[str]:
    """Pinned without a local version label (torch 2.x+cpu -> torch==2.x). Given explicitly:
    MLflow would otherwise load the model in a subprocess to infer them (seconds) and warn about
    the label."""
    from importlib.metadata import PackageNotFoundError, version

    packages = ["torch", "cloudpickle", "numpy",
                *(["transformers"] if _is_transformers(model) else [])]
    pinned = []
    for package in packages:
        try:
            pinned.append(f"{package}=={version(package).split('+')[0]}")
        except PackageNotFoundError:
            pinned.append(package)
    return pinned


@contextmanager
def _quiet(name: str) -> Iterator[None]:
    """A logger's warnings off for the block, its level restored after."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _upload(tracker: MlflowTracker, path: Path) -> None:
    """What `mlflow.pytorch.log_model` does after saving, through the tracker's own client (its
    URI and run), so no global MLflow state (tracking URI, active run, experiment) is read or
    changed: a LoggedModel named "model" in the run's experiment with the run as its source (how
    runs:/<run_id>/model resolves), the run's output, the MLmodel file naming both, and the
    files."""
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model

    client, run_id = tracker._client, tracker.run_id
    assert run_id is not None
    experiment_id = client.get_run(run_id).info.experiment_id
    logged = client.create_logged_model(experiment_id, name=MODEL_NAME, source_run_id=run_id)
    try:
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
        mlmodel = Model.load(str(path))
        mlmodel.artifact_path, mlmodel.run_id = logged.artifact_location, run_id
        mlmodel.model_uuid = mlmodel.model_id = logged.model_id
        mlmodel.save(str(path / "MLmodel"))
        client.log_model_artifacts(logged.model_id, str(path))
    except BaseException:
        try:
            client.finalize_logged_model(logged.model_id, "FAILED")
        except Exception:  # noqa: BLE001, S110 - the first failure is the one to report
            pass
        raise
    client.finalize_logged_model(logged.model_id, "READY")
