"""The final model as an MLflow Model, logged without Ray into a real MLflow store (SQLite in tmp_path) and loaded
back through runs:/<run_id>/model: a fine-tuned `model.pretrained` Hugging Face model (whose architecture is the
saved config's, not the builder's default), and a user builder that reads a file relative to the working
directory."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrator import load_config
from orchestrator.config import Config

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite store for the module: creating its tables is most of a test's time."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/m.db"


@pytest.fixture()
def mlflow_uri(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Points MLflow's process-wide tracking URI (what runs:/ resolves against) at a test's store, and back."""
    import mlflow
    from mlflow.tracking._tracking_service import utils

    monkeypatch.setattr(utils, "_tracking_uri", utils._tracking_uri)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield mlflow.set_tracking_uri


def gpt2_default(num_classes: int = 256) -> Any:
    """A builder as a user writes one for fine-tuning: the class and its default architecture (12 layers of 768 is
    too big for a unit test: 2 of 32), which `model.pretrained`'s saved config replaces."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=num_classes, n_layer=2, n_embd=32, n_head=2, n_positions=128,
                                      bos_token_id=None, eos_token_id=None))


def mlp_from_file(in_features: int, num_classes: int) -> torch.nn.Module:
    """A builder that reads its hidden width from a file relative to the working directory."""
    width = json.loads(Path("arch.json").read_text())["width"]
    return torch.nn.Sequential(torch.nn.Linear(in_features, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, num_classes))


def _log(config: Config, info: Any, weights: dict[str, Any]) -> str:
    from orchestrator.tracking.client import MlflowTracker
    from orchestrator.tracking.flavour import log_final_model

    tracker = MlflowTracker(config.tracking, "model-logging")
    log_final_model(tracker, config, info, lambda: weights)
    tracker.finish("FINISHED")
    assert tracker.run_id is not None
    return tracker.run_id


def test_a_fine_tuned_pretrained_model_is_logged_with_the_saved_architecture(
        tmp_path: Path, store: str, mlflow_uri: Callable[[str], None], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import mlflow
    from transformers import GPT2Config, GPT2LMHeadModel

    from orchestrator.models.zoo import build_model
    from orchestrator.run.checks import resolve_for_data
    from pipelines.batches import collate_sample
    from pipelines.datasets import inspect_datasets
    from pipelines.prepare import prepare_text

    prepare_text([str(ROOT / "README.md")], str(tmp_path / "text"), seq_len=16, shards=1)
    # Saved as a user saves a base model: an architecture that is not the builder's default.
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=256, n_layer=1, n_embd=16, n_head=2, n_positions=24, bos_token_id=None,
                               eos_token_id=None)).save_pretrained(tmp_path / "base")
    config = load_config(None, [
        f"data.train={tmp_path}/text/train", "data.val=null", "data.features=[tokens]", "data.label=null",
        "task.name=causal_lm", "task.loss=model", "model.entrypoint=test_flavour:gpt2_default",
        "model.inputs={input_ids: tokens}", f"model.pretrained={tmp_path}/base",
        f"tracking.uri={store}", "tracking.experiment=fine-tune"])
    infos = inspect_datasets(config.data, named=True)
    config = resolve_for_data(config, infos)

    # The workers' model (the builder's class, from_pretrained), fine-tuned: weights moved off the saved ones.
    tuned = build_model(config.model.name, config.model.entrypoint, None, config.model.num_classes,
                        config.model.kwargs, config.model.pretrained)
    with torch.no_grad():
        for parameter in tuned.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    tuned.eval()
    input_ids = collate_sample(infos["train"].sample, config.data, named=True)["tokens"]
    with torch.no_grad():
        expected = tuned(input_ids=input_ids).logits
        base = GPT2LMHeadModel.from_pretrained(tmp_path / "base").eval()(input_ids=input_ids).logits
    assert not torch.allclose(expected, base, atol=1e-3)  # the tuned weights are what is compared below

    capsys.readouterr()
    run_id = _log(config, infos["train"], tuned.state_dict())
    assert "not logged as an MLflow Model" not in capsys.readouterr().err

    mlflow_uri(config.tracking.uri)  # type: ignore[arg-type]
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")  # a Hugging Face model is saved pickled
    loaded = mlflow.pytorch.load_model(f"runs:/{run_id}/model")
    assert (loaded.config.n_layer, loaded.config.n_embd, loaded.config.n_positions) == (1, 16, 24)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=input_ids).logits, expected)
    # The pyfunc flavour calls it by keyword on the token column and answers the next token (causal_lm).
    frame = infos["train"].sample.select(["tokens"]).to_pandas()
    predicted = mlflow.pyfunc.load_model(f"runs:/{run_id}/model").predict(frame)
    assert predicted["next_token"].tolist() == expected[:, -1].argmax(-1).tolist()


def test_a_builder_reading_a_relative_file_is_logged(tmp_path: Path, digits_dir: str, store: str,
                                                    mlflow_uri: Callable[[str], None],
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import mlflow

    from orchestrator.run.checks import resolve_for_data
    from pipelines.batches import collate_sample
    from pipelines.datasets import inspect_datasets

    monkeypatch.chdir(tmp_path)  # where the user runs `orchestrator train`, beside the builder's file
    Path("arch.json").write_text(json.dumps({"width": 12}))
    config = load_config(None, [
        f"data.train={digits_dir}/train", "data.val=null", "model.entrypoint=test_flavour:mlp_from_file",
        f"tracking.uri={store}", "tracking.experiment=relative"])
    infos = inspect_datasets(config.data)
    config = resolve_for_data(config, infos)
    torch.manual_seed(1)
    trained = mlp_from_file(64, 10).eval()

    capsys.readouterr()
    run_id = _log(config, infos["train"], trained.state_dict())
    assert "not logged as an MLflow Model" not in capsys.readouterr().err

    mlflow_uri(config.tracking.uri)  # type: ignore[arg-type]
    loaded = mlflow.pytorch.load_model(f"runs:/{run_id}/model")
    x = collate_sample(infos["train"].sample, config.data, named=False)["x"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), trained(x))


# The pyfunc flavour: feature columns by name, answers in the task's terms (orchestrator/tracking/pyfunc.py).


def tiny_mlp(in_features: int, num_classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(in_features, 6), torch.nn.ReLU(), torch.nn.Linear(6, num_classes))


@pytest.fixture(scope="module")
def mixed_columns(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Three feature columns of three kinds (a fixed-size list of 8 floats, a float, an integer), a class label
    and a regression target: 200 rows."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("mixed")
    (root / "train").mkdir()
    rng = np.random.default_rng(0)
    rows = 200
    pixels = rng.normal(size=(rows, 8)).astype(np.float32)
    table = pa.table({
        "pixels": pa.FixedSizeListArray.from_arrays(pa.array(pixels.ravel()), 8),
        "age": pa.array(rng.normal(size=rows).astype(np.float32)),
        "count": pa.array(rng.integers(0, 5, size=rows), type=pa.int64()),
        "label": pa.array(rng.integers(0, 3, size=rows), type=pa.int64()),
        "y": pa.array(rng.normal(size=rows).astype(np.float32))})
    pq.write_table(table, root / "train" / "part-0.parquet")
    return str(root / "train")


def _frame_and_x(path: str) -> tuple[Any, torch.Tensor]:
    """The rows as a DataFrame a user passes, and the model's input computed here: the three columns in
    data.features order, concatenated as float32."""
    import numpy as np
    import pyarrow.parquet as pq

    frame = pq.read_table(path).to_pandas()[["pixels", "age", "count"]]
    x = np.concatenate([np.stack(frame["pixels"].to_numpy()), frame[["age"]].to_numpy(np.float32),
                        frame[["count"]].to_numpy(np.float32)], axis=1).astype(np.float32)
    return frame, torch.from_numpy(x)


def _log_tiny(task: str, path: str, store: str, extra: list[str]) -> tuple[str, torch.nn.Module]:
    from orchestrator.run.checks import resolve_for_data
    from pipelines.datasets import inspect_datasets

    config = load_config(None, [
        f"data.train={path}", "data.val=null", "data.features=[pixels, age, count]", f"task.name={task}",
        "model.entrypoint=test_flavour:tiny_mlp", f"tracking.uri={store}", f"tracking.experiment={task}",
        *extra])
    infos = inspect_datasets(config.data)
    config = resolve_for_data(config, infos)
    torch.manual_seed(3)
    trained = tiny_mlp(10, config.model.num_classes or 1).eval()  # type: ignore[arg-type]
    return _log(config, infos["train"], trained.state_dict()), trained


def test_pyfunc_classification_takes_columns_by_name_and_returns_class_and_probabilities(
        mixed_columns: str, store: str, mlflow_uri: Callable[[str], None], capsys: pytest.CaptureFixture[str]
        ) -> None:
    import mlflow
    import numpy as np

    capsys.readouterr()
    run_id, trained = _log_tiny("classification", mixed_columns, store, ["data.label=label", "model.num_classes=3"])
    assert "not logged as an MLflow Model" not in capsys.readouterr().err
    frame, x = _frame_and_x(mixed_columns)
    with torch.no_grad():
        logits = trained(x)
    mlflow_uri(store)
    uri = f"runs:/{run_id}/model"
    pyfunc = mlflow.pyfunc.load_model(uri)

    predicted = pyfunc.predict(frame)
    shuffled = pyfunc.predict(frame[["count", "pixels", "age"]])  # columns by name, not by position
    assert list(predicted.columns) == ["class", "probabilities"]
    np.testing.assert_array_equal(predicted["class"].to_numpy(), logits.argmax(-1).numpy())
    probabilities = np.stack(predicted["probabilities"].to_numpy())
    np.testing.assert_allclose(probabilities, torch.softmax(logits, -1).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(shuffled["class"].to_numpy(), predicted["class"].to_numpy())
    np.testing.assert_allclose(np.stack(shuffled["probabilities"].to_numpy()), probabilities)
    assert len(set(predicted["class"])) > 1  # the comparison above can tell classes apart
    with pytest.raises(Exception, match="age"):  # a missing column is named
        pyfunc.predict(frame[["pixels", "count"]])

    signature = pyfunc.metadata.signature
    assert signature is not None
    assert [c.name for c in signature.inputs.inputs] == ["pixels", "age", "count"]
    assert [c.name for c in signature.outputs.inputs] == ["class", "probabilities"]
    # mlflow.pytorch still gives the torch module back: raw logits on the concatenated input.
    loaded = mlflow.pytorch.load_model(uri)
    assert isinstance(loaded, torch.nn.Module)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), logits)


def test_pyfunc_regression_returns_values(mixed_columns: str, store: str, mlflow_uri: Callable[[str], None]
                                          ) -> None:
    import mlflow
    import numpy as np

    run_id, trained = _log_tiny("regression", mixed_columns, store, ["data.label=y"])
    frame, x = _frame_and_x(mixed_columns)
    with torch.no_grad():
        expected = trained(x)[:, 0].numpy()
    mlflow_uri(store)
    predicted = mlflow.pyfunc.load_model(f"runs:/{run_id}/model").predict(frame[["age", "count", "pixels"]])
    assert list(predicted.columns) == ["prediction"]
    np.testing.assert_allclose(predicted["prediction"].to_numpy(), expected, rtol=1e-5, atol=1e-6)


def test_the_built_in_gpt_is_logged_and_its_pyfunc_predicts_the_next_token_of_its_input_windows(
        tmp_path: Path, store: str, mlflow_uri: Callable[[str], None], capsys: pytest.CaptureFixture[str]) -> None:
    # A token column without a label trains on x = tokens[:-1] (one position fewer than the stored window): the
    # model's positions end there, so the input example and what pyfunc is given are windows of that length.
    import mlflow

    from orchestrator.models.inputs import in_features
    from orchestrator.models.zoo import build_model
    from orchestrator.run.checks import resolve_for_data
    from pipelines.batches import collate_sample
    from pipelines.datasets import inspect_datasets
    from pipelines.prepare import prepare_text

    prepare_text([str(ROOT / "README.md")], str(tmp_path / "text"), seq_len=16, shards=1)
    config = load_config(ROOT / "examples" / "text-gpt.yaml", [
        f"data.train={tmp_path}/text/train", "data.val=null", "model.d_model=16", "model.n_layer=1",
        "model.n_head=2", f"tracking.uri={store}", "tracking.experiment=gpt-logging"])
    infos = inspect_datasets(config.data)
    config = resolve_for_data(config, infos)
    torch.manual_seed(0)
    model = build_model("gpt", None, in_features(config, infos["train"]), config.model.num_classes,
                        config.model.kwargs).eval()
    x = collate_sample(infos["train"].sample, config.data, named=False)["x"]
    with torch.no_grad():
        expected = model(x)[:, -1].argmax(-1).tolist()

    capsys.readouterr()
    run_id = _log(config, infos["train"], model.state_dict())
    assert "not logged as an MLflow Model" not in capsys.readouterr().err
    mlflow_uri(store)
    frame = infos["train"].sample.select(["tokens"]).to_pandas()
    frame["tokens"] = frame["tokens"].map(lambda window: window[:-1])  # the windows the model was fed
    assert mlflow.pyfunc.load_model(f"runs:/{run_id}/model").predict(frame)["next_token"].tolist() == expected
