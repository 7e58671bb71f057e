"""A user's own task in-process (no Ray): named-tensor batches, every model output form, each task's loss and
metrics against a direct computation, and the loop's guarantees (accumulation equivalence, bitwise resume) on
tasks other than classification."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from test_loop import CPU, Recorder, update

from orchestrator.config import load_config
from orchestrator.errors import ConfigError
from orchestrator.models.tasks import (
    CausalLM,
    Classification,
    ModelCall,
    Multilabel,
    Regression,
    build_task,
    check_forward,
    logits_of,
)
from orchestrator.training.checkpoint import Progress, restore
from orchestrator.training.evaluation import evaluate
from orchestrator.training.loop import Data, run
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision
from orchestrator.training.step import train_step
from pipelines.batches import EpochReplay, collate_arrow, padding_of, split_batches
from pipelines.tensors import IGNORE_INDEX, Padded, Padding, cat_rows

SGD = ["optim.name=sgd", "optim.momentum=0", "optim.weight_decay=0", "optim.lr=1", "optim.warmup_steps=0",
       "optim.schedule=constant", "optim.max_grad_norm=null"]


# --- batches of named tensors ---------------------------------------------------------------------------------

def test_columns_keep_their_meaning_and_token_lists_are_padded_with_a_mask() -> None:
    from ray.data.extensions import ArrowTensorArray

    table = pa.table({
        "ids": pa.array([[1, 5, 6], [1, 7], [1, 8, 9, 10, 11]], type=pa.list_(pa.int64())),
        "category": pa.array([3, 0, 2], type=pa.int32()),
        "dense": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(6, dtype=np.float64)), 2),
        "image": ArrowTensorArray.from_numpy(np.arange(12, dtype=np.float32).reshape(3, 2, 2)),
        "label": pa.array([0, 1, 1]),
    }).slice(1)  # a sliced table exercises the list offsets
    padding = padding_of(table.schema, ["ids", "category", "dense", "image"], "label", named=True)
    batch = collate_arrow(table, ["ids", "category", "dense", "image"], "label", named=True, padding=padding)
    assert batch["ids"].tolist() == [[1, 7, 0, 0, 0], [1, 8, 9, 10, 11]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["ids"].dtype == batch["category"].dtype == torch.int64 and batch["category"].tolist() == [0, 2]
    assert batch["dense"].dtype == torch.float32 and batch["dense"].tolist() == [[2, 3], [4, 5]]
    assert batch["image"].shape == (2, 2, 2) and batch["labels"].tolist() == [1, 1]
    # A micro-batch cut from the fetch is trimmed to its own longest row (rounded up to the multiple).
    (short, long_) = split_batches([batch], 1, drop_last=False, padding=padding)
    assert short["ids"].tolist() == [[1, 7]] and short["attention_mask"].tolist() == [[1, 1]]
    assert long_["ids"].shape == (1, 5)
    padding = Padding(padding.groups, multiple=4)
    assert next(iter(split_batches([batch], 1, drop_last=False, padding=padding)))["ids"].shape == (1, 4)


def test_a_named_token_column_without_a_label_is_its_own_target_with_padding_ignored() -> None:
    table = pa.table({"tokens": pa.array([[4, 5, 6], [7]], type=pa.list_(pa.int64()))})
    batch = collate_arrow(table, ["tokens"], None, named=True)
    assert batch["labels"].tolist() == [[4, 5, 6], [7, IGNORE_INDEX, IGNORE_INDEX]]
    assert CausalLM(shift=True).count(batch) == 2  # 5 and 6 follow a token; 7 is followed by padding only


def test_replayed_epochs_mix_rows_of_different_padded_widths() -> None:
    a = {"ids": torch.tensor([[1, 2]]), "attention_mask": torch.tensor([[1, 1]]), "labels": torch.tensor([[1, 2]])}
    b = {"ids": torch.tensor([[3, 4, 5]]), "attention_mask": torch.tensor([[1, 1, 1]]),
         "labels": torch.tensor([[3, 4, 5]])}
    both = cat_rows([a, b])
    assert both["ids"].tolist() == [[1, 2, 0], [3, 4, 5]] and both["labels"][0, 2] == IGNORE_INDEX
    padding = Padding((Padded("ids", "attention_mask", ("labels",)),))
    replay = EpochReplay(keep=True, reshuffle=lambda epoch: epoch, micro=1, padding=padding)
    list(replay(lambda: [a, b], 0))
    later = list(replay(lambda: [a, b], 1))
    assert sorted(x["ids"].shape[1] for x in later) == [2, 3]  # each trimmed back to its own length


# --- model outputs and tasks ------------------------------------------------------------------------------------

class Output(dict):
    """Like transformers' ModelOutput: a dict whose keys are also attributes."""

    __getattr__ = dict.__getitem__


def test_every_output_form_gives_the_logits() -> None:
    logits = torch.randn(2, 3)
    for output in (logits, (logits, "hidden"), {"logits": logits}, Output(logits=logits, loss=torch.tensor(1.0))):
        assert logits_of(output) is logits
    with pytest.raises(TypeError, match="return a tensor"):
        logits_of({"scores": logits})


def test_regression_metrics_match_a_direct_computation() -> None:
    g = torch.Generator().manual_seed(0)
    y, prediction = torch.randn(50, generator=g), torch.randn(50, 1, generator=g)
    task = Regression()
    sums: dict[str, float] = {}
    for rows in (slice(0, 20), slice(20, 50)):  # added over batches as the loop adds over batches and ranks
        for key, value in task.metric_sums(prediction[rows], {"labels": y[rows]}).items():
            sums[key] = sums.get(key, 0.0) + float(value)
    metrics = task.metrics(sums)
    error = prediction.squeeze(1).double() - y.double()
    mse = float((error**2).mean())
    assert metrics["val_mse"] == pytest.approx(mse, rel=1e-6)  # the loss sum is float32, as in training
    assert metrics["val_rmse"] == pytest.approx(math.sqrt(mse), rel=1e-6)
    assert metrics["val_mae"] == pytest.approx(float(error.abs().mean()), rel=1e-9)
    assert metrics["val_r2"] == pytest.approx(1 - mse / float(y.double().var(unbiased=False)), rel=1e-6)
    with pytest.raises(ValueError, match="one output per target"):
        task.loss_sum(torch.randn(50, 3), {"labels": y})


def test_classification_top5_and_multilabel_f1() -> None:
    logits = torch.tensor([[9.0, 8, 7, 6, 5, 4, 0], [0.0, 1, 2, 3, 4, 5, 9]])
    task = Classification(num_classes=7)
    sums = {k: float(v) for k, v in task.metric_sums(logits, {"labels": torch.tensor([4, 0])}).items()}
    assert task.metrics(sums)["val_accuracy"] == 0 and task.metrics(sums)["val_top5_accuracy"] == 0.5
    assert "top5" not in Classification(num_classes=5).metric_sums(logits[:, :5], {"labels": torch.tensor([4, 0])})
    labels = torch.tensor([[1.0, 0, 1], [0, 1, 0]])
    predicted = torch.tensor([[2.0, -1, -1], [3, 1, -1]])  # tp 2, fp 1, fn 1
    multi = Multilabel()
    sums = {k: float(v) for k, v in multi.metric_sums(predicted, {"labels": labels}).items()}
    assert multi.metrics(sums)["val_f1"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))
    assert multi.metrics(sums)["val_accuracy"] == pytest.approx(4 / 6) and multi.count({"labels": labels}) == 6


def test_a_users_task_is_loaded_by_module_and_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_task.py").write_text(
        "import torch\nfrom orchestrator.models.tasks import Regression\n"
        "class Huber(Regression):\n"
        "    def loss_sum(self, output, batch):\n"
        "        return torch.nn.functional.huber_loss(output.reshape(batch['labels'].shape).float(),\n"
        "                                              batch['labels'].float(), reduction='sum')\n"
        "class Broken:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    task = build_task("my_task:Huber", None, shift=False)
    assert float(task.loss_sum(torch.tensor([[3.0]]), {"labels": torch.tensor([0.0])})) == 2.5
    with pytest.raises(ConfigError, match=r"lacks \['count', 'loss_sum', 'metric_sums', 'metrics'\]"):
        build_task("my_task:Broken", None, shift=False)
    cfg = load_config(None, ["task=my_task:Huber", "data.label=target"])
    assert cfg.task.name == "my_task:Huber" and (cfg.tune.metric, cfg.tune.mode) == ("val_loss", "min")


# --- the loop on other tasks ------------------------------------------------------------------------------------

class TwoInputs(torch.nn.Module):
    """Category ids through an embedding next to dense floats: a model with two named inputs."""

    def __init__(self, categories: int = 5, dense: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(categories, 4)
        self.head = torch.nn.Sequential(torch.nn.Linear(4 + dense, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, category: torch.Tensor, dense: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        prediction = self.head(torch.cat([self.embed(category), dense], dim=1)).squeeze(1)
        if labels is None:
            return prediction
        return {"logits": prediction, "loss": torch.nn.functional.mse_loss(prediction, labels)}


def regression_rows(count: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    category, dense = torch.randint(0, 5, (count,), generator=g), torch.randn(count, 3, generator=g)
    return {"category": category, "dense": dense, "labels": category.float() - dense[:, 0] + 0.1 * dense[:, 1]}


def regression_parts(*overrides: str, model_loss: bool = False, seed: int = 0) -> tuple[Any, Parts]:
    cfg = load_config(None, ["task=regression", "data.label=target", "data.features=[category, dense]",
                             "model.inputs=[category, dense]", "scaling.num_workers=1",
                             "train.global_batch_size=32", "train.max_steps=8", "train.log_every=2",
                             "train.eval_every=4", "checkpoint.every=4", "optim.warmup_steps=2", *overrides])
    torch.manual_seed(seed)
    model = TwoInputs()
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.train.max_steps)
    return cfg, Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU, cfg.optim.max_grad_norm,
                      task=Regression(), call=ModelCall(cfg.model.input_map, labels=model_loss), model_loss=model_loss)


def micro(rows: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    count = len(rows["labels"])
    return [{k: v[i:i + size] for k, v in rows.items()} for i in range(0, count - size + 1, size)]


@pytest.mark.parametrize("model_loss", [False, True])
@pytest.mark.parametrize("size", [32, 8])
def test_regression_step_applies_the_mean_gradient_of_the_whole_batch(size: int, model_loss: bool) -> None:
    # Plain SGD at lr 1: the update is minus the gradient, so a wrong normaliser shows (AdamW would hide it).
    # With the model's own loss (a mean per micro-batch), the loop rescales by the micro-batch's target count.
    _, parts = regression_parts(*SGD, model_loss=model_loss)
    rows = regression_rows(32)
    before = [p.detach().clone() for p in parts.model.parameters()]
    parts.model.zero_grad()
    torch.nn.functional.mse_loss(parts.model(rows["category"], rows["dense"]), rows["labels"]).backward()
    expected = [p.grad.detach().clone() for p in parts.model.parameters()]  # type: ignore[union-attr]
    parts.model.zero_grad()
    train_step(parts, micro(rows, size))
    for moved, grad in zip(update(before, parts.model), expected, strict=True):
        torch.testing.assert_close(moved, grad, atol=1e-6, rtol=1e-5)


def test_regression_trains_reports_its_metrics_and_resumes_bitwise() -> None:
    cfg, straight = regression_parts("train.max_steps=12", "data.val=null", "optim.lr=0.03")
    rows = regression_rows(256)
    source = lambda epoch: micro(rows, 32)  # noqa: E731
    recorder = Recorder()
    run(cfg, straight, Data(source), recorder)
    assert recorder.reports[-1][0]["train_loss"] < recorder.reports[0][0]["train_loss"]
    metrics = evaluate(straight, micro(rows, 64))
    assert set(metrics) == {"val_loss", "val_mse", "val_rmse", "val_mae", "val_r2"} and metrics["val_r2"] > 0

    _, first = regression_parts("train.max_steps=12", "data.val=null", "optim.lr=0.03")
    short = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": 4})})  # the same schedule
    recorder = Recorder()
    run(short, first, Data(source), recorder)
    state = copy.deepcopy(recorder.reports[-1][1])
    assert state is not None
    torch.manual_seed(123)
    _, resumed = regression_parts("train.max_steps=12", "data.val=null", "optim.lr=0.03", seed=99)
    progress = restore(resumed, state)
    assert progress == Progress(step=4, samples_seen=128, epoch=0, rows_in_epoch=128)
    run(cfg, resumed, Data(source), Recorder(), progress)
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


# --- what is refused before Ray starts ---------------------------------------------------------------------------

def test_task_config_errors_name_the_key_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"task.name': unknown task 'regresion' \(did you mean 'regression'"):
        load_config(None, ["task=regresion"])
    with pytest.raises(ConfigError, match="data.label': task regression needs a target column"):
        load_config(None, ["task=regression", "data.label=null", "data.features=[tokens]"])
    with pytest.raises(ConfigError, match=r"model.inputs': \['mask'\] are not among data.features"):
        load_config(None, ["model.inputs=[pixels, mask]"])
    with pytest.raises(ConfigError, match="task.loss=model passes `labels` to the model by name"):
        load_config(None, ["task.loss=model"])
    cfg = load_config(None, ["task=regression", "data.label=target"])
    assert (cfg.tune.metric, cfg.tune.mode) == ("val_rmse", "min")
    assert load_config(None, ["data.label=null", "data.features=[tokens]"]).task.name == "causal_lm"


def test_a_forward_that_does_not_take_the_named_inputs_is_refused() -> None:
    model = TwoInputs()
    check_forward(model, ModelCall({"category": "category", "dense": "dense"}, labels=True), "two")
    with pytest.raises(ConfigError, match=r"takes no argument \['input_ids'\]; it takes \['category', 'dense'"):
        check_forward(model, ModelCall({"input_ids": "ids"}), "two")
    with pytest.raises(ConfigError, match="task.loss=model needs the forward"):
        check_forward(torch.nn.Linear(2, 1), ModelCall({"input": "x"}, labels=True), "linear")


def test_tokens_per_second_is_reported_for_token_counts_only() -> None:
    # Multi-output regression counts one target per label column (2 per row), so its targets differ from its
    # samples without being tokens; a causal LM's targets are tokens.
    cfg = load_config(None, ["task=regression", "data.label=target", "scaling.num_workers=1",
                             "train.global_batch_size=16", "train.max_steps=2", "train.log_every=2",
                             "data.val=null", "checkpoint.every=2", "optim.warmup_steps=0"])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    rows = {"x": x, "labels": x[:, :2] * 3}
    model = torch.nn.Linear(4, 2)
    optimizer, scheduler = build_optimizer(model, cfg.optim, 2)
    parts = Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU, None, task=Regression())
    recorder = Recorder()
    run(cfg, parts, Data(lambda epoch: micro(rows, 16)), recorder)
    assert "samples_per_s" in recorder.reports[-1][0] and "tokens_per_s" not in recorder.reports[-1][0]
