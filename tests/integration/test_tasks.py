"""Bring your own task, end to end on local Ray with 2 workers: the built-in GPT on byte-tokenised text
(`prepare text`, auto micro-batch, next-token loss), the examples' Hugging Face models (GPT-2 on prepared text, a
BERT classifier on variable-length token lists, checked against what its forward passes were given), regression
and a two-input model on the diabetes data, multilabel against scikit-learn on the model's own predictions, a study
ranked by val_rmse, pretrained weights from an object store, and each task's bad input refused before Ray
starts."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from recording_bert import read_calls

from orchestrator import load_config
from orchestrator.errors import ConfigError
from orchestrator.run.launch import train
from orchestrator.run.result import TrainResult

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def example(name: str, tmp: Path, *overrides: str) -> Any:
    return load_config(ROOT / "examples" / name, [f"storage.path={tmp}/runs", "tracking.enabled=false",
                                                  "scaling.num_workers=2", *overrides])


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipelines.prepare import prepare_text

    out = tmp_path_factory.mktemp("text")
    prepare_text([str(ROOT / "README.md"), str(ROOT / "orchestrator" / "run" / "launch.py")], str(out), seq_len=32)
    return out


@pytest.fixture(scope="module")
def gpt2_run(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory, text_dir: Path) -> TrainResult:
    """The GPT-2 example trained briefly on the prepared text; its final weights are the pretrained ones below."""
    cfg = example("text-gpt2.yaml", tmp_path_factory.mktemp("gpt2"), f"data.train={text_dir}/train",
                  f"data.val={text_dir}/val", "model.context=64", "model.width=32", "model.layers=1",
                  "train.max_steps=30", "train.log_every=10", "train.eval_every=30", "train.global_batch_size=16",
                  "train.micro_batch_size=4", "optim.warmup_steps=5")
    return train(cfg, verbose=False)


def test_a_hugging_face_gpt2_trains_on_prepared_text_with_its_own_loss(gpt2_run: TrainResult) -> None:
    result = gpt2_run
    history, final = result.history, result.metrics
    assert result.config.model.num_classes == 256  # the vocabulary, from the shards' metadata
    assert history[0]["train_loss"] < 6.0  # near ln(256) = 5.5: the model's mean, turned into a sum and back
    assert history[-1]["train_loss"] < 0.75 * history[0]["train_loss"]
    assert history[0]["grad_accum_steps"] == 2  # 4 per micro-batch x 2 accumulated x 2 workers = 16
    # Tokens counted as the model's loss counts them: 32 targets per row of 33 tokens (the first has no target).
    assert history[-1]["tokens_per_s"] == pytest.approx(32 * history[-1]["samples_per_s"])
    assert final["val_perplexity"] == pytest.approx(math.exp(final["val_loss"]))
    assert 0 < final["val_accuracy"] < 1


def test_gpt_trains_on_prepared_text_and_its_loss_falls(ray_cluster: None, tmp_path: Path) -> None:
    import numpy as np

    from pipelines.prepare import prepare_text

    # Text whose next byte is half chance, half context: a random lowercase letter (1 of 16), then the same letter
    # in upper case. A model that reads its input predicts every capital and guesses the letters: accuracy about
    # 1/2 + 1/32 (0.53 seen), loss never below the entropy rate, ln(16)/2 nats per byte (2.8 seen after 60 steps).
    # Ignoring the input leaves byte frequencies and positions (accuracy 0.06); targets not shifted from the inputs
    # are copied (accuracy 1.0), shifted by two are chance (1/16); a loss per sequence, not per token, is ~32x.
    letters = np.random.default_rng(0).integers(0, 16, 80_000)
    text = np.empty(2 * len(letters), np.uint8)
    text[0::2], text[1::2] = ord("a") + letters, ord("A") + letters
    (tmp_path / "pairs.txt").write_bytes(text.tobytes())
    counts = prepare_text([str(tmp_path / "pairs.txt")], str(tmp_path / "text"), seq_len=32)
    assert counts["train"] > 100
    cfg = load_config(ROOT / "examples" / "text-gpt.yaml", [
        f"data.train={tmp_path}/text/train", f"data.val={tmp_path}/text/val", "scaling.num_workers=2",
        "model.d_model=32", "model.n_layer=1", "model.n_head=2", "train.max_steps=60", "train.log_every=10",
        "train.eval_every=60", "train.global_batch_size=32", "train.memory_budget_gb=1",
        f"storage.path={tmp_path}/runs", "tracking.enabled=false",
    ])
    result = train(cfg, verbose=False)
    history = result.history
    assert result.config.model.num_classes == 256  # the vocabulary, from the shards' metadata
    assert history[-1]["train_loss"] < 0.7 * history[0]["train_loss"]
    assert history[0]["train_loss"] < 6.0  # starts near ln(256) = 5.5: a per-token loss, not a sum
    assert history[-1]["tokens_per_s"] == pytest.approx(32 * history[-1]["samples_per_s"])
    # Auto micro-batch: whatever was chosen, micro x accumulation x workers is the configured global batch.
    micro, accum = history[0]["micro_batch_size"], history[0]["grad_accum_steps"]
    assert micro * accum * 2 == 32
    val_loss, val_accuracy = result.metrics["val_loss"], result.metrics["val_accuracy"]
    assert 0.4 < val_accuracy < 0.6, val_accuracy  # read the context (> 1/32), did not see its targets (~1)
    assert math.log(16) / 2 - 0.05 < val_loss < math.log(32) - 0.25, val_loss
    # Held-out bytes of the same kind: the same per-token loss as training reports, within what 10 steps change.
    assert val_loss == pytest.approx(history[-1]["train_loss"], abs=0.3)


def test_pretrained_weights_come_from_an_object_store_prefix(gpt2_run: TrainResult, tmp_path: Path, text_dir: Path,
                                                            moto: Any, aws_env: None) -> None:
    import boto3
    from ray.train import Checkpoint

    from examples.models import gpt2
    from orchestrator.training.checkpoint import load_state

    # Weights that already predict this text (the trained run's), saved as a user would, then uploaded.
    model = gpt2(context=64, width=32, layers=1)
    with Checkpoint(gpt2_run.checkpoint_path).as_directory() as directory:  # type: ignore[arg-type]
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
    assert start == pytest.approx(gpt2_run.history[-1]["train_loss"], abs=0.4) and start < 4.5, start


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
                  "scaling.num_workers=2", "tune.num_samples=2", "tune.scheduler=fifo", "tune.grace_period=null",
                  "tune.reduction_factor=null", "tune.seed=1", "tune.max_concurrent_trials=1",
                  f"tracking.uri=sqlite:///{tmp_path}/mlruns.db", "tracking.enabled=true")
    result = tune(cfg, verbose=False)
    assert (result.metric, result.mode) == ("val_rmse", "min")
    scored = [t.metric for t in result.trials]
    assert len(scored) == 2 and all(m is not None for m in scored)
    assert result.best.metric == min(scored)  # type: ignore[type-var]
    # Two-worker trials train through their own Ray Train run, whose rank 0 sends every report to the trial's
    # actor (training/channel.py), which hands it to Tune: each evaluation is in the trial's history.
    for trial in result.trials:
        assert [h["step"] for h in trial.history if "val_rmse" in h] == [20, 40], (trial.trial_id, trial.history)


@pytest.fixture(scope="module")
def multilabel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 float features, 4 labels each set by a side of a hyperplane: from about a tenth to a half positive."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path_factory.mktemp("multilabel")
    rng = np.random.default_rng(0)
    weights, bias = rng.normal(size=(8, 4)), np.array([-1.0, -0.5, 0.0, -0.8])
    for split, count in (("train", 1024), ("val", 256)):
        x = rng.normal(size=(count, 8)).astype(np.float32)
        y = (x @ weights / np.sqrt(8) + bias > 0).astype(np.int64)
        (out / split).mkdir()
        pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 8),
                                 "y": pa.FixedSizeListArray.from_arrays(pa.array(y.ravel()), 4)}),
                       out / split / "part-0.parquet")
    return out


def test_multilabel_trains_and_reports_scikit_learns_f1_of_its_own_predictions(ray_cluster: None, tmp_path: Path,
                                                                               multilabel_dir: Path) -> None:
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from ray.train import Checkpoint
    from sklearn.metrics import accuracy_score, f1_score, log_loss

    from orchestrator.models.zoo import build_model
    from orchestrator.training.checkpoint import load_state

    cfg = load_config(None, [
        f"data.train={multilabel_dir}/train", f"data.val={multilabel_dir}/val", "data.features=[x]", "data.label=y",
        "task.name=multilabel", "model.hidden=[32]", "scaling.num_workers=2", "train.global_batch_size=64",
        "train.max_steps=40", "train.log_every=10", "train.eval_every=10", "checkpoint.every=40",
        "train.precision=fp32", "optim.lr=0.03", "optim.warmup_steps=2", f"storage.path={tmp_path}/runs",
        "tracking.enabled=false"])
    result = train(cfg, verbose=False)
    assert result.config.model.num_classes == 4  # the label list's width
    final = result.metrics
    assert set(final) >= {"val_loss", "val_accuracy", "val_f1"} and 0 <= final["val_f1"] <= 1, final
    evaluated = [h["val_f1"] for h in result.history if "val_f1" in h]
    assert len(evaluated) == 4 and evaluated[-1] > evaluated[0], evaluated
    # The reported figures are scikit-learn's on the final model's own predictions over the whole val split
    # (both ranks' halves pooled).
    model = build_model("mlp", None, 8, 4, {"hidden": [32]})
    with Checkpoint(result.checkpoint_path).as_directory() as directory:  # type: ignore[arg-type]
        model.load_state_dict(load_state(directory)["model"])
    val = pq.read_table(multilabel_dir / "val")
    x = torch.tensor(np.stack(val.column("x").to_numpy(zero_copy_only=False)), dtype=torch.float32)
    truth = np.stack(val.column("y").to_numpy(zero_copy_only=False))
    with torch.no_grad():
        logits = model(x)
    predicted = (logits > 0).long().numpy()
    assert final["val_f1"] == pytest.approx(f1_score(truth, predicted, average="micro"), rel=1e-9)
    assert final["val_accuracy"] == pytest.approx(accuracy_score(truth.ravel(), predicted.ravel()), rel=1e-9)
    assert final["val_loss"] == pytest.approx(log_loss(truth.ravel(), torch.sigmoid(logits.double()).numpy().ravel()),
                                              rel=1e-4)
    # A learned model: well above predicting every label (F1 2p / (1 + p): 0.37 at this data's 23% positive).
    assert final["val_f1"] > 0.8, final


def test_a_bert_classifier_trains_on_variable_length_token_lists(ray_cluster: None, tmp_path: Path) -> None:
    from pipelines.prepare import prepare_sequences

    prepare_sequences(str(tmp_path / "sequences"), rows=1200)
    # The example's model, recording what each forward pass is given (recording_bert.py). Micro-batches of 4 rows
    # of 4-24 tokens: about one in seven has no row past 16 tokens and must be narrower than its fetch.
    cfg = example("sequences-bert.yaml", tmp_path, f"data.train={tmp_path}/sequences/train",
                  f"data.val={tmp_path}/sequences/val", "model.width=32", "model.layers=1", "train.max_steps=60",
                  "train.log_every=20", "train.eval_every=60", "train.global_batch_size=32",
                  "train.micro_batch_size=4", "optim.lr=3e-3", "optim.warmup_steps=5",
                  "model.entrypoint=recording_bert:build", f"model.out_dir={tmp_path}/seen")
    result = train(cfg, verbose=False)
    assert result.config.model.num_classes == 2
    assert result.history[0]["grad_accum_steps"] == 4  # 4 rows x 4 accumulated x 2 workers = 32
    check_padding_seen(read_calls(str(tmp_path / "seen")), tmp_path / "sequences", multiple=8, micro=4,
                       forwards=60 * 4 * 2)
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    # Each rank's own pace, for doctor's uneven-workers rule.
    assert all(result.history[-1][f"worker/{rank}/samples_per_s"] > 0 for rank in (0, 1))
    # Counting tokens 2 and 3 needs the ids and the mask (padding is token 0): well above the majority class.
    assert result.metrics["val_accuracy"] > 0.7, result.metrics


def check_padding_seen(calls: list[dict[str, Any]], data: Path, multiple: int, micro: int, forwards: int) -> None:
    """What the model was given, against the data: no real token cut (each row given is a whole row of its split),
    the mask exactly the real tokens (the data has no id 0, the padding), each training micro-batch as wide as its
    own longest row rounded up to the multiple (trimmed, not padded to its fetch), and the tokens of whole epochs."""
    import numpy as np
    import pyarrow.parquet as pq

    rows = {split: [tuple(r) for r in pq.read_table(data / split).column("input_ids").to_pylist()]
            for split in ("train", "val")}
    training = [call for call in calls if call["training"]]
    assert len(training) >= forwards, len(training)  # every micro-batch of both ranks (and the FLOPs count's)
    for call in calls:
        ids, mask = np.array(call["input_ids"]), np.array(call["attention_mask"])
        assert np.array_equal(mask, ids != 0), "the mask is not exactly the real tokens"
        given = [tuple(int(t) for t in row[row != 0]) for row in ids]
        whole = set(rows["train" if call["training"] else "val"])
        cut = [row for row in given if row not in whole]
        assert not cut, f"{len(cut)} row(s) given that are not whole rows of the data, e.g. {cut[0]}"
        longest = max(len(row) for row in given)
        assert ids.shape[1] == -(-longest // multiple) * multiple, (ids.shape, longest)
    # 60 steps of 32 rows are two epochs of the 960 training rows: every row was seen (whole, as checked above).
    seen = {tuple(int(t) for t in row[row != 0]) for call in training for row in np.array(call["input_ids"])}
    assert all(len(np.array(call["input_ids"])) == micro for call in training)
    assert seen == set(rows["train"]), f"{len(set(rows['train']) - seen)} training rows never seen"
