"""Bring your own task, end to end on local Ray with 2 workers: the examples' Hugging Face models (GPT-2 on
prepared text, a BERT classifier on variable-length token lists), regression and a two-input model on the diabetes
data, a study ranked by val_rmse, pretrained weights from an object store, and each task's bad input refused
before Ray starts."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator import load_config
from orchestrator.errors import ConfigError
from orchestrator.launch import train

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def example(name: str, tmp: Path, *overrides: str) -> Any:
    return load_config(ROOT / "examples" / name, [f"storage.path={tmp}/runs", "tracking.enabled=false",
                                                  "scaling.num_workers=2", *overrides])


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipelines.prepare import prepare_text

    out = tmp_path_factory.mktemp("text")
    prepare_text([str(ROOT / "README.md"), str(ROOT / "orchestrator" / "launch.py")], str(out), seq_len=32)
    return out


def test_a_hugging_face_gpt2_trains_on_prepared_text_with_its_own_loss(ray_cluster: None, tmp_path: Path,
                                                                        text_dir: Path) -> None:
    cfg = example("text-gpt2.yaml", tmp_path, f"data.train={text_dir}/train", f"data.val={text_dir}/val",
                  "model.context=64", "model.width=32", "model.layers=1", "train.max_steps=30",
                  "train.log_every=10", "train.eval_every=30", "train.global_batch_size=16",
                  "train.micro_batch_size=4", "optim.warmup_steps=5")
    result = train(cfg, verbose=False)
    history, final = result.history, result.metrics
    assert result.config.model.num_classes == 256  # the vocabulary, from the shards' metadata
    assert history[0]["train_loss"] < 6.0  # near ln(256) = 5.5: the model's mean, turned into a sum and back
    assert history[-1]["train_loss"] < 0.75 * history[0]["train_loss"]
    assert history[0]["grad_accum_steps"] == 2  # 4 per micro-batch x 2 accumulated x 2 workers = 16
    # Tokens counted as the model's loss counts them: 32 targets per row of 33 tokens (the first has no target).
    assert history[-1]["tokens_per_s"] == pytest.approx(32 * history[-1]["samples_per_s"])
    assert final["val_perplexity"] == pytest.approx(math.exp(final["val_loss"]))
    assert 0 < final["val_accuracy"] < 1


def test_pretrained_weights_come_from_an_object_store_prefix(ray_cluster: None, tmp_path: Path, text_dir: Path,
                                                            moto: Any, aws_env: None) -> None:
    import boto3

    from examples.models import gpt2

    # Weights that already predict this text (a trained run's), saved as a user would, then uploaded.
    cfg = example("text-gpt2.yaml", tmp_path, f"data.train={text_dir}/train", "data.val=null", "model.context=64",
                  "model.width=32", "model.layers=1", "train.max_steps=40", "train.log_every=10",
                  "train.global_batch_size=16", "train.micro_batch_size=8", "optim.warmup_steps=5")
    trained = train(cfg, verbose=False)
    from ray.train import Checkpoint

    from orchestrator.training.checkpoint import load_state

    model = gpt2(context=64, width=32, layers=1)
    with Checkpoint(trained.checkpoint_path).as_directory() as directory:  # type: ignore[arg-type]
        model.load_state_dict(load_state(directory)["model"])
    model.save_pretrained(tmp_path / "pretrained")
    client = boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1")
    client.create_bucket(Bucket="models")
    for file in (tmp_path / "pretrained").iterdir():
        client.upload_file(str(file), "models", f"gpt2-tiny/{file.name}")

    again = example("text-gpt2.yaml", tmp_path / "again", f"data.train={text_dir}/train", "data.val=null",
                    "model.context=64", "model.width=32", "model.layers=1", "train.max_steps=10",
                    "train.log_every=10", "train.global_batch_size=16", "train.micro_batch_size=8",
                    "optim.lr=1e-6", "optim.warmup_steps=1", "model.pretrained=s3://models/gpt2-tiny",
                    f"data.s3.endpoint={moto.url}")
    start = train(again, verbose=False).history[0]["train_loss"]
    # Where the trained run ended, not at a fresh model's ln(256) = 5.5.
    assert start == pytest.approx(trained.history[-1]["train_loss"], abs=0.4) and start < 4.5, start


def test_each_tasks_bad_input_is_refused_before_ray_starts(tmp_path: Path, text_dir: Path, digits_dir: str) -> None:
    # A float target for classification: the message names the column, its type and the task that fits.
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "floats").mkdir()
    pq.write_table(pa.table({"x": pa.array([1.0, 2.0] * 8), "y": pa.array([0.5, 1.5] * 8)}),
                   tmp_path / "floats" / "a.parquet")
    base = [f"storage.path={tmp_path}/runs", "tracking.enabled=false", "data.val=null", "scaling.num_workers=1"]
    with pytest.raises(ConfigError, match=r"data.label 'y' .* has type double, but task classification needs "
                                          r"integer class ids \(for float targets use task.name=regression\)"):
        train(load_config(None, [*base, f"data.train={tmp_path}/floats", "data.features=[x]", "data.label=y",
                                 "train.global_batch_size=4"]), verbose=False)
    # A forward that does not take the inputs it is given by name, through the CLI: exit 2, one line, no Ray.
    command = [sys.executable, "-m", "orchestrator", "train", "--config", str(ROOT / "examples" / "text-gpt2.yaml"),
               "--set", f"data.train={text_dir}/train", "--set", f"data.val={text_dir}/val",
               "--set", "model.inputs={tokens: tokens}", *[a for o in base for a in ("--set", o)]]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        "error: config key 'model.inputs': the forward of model 'examples.models:gpt2' (GPT2LMHeadModel) takes no "
        "argument ['tokens']; it takes ['input_ids',"), out.stderr
    assert "ray" not in out.stdout.lower() and "Ray" not in out.stderr.replace("Ray Train", "")
    # A mask the batch does not have: named-input models get one only with a variable-length column.
    with pytest.raises(ConfigError, match=r"\['attention_mask'\] are not in the batch, which has \['labels', "
                                          r"'tokens'\]"):
        train(load_config(ROOT / "examples" / "text-gpt2.yaml", [
            *base, f"data.train={text_dir}/train", "model.inputs={input_ids: tokens, attention_mask: attention_mask}",
        ]), verbose=False)


@pytest.fixture(scope="module")
def diabetes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipelines.prepare import prepare_diabetes

    out = tmp_path_factory.mktemp("diabetes")
    prepare_diabetes(str(out))
    return out


def test_regression_on_diabetes_learns_and_reports_its_metrics(ray_cluster: None, tmp_path: Path,
                                                              diabetes_dir: Path) -> None:
    cfg = example("diabetes-regression.yaml", tmp_path, f"data.train={diabetes_dir}/train",
                  f"data.val={diabetes_dir}/val", "train.max_steps=120", "train.log_every=40", "train.eval_every=40",
                  "tracking.enabled=true", f"tracking.uri=sqlite:///{tmp_path}/mlruns.db")
    result = train(cfg, verbose=False)  # with its artifacts: the learning curves plot the task's metric
    final = result.metrics
    assert result.config.model.num_classes == 1  # one output per target
    assert set(final) >= {"val_loss", "val_mse", "val_rmse", "val_mae", "val_r2"}
    assert final["val_rmse"] == pytest.approx(math.sqrt(final["val_mse"]))
    # The standardised target has variance ~1: a model that learned explains a good share of it (sklearn's
    # linear regression reaches R² ~0.45 on this data); one predicting the mean has R² ~0 and RMSE ~1.
    assert final["val_r2"] > 0.3 and final["val_rmse"] < 0.85, final
    assert result.history[-1]["train_loss"] < 0.7 * result.history[0]["train_loss"]


def test_a_two_input_model_gets_category_ids_and_dense_floats_by_name(ray_cluster: None, tmp_path: Path,
                                                                     diabetes_dir: Path) -> None:
    cfg = example("diabetes-two-input.yaml", tmp_path, f"data.train={diabetes_dir}/train",
                  f"data.val={diabetes_dir}/val", "train.max_steps=120", "train.log_every=40", "train.eval_every=40")
    result = train(cfg, verbose=False)
    assert result.metrics["val_r2"] > 0.15, result.metrics  # embeddings of int64 ids next to float32 features
    assert result.history[-1]["train_loss"] < 0.9 * result.history[0]["train_loss"]


def test_a_study_over_the_regression_example_ranks_by_val_rmse(ray_cluster: None, tmp_path: Path,
                                                              diabetes_dir: Path) -> None:
    from orchestrator import tune

    cfg = example("diabetes-regression.yaml", tmp_path, f"data.train={diabetes_dir}/train",
                  f"data.val={diabetes_dir}/val", "train.max_steps=40", "train.log_every=20", "train.eval_every=20",
                  "scaling.num_workers=1", "tune.num_samples=2", "tune.scheduler=fifo", "tune.grace_period=null",
                  "tune.reduction_factor=null", "tune.seed=1", "tune.max_concurrent_trials=1",
                  f"tracking.uri=sqlite:///{tmp_path}/mlruns.db", "tracking.enabled=true")
    result = tune(cfg, verbose=False)
    assert (result.metric, result.mode) == ("val_rmse", "min")
    scored = [t.metric for t in result.trials]
    assert len(scored) == 2 and all(m is not None for m in scored)
    assert result.best.metric == min(scored)  # type: ignore[type-var]


def test_a_bert_classifier_trains_on_variable_length_token_lists(ray_cluster: None, tmp_path: Path) -> None:
    from pipelines.prepare import prepare_sequences

    prepare_sequences(str(tmp_path / "sequences"), rows=1200)
    cfg = example("sequences-bert.yaml", tmp_path, f"data.train={tmp_path}/sequences/train",
                  f"data.val={tmp_path}/sequences/val", "model.width=32", "model.layers=1", "train.max_steps=60",
                  "train.log_every=20", "train.eval_every=60", "train.global_batch_size=32", "optim.lr=3e-3",
                  "optim.warmup_steps=5")
    result = train(cfg, verbose=False)
    assert result.config.model.num_classes == 2
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    # Each rank's own pace, for doctor's uneven-workers rule.
    assert all(result.history[-1][f"worker/{rank}/samples_per_s"] > 0 for rank in (0, 1))
    # Counting tokens 2 and 3 needs the ids and the mask (padding is token 0): well above the majority class.
    assert result.metrics["val_accuracy"] > 0.7, result.metrics
