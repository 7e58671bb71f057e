"""Task edges a real Hugging Face model meets: micro-batches with no next-token target under the model's own loss,
how a model with its own loss is told the task (label dtype, problem_type), multi-output R² against scikit-learn,
and which tasks count tokens. Tiny GPT-2s are built from a config (no download)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import r2_score
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

from orchestrator.config import load_config
from orchestrator.errors import ConfigError
from orchestrator.models.tasks import (
    IGNORE_INDEX,
    TASKS,
    CausalLM,
    ModelCall,
    Multilabel,
    Regression,
    align_model_loss,
    build_task,
    step_loss_sum,
    task_parts,
)
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision
from orchestrator.training.step import train_step

CPU = torch.device("cpu")
VOCAB = 40
TOKENS = {"input_ids": "input_ids", "attention_mask": "attention_mask"}


def gpt2_config(**options: Any) -> GPT2Config:
    # No dropout: the loop runs the model in train mode, and the reference must see the same function.
    return GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=1,
                      eos_token_id=1, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **options)


def tiny_lm(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config())


def token_rows(lengths: list[int], width: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of `lengths` real tokens, right-padded as collate pads them: id 0, mask 0, label IGNORE_INDEX."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


def shifted_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The independent reference: position t predicts token t+1, padding ignored, summed."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


# --- item 4: the model's own loss on pieces without a next-token target -------------------------------------------

def test_model_loss_of_rows_with_no_next_token_is_an_exact_zero_that_still_reaches_every_parameter() -> None:
    model, task = tiny_lm(), CausalLM(shift=True)
    batch = token_rows([0, 1, 1])  # an empty line and two 1-token lines: nothing follows any token
    assert float(task.count(batch)) == 0
    loss = step_loss_sum(task, ModelCall(TOKENS, labels=True)(model, batch), batch, from_model=True)
    assert loss.item() == 0.0  # Hugging Face's mean is 0/0 = NaN here
    loss.backward()
    for name, parameter in model.named_parameters():  # DDP wants a gradient for every parameter, even a zero one
        assert parameter.grad is not None, name
        assert torch.equal(parameter.grad, torch.zeros_like(parameter)), name


def test_model_loss_of_a_mixed_batch_is_the_sum_over_its_next_tokens() -> None:
    model, task = tiny_lm(), CausalLM(shift=True)
    batch = token_rows([0, 1, 4, 6, 2])
    loss = step_loss_sum(task, ModelCall(TOKENS, labels=True)(model, batch), batch, from_model=True)
    reference = shifted_sum(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                            batch["labels"])
    assert float(task.count(batch)) == 3 + 5 + 1
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)


def test_a_step_with_a_targetless_micro_batch_is_applied_with_the_gradient_of_the_others() -> None:
    # Plain SGD at lr 1: the update is minus the gradient. The targetless micro-batch adds nothing to it and must
    # not turn the step into a skipped (non-finite) one.
    reference, task = tiny_lm(), CausalLM(shift=True)
    model = copy.deepcopy(reference)
    mixed, short = token_rows([3, 6, 1, 5], seed=1), token_rows([1, 0, 1, 1], seed=2)
    logits = reference(input_ids=mixed["input_ids"], attention_mask=mixed["attention_mask"]).logits
    (shifted_sum(logits, mixed["labels"]) / task.count(mixed)).backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    parts = Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU, None, task=task,
                  call=ModelCall(TOKENS, labels=True), model_loss=True)
    result = train_step(parts, [mixed, short])
    assert not result.skipped and float(result.targets) == float(task.count(mixed))
    for (name, before), after in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert before.grad is not None, name
        torch.testing.assert_close(before.detach() - after.detach(), before.grad, atol=1e-6, rtol=1e-5)


# --- item 15: a model's own loss for multilabel and regression ---------------------------------------------------

def own_loss_config(task: str) -> Any:
    return load_config(None, [f"task.name={task}", "data.label=target", "data.features=[input_ids]",
                              "model.inputs=[input_ids, attention_mask]", "task.loss=model"])


@pytest.mark.parametrize("labels", [3, 1])
def test_multilabel_integer_labels_with_the_models_own_loss_is_binary_cross_entropy(labels: int) -> None:
    # Collate gives 0/1 list columns as int64; Hugging Face picks its loss by label dtype and num_labels when
    # config.problem_type is unset: cross-entropy for integers (a shape error with 3 labels), MSE for 1 label.
    task, call, model_loss = task_parts(own_loss_config("multilabel"))
    assert isinstance(task, Multilabel) and model_loss
    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(gpt2_config(num_labels=labels))
    align_model_loss(model, task)
    tags = torch.tensor([[1, 0, 1], [0, 0, 1], [1, 1, 1], [0, 0, 0]])[:, :labels]
    batch = token_rows([3, 5, 2, 6]) | {"labels": tags}
    output = call(model, batch)
    expected = F.binary_cross_entropy_with_logits(output.logits.float(), batch["labels"].float(), reduction="sum")
    torch.testing.assert_close(step_loss_sum(task, output, batch, from_model=True), expected, rtol=1e-5, atol=1e-6)
    assert batch["labels"].dtype == torch.int64  # the batch itself is left as collated


def test_multi_output_regression_with_the_models_own_loss_is_squared_error() -> None:
    # Float labels with num_labels > 1 would make Hugging Face pick multi-label BCE.
    task, call, _ = task_parts(own_loss_config("regression"))
    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(gpt2_config(num_labels=2))
    align_model_loss(model, task)
    batch = token_rows([3, 5, 2]) | {"labels": torch.tensor([[0.5, -2.0], [3.0, 1.0], [-1.0, 4.0]])}
    output = call(model, batch)
    expected = F.mse_loss(output.logits.float(), batch["labels"], reduction="sum")
    torch.testing.assert_close(step_loss_sum(task, output, batch, from_model=True), expected, rtol=1e-5, atol=1e-6)


def test_a_model_whose_config_names_another_loss_is_refused() -> None:
    model = GPT2ForSequenceClassification(gpt2_config(num_labels=3, problem_type="single_label_classification"))
    with pytest.raises(ConfigError, match="problem_type.*multi_label_classification"):
        align_model_loss(model, Multilabel())
    align_model_loss(torch.nn.Linear(2, 3), Multilabel())  # not a Hugging Face model: nothing to align
    lm = tiny_lm()
    align_model_loss(lm, CausalLM(shift=True))
    assert lm.config.problem_type is None


# --- item 8: R² of several target columns ------------------------------------------------------------------------

def summed(task: Regression, prediction: torch.Tensor, y: torch.Tensor, parts: list[slice]) -> dict[str, float]:
    """The sums added over batches (or ranks), as the loop adds them before `metrics`."""
    sums: dict[str, float] = {}
    for rows in parts:
        for key, value in task.metric_sums(prediction[rows], {"labels": y[rows]}).items():
            sums[key] = sums.get(key, 0.0) + float(value)
    return sums


@pytest.mark.parametrize("predictor", ["means", "noisy"])
def test_multi_output_r2_is_the_variance_weighted_average_of_scikit_learn(predictor: str) -> None:
    rng = np.random.default_rng(0)
    n = 300
    y = np.stack([rng.normal(0, 1, n), rng.normal(100, 10, n), rng.normal(-50, 0.1, n), np.full(n, 3.0)], 1)
    if predictor == "means":  # true R² 0 on every column; a pooled variance says about 1
        prediction = np.broadcast_to(y.mean(0), y.shape).copy()
    else:
        prediction = y + rng.normal(0, [0.5, 4.0, 0.2, 1.0], (n, 4))
    y_t, prediction_t = torch.tensor(y, dtype=torch.float32), torch.tensor(prediction, dtype=torch.float32)
    expected = r2_score(y_t.double().numpy(), prediction_t.double().numpy(), multioutput="variance_weighted")
    task = Regression()
    whole = task.metrics(summed(task, prediction_t, y_t, [slice(0, n)]))
    halves = task.metrics(summed(task, prediction_t, y_t, [slice(0, 137), slice(137, n)]))  # two ranks
    assert whole["val_r2"] == pytest.approx(expected, abs=1e-6)
    assert halves["val_r2"] == pytest.approx(expected, abs=1e-6)
    assert whole["val_mse"] == pytest.approx(float(((prediction_t - y_t).double() ** 2).mean()), rel=1e-6)


def test_single_output_r2_still_matches_scikit_learn_for_either_label_shape() -> None:
    g = torch.Generator().manual_seed(3)
    y = 5 + 2 * torch.randn(64, generator=g)
    prediction = y + torch.randn(64, generator=g)
    expected = r2_score(y.double().numpy(), prediction.double().numpy())
    task = Regression()
    for labels, predicted in ((y, prediction[:, None]), (y[:, None], prediction[:, None])):
        sums = summed(task, predicted, labels, [slice(0, 10), slice(10, 64)])
        assert task.metrics(sums)["val_r2"] == pytest.approx(expected, abs=1e-6)
    constant = torch.full((8,), 2.0)
    assert np.isnan(task.metrics(summed(task, constant[:, None] + 1, constant, [slice(0, 8)]))["val_r2"])


# --- item 15: which tasks count tokens ---------------------------------------------------------------------------

def test_only_token_level_tasks_say_their_count_is_tokens() -> None:
    # The loop reports tokens/s from this, not from targets != samples (labels are counted for multilabel and
    # multi-output regression).
    names = TASKS.names()
    assert {"causal_lm", "classification", "multilabel", "regression"} <= set(names)
    for name in names:
        task = build_task(name, 10, shift=False)
        assert task.counts_tokens is (name == "causal_lm"), name
    rows = token_rows([3, 5])
    assert float(build_task("causal_lm", None, shift=True).count(rows)) == 2 + 4  # tokens, not rows
    assert float(build_task("multilabel", None, shift=False).count({"labels": torch.ones(2, 3)})) == 6  # labels
