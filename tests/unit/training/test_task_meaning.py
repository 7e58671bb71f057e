"""What the tasks' figures mean, against independent computations: the causal LM's loss, count and token accuracy
against `F.cross_entropy` over explicitly shifted positions and against a Hugging Face model's own loss (padding
in the batch); the multilabel metrics against scikit-learn on predictions whose two error kinds differ. Every sum
is also added over two halves of the batch, as the loop adds it over batches and ranks."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import accuracy_score, f1_score, log_loss
from transformers import GPT2Config, GPT2LMHeadModel

from orchestrator.models.tasks import IGNORE_INDEX, CausalLM, Multilabel, Task, build_task

VOCAB = 11


def added(task: Task, output_of: Any, batch: dict[str, torch.Tensor], cuts: tuple[int, ...]) -> dict[str, float]:
    """The task's metric sums over the row ranges between `cuts` (e.g. two ranks' halves), added as the loop adds
    them; `output_of(rows)` gives the model output for those rows."""
    sums: dict[str, float] = {}
    bounds = (0, *cuts, len(batch["labels"]))
    for start, stop in zip(bounds, bounds[1:], strict=False):
        piece = {key: value[start:stop] for key, value in batch.items()}
        for key, value in task.metric_sums(output_of(slice(start, stop)), piece).items():
            sums[key] = sums.get(key, 0.0) + float(value)
    return sums


# --- causal LM ----------------------------------------------------------------------------------------------------

def padded_tokens(lengths: list[int], width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, labels) of right-padded rows of `lengths` real tokens, as the collate pads them."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=g) * mask
    return ids, mask, ids.masked_fill(mask == 0, IGNORE_INDEX)


def planted_logits(targets: torch.Tensor, seed: int) -> torch.Tensor:
    """Logits (rows x positions x VOCAB) whose argmax is targets[i, t] at about half of the positions and a
    different token elsewhere: an accuracy that pairs positions wrongly, or counts padding, comes out different."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*targets.shape, VOCAB, generator=g)
    right = torch.rand(targets.shape, generator=g) < 0.5
    hit = torch.where(right, targets.clamp(min=0), (targets.clamp(min=0) + 1) % VOCAB)
    return logits.scatter_add(-1, hit[..., None], torch.full((*targets.shape, 1), 4.0))


def reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float]:
    """(loss sum, count, correct) position by position, in plain Python over the pairs (logits[i, t], targets[i, t])."""
    loss = count = correct = 0.0
    for i in range(targets.shape[0]):
        for t in range(targets.shape[1]):
            target = int(targets[i, t])
            if target == IGNORE_INDEX:
                continue
            row = logits[i, t].double()
            loss += float(torch.logsumexp(row, 0) - row[target])
            count += 1
            correct += int(row.argmax()) == target
    return loss, count, correct


@pytest.mark.parametrize("shift", [True, False])
def test_causal_lm_pairs_each_position_with_its_next_token_and_ignores_padding(shift: bool) -> None:
    lengths, width = [7, 2, 5, 1, 0, 7], 7
    ids, mask, labels = padded_tokens(lengths, width, seed=1)
    if shift:  # Hugging Face convention: labels are the tokens; position t predicts labels[t + 1]
        batch, targets = {"input_ids": ids, "attention_mask": mask, "labels": labels}, labels[:, 1:]
        logits = torch.cat([planted_logits(targets, seed=2), torch.randn(len(lengths), 1, VOCAB)], dim=1)
        expected_pairs = (logits[:, :-1], targets)
    else:  # the built-in gpt: x = tokens[:-1], labels = tokens[1:] already
        batch, targets = {"x": ids[:, :-1], "labels": labels[:, 1:]}, labels[:, 1:]
        logits = planted_logits(targets, seed=2)
        expected_pairs = (logits, targets)
    task = build_task("causal_lm", None, shift=shift)
    assert isinstance(task, CausalLM) and task.shift is shift
    loss, count, correct = reference(*expected_pairs)
    assert count == sum(max(n - 1, 0) for n in lengths)  # every real token after the first is a target
    assert 0 < correct < count  # the planted accuracy is informative
    torch.testing.assert_close(task.loss_sum(logits, batch).double(), torch.tensor(loss, dtype=torch.float64),
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(task.loss_sum(logits, batch), F.cross_entropy(
        expected_pairs[0].reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"))
    assert float(task.count(batch)) == count

    sums = added(task, lambda rows: logits[rows], batch, cuts=(2, 3))
    assert sums["count"] == count and sums["correct"] == correct
    assert sums["loss"] == pytest.approx(loss, rel=1e-5)
    metrics = task.metrics(sums)
    assert metrics["val_loss"] == pytest.approx(loss / count, rel=1e-5)
    assert metrics["val_perplexity"] == pytest.approx(math.exp(loss / count), rel=1e-5)
    assert metrics["val_accuracy"] == pytest.approx(correct / count)


def test_causal_lm_sums_divided_by_the_count_are_a_hugging_face_models_own_loss_in_either_mode() -> None:
    """A GPT-2 given `labels` shifts them itself and averages over the non-padding targets. The same figure comes
    from the task with shift=True on its logits, and with shift=False on the logits of tokens[:-1] against
    tokens[1:] (causal attention: the first T-1 positions' logits do not depend on the last token)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).eval()
    ids, mask, labels = padded_tokens([8, 3, 6, 1, 8], width=8, seed=3)
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask, labels=labels)
        short = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1])
    shifted = CausalLM(shift=True)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    assert float(shifted.count(batch)) == 7 + 2 + 5 + 0 + 7
    torch.testing.assert_close(shifted.loss_sum(own, batch) / shifted.count(batch), own.loss, rtol=1e-5, atol=1e-6)
    unshifted, window = CausalLM(shift=False), {"x": ids[:, :-1], "labels": labels[:, 1:]}
    assert float(unshifted.count(window)) == float(shifted.count(batch))
    torch.testing.assert_close(unshifted.loss_sum(short, window) / unshifted.count(window), own.loss,
                               rtol=1e-5, atol=1e-6)
    # The reported figures over two ranks' halves: the mean loss and its perplexity are the model's own.
    metrics = shifted.metrics(added(shifted, lambda rows: own.logits[rows], batch, cuts=(2,)))
    assert metrics["val_loss"] == pytest.approx(float(own.loss), rel=1e-5)
    assert metrics["val_perplexity"] == pytest.approx(math.exp(float(own.loss)), rel=1e-5)


# --- multilabel ---------------------------------------------------------------------------------------------------

def multilabel_case(seed: int, rows: int = 40, labels: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits spread around 0 (many in (0, 1), where 'logit > 0' and 'probability > 0.5' differ from 'logit >
    0.5'), and 0/1 targets as collate gives them (int64), with more positives predicted than present."""
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(rows, labels, generator=g) < 0.3).long()
    logits = torch.randn(rows, labels, generator=g) * 0.8 + 0.4 + y * 0.6
    return logits, y


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_multilabel_metrics_are_scikit_learns_when_false_positives_and_false_negatives_differ(seed: int) -> None:
    logits, y = multilabel_case(seed)
    predicted = (torch.sigmoid(logits) > 0.5).long().numpy()  # sklearn's view: probability above one half
    truth = y.numpy()
    fp, fn = int(((predicted == 1) & (truth == 0)).sum()), int(((predicted == 0) & (truth == 1)).sum())
    assert fp != fn and fp > 0 and fn > 0, (fp, fn)  # the case where swapping or doubling one kind shows
    task = build_task("multilabel", None, shift=False)
    sums = added(task, lambda rows: logits[rows], {"labels": y}, cuts=(len(y) // 2,))  # two ranks' halves
    assert sums["count"] == y.numel()
    metrics = task.metrics(sums)
    assert set(metrics) == {"val_loss", "val_accuracy", "val_f1"}
    assert metrics["val_f1"] == pytest.approx(f1_score(truth, predicted, average="micro"), rel=1e-12)
    # Accuracy per label (1 - Hamming loss), not per row (sklearn's subset accuracy on 2-d input).
    assert metrics["val_accuracy"] == pytest.approx(accuracy_score(truth.ravel(), predicted.ravel()), rel=1e-12)
    probabilities = torch.sigmoid(logits.double()).numpy().ravel()
    assert metrics["val_loss"] == pytest.approx(log_loss(truth.ravel(), probabilities), rel=1e-5)  # mean BCE
    # The same figures from float labels (a model computing its own loss takes them as floats).
    again = task.metrics(added(task, lambda rows: logits[rows], {"labels": y.float()}, cuts=(7,)))
    assert again == pytest.approx(metrics, rel=1e-6)


def test_multilabel_f1_with_nothing_positive_is_zero_and_a_perfect_prediction_is_one() -> None:
    task = Multilabel()
    nothing = torch.zeros(4, 3, dtype=torch.long)
    sums = {k: float(v) for k, v in task.metric_sums(torch.full((4, 3), -2.0), {"labels": nothing}).items()}
    assert task.metrics(sums)["val_f1"] == f1_score(nothing.numpy(), nothing.numpy(), average="micro",
                                                    zero_division=0) == 0.0
    assert task.metrics(sums)["val_accuracy"] == 1.0
    y = torch.tensor([[1, 0, 1], [0, 0, 1]])
    sums = {k: float(v) for k, v in task.metric_sums((y * 2 - 1).float() * 0.1, {"labels": y}).items()}
    assert task.metrics(sums)["val_f1"] == 1.0 and task.metrics(sums)["val_accuracy"] == 1.0


def test_multilabel_metrics_over_ranks_are_those_of_the_whole_set_not_a_mean_of_halves() -> None:
    # Halves of very different F1: the pooled (micro) F1 of the whole set is what sklearn reports.
    logits, y = multilabel_case(5, rows=30)
    logits[:10] = torch.where(y[:10] == 1, 3.0, -3.0)  # the first rank's rows predicted perfectly
    task = Multilabel()
    metrics = task.metrics(added(task, lambda rows: logits[rows], {"labels": y}, cuts=(10,)))
    predicted = (logits > 0).long().numpy()
    assert metrics["val_f1"] == pytest.approx(f1_score(y.numpy(), predicted, average="micro"), rel=1e-12)
    halves = [f1_score(y[r].numpy(), predicted[r], average="micro") for r in (slice(0, 10), slice(10, 30))]
    assert metrics["val_f1"] != pytest.approx(float(np.mean(halves)), abs=1e-3)
