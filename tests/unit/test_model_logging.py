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

ROOT = Path(__file__).resolve().parents[2]


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
    from orchestrator.model_logging import log_final_model
    from orchestrator.tracking import MlflowTracker

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

    from orchestrator.checks import resolve_for_data
    from orchestrator.models import build_model
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
        "task.name=causal_lm", "task.loss=model", "model.entrypoint=test_model_logging:gpt2_default",
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


def test_a_builder_reading_a_relative_file_is_logged(tmp_path: Path, digits_dir: str, store: str,
                                                    mlflow_uri: Callable[[str], None],
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import mlflow

    from orchestrator.checks import resolve_for_data
    from pipelines.batches import collate_sample
    from pipelines.datasets import inspect_datasets

    monkeypatch.chdir(tmp_path)  # where the user runs `orchestrator train`, beside the builder's file
    Path("arch.json").write_text(json.dumps({"width": 12}))
    config = load_config(None, [
        f"data.train={digits_dir}/train", "data.val=null", "model.entrypoint=test_model_logging:mlp_from_file",
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
