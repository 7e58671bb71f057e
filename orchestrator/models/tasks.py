"""What a run learns: how a model is called on a batch of named tensors, its loss as a sum with
its target count, and its validation metrics as sums reduced across ranks. Built-in tasks:
classification, multilabel, regression, causal_lm; a user's own is `task.name: "module:Class"`
with the same methods (see `Task`).

Losses are sums, never means: the loop divides by the target count of the whole optimizer step
over all micro-batches and ranks, so accumulation and data parallelism give exactly the gradient
of one large batch."""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from orchestrator.config import TASK_KINDS, Config
from orchestrator.errors import ConfigError
from orchestrator.models.registry import Registry, load_entrypoint

Batch = dict[str, torch.Tensor]  # column name (or "x", "labels", "attention_mask") -> rows x ...
# the batch key of the targets, whatever the label column is called (the Hugging Face name)
LABELS = "labels"
# targets with this value (padding) count neither in the loss nor in its normaliser
IGNORE_INDEX = -100


def logits_of(output: Any) -> torch.Tensor:
    """The prediction in a model's output: a tensor, a tuple's first element, or `logits` of a
    dict/ModelOutput."""
    if isinstance(output, torch.Tensor):
        return output
    logits = (output.get("logits") if isinstance(output, Mapping)
              else getattr(output, "logits", None))
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"the model returned {type(output).__name__}: return a tensor, a tuple whose "
                    "first element is the logits, or a dict/ModelOutput with 'logits'")


def model_loss(output: Any) -> torch.Tensor:
    """The mean loss a model computed itself (Hugging Face style, given `labels`)."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"task.loss=model, but the model's output ({type(output).__name__}) has no "
                        "'loss': make its forward take `labels` and return a loss, or set "
                        "task.loss=task")
    return loss


class Task:
    """The contract of a task. `count` and `loss_sum` define the training objective: loss_sum /
    count over a step is the mean the user means. `metric_sums` gives per-batch sums (the loop
    adds them over batches and ranks) and `metrics` turns the totals into the reported `val_*`
    figures. `metric`/`mode` are what Tune and doctor rank by unless told otherwise."""

    metric = "val_loss"
    mode = "min"
    # True when `count` is tokens (the loop then reports tokens/s), not rows or labels. It also says
    # whether counts differ between ranks at the same rows: a step then all-reduces them
    # (overlapping its first forward); False means the count follows from the rows, the same on
    # every rank, and no collective is needed.
    counts_tokens = False
    # The loss a Hugging Face model given `labels` must compute (config.problem_type), None: leave
    # it as it is
    problem_type: str | None = None

    def count(self, batch: Batch) -> torch.Tensor:
        """Targets in the batch the loss sums over (rows; tokens for a language model), on the
        batch's device. A count known on the host is filled in there (torch.full), not copied
        from host memory: a blocking copy to a GPU would wait for every kernel queued before it."""
        return torch.full((), float(len(batch[LABELS])), device=batch[LABELS].device)

    def loss_sum(self, output: Any, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def model_labels(self, batch: Batch) -> torch.Tensor:
        """The targets as a model computing its own loss takes them (task.loss=model)."""
        return batch[LABELS]

    def metric_sums(self, output: Any, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-batch sums; at least `loss` (the loss sum) and `count` (`count(batch)`)."""
        return {"loss": self.loss_sum(output, batch).detach().double(),
                "count": self.count(batch).double()}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {"val_loss": sums["loss"] / sums["count"]}


TASKS: Registry[type[Task]] = Registry("task")


@TASKS.register("classification")
class Classification(Task):
    """One integer class per row; cross-entropy; accuracy (and top-5 accuracy with more than 5
    classes)."""

    metric, mode = TASK_KINDS["classification"].metric, TASK_KINDS["classification"].mode
    problem_type = "single_label_classification"

    def __init__(self, num_classes: int | None = None) -> None:
        self.top5 = bool(num_classes and num_classes > 5)

    def loss_sum(self, output: Any, batch: Batch) -> torch.Tensor:
        logits = logits_of(output)
        return F.cross_entropy(logits.float().flatten(0, -2), batch[LABELS].flatten(),
                               reduction="sum")

    def metric_sums(self, output: Any, batch: Batch) -> dict[str, torch.Tensor]:
        logits, y = logits_of(output).flatten(0, -2), batch[LABELS].flatten()
        correct = (logits.argmax(-1) == y).sum().double()
        sums = super().metric_sums(output, batch) | {"correct": correct}
        if self.top5:
            sums["top5"] = (logits.topk(5, dim=-1).indices == y[:, None]).any(-1).sum().double()
        return sums

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        out = super().metrics(sums) | {"val_accuracy": sums["correct"] / sums["count"]}
        if "top5" in sums:
            out["val_top5_accuracy"] = sums["top5"] / sums["count"]
        return out


@TASKS.register("multilabel")
class Multilabel(Task):
    """Several 0/1 labels per row (a fixed-size list); binary cross-entropy per label; micro
    accuracy and F1."""

    metric, mode = TASK_KINDS["multilabel"].metric, TASK_KINDS["multilabel"].mode
    problem_type = "multi_label_classification"

    def count(self, batch: Batch) -> torch.Tensor:
        return torch.full((), float(batch[LABELS].numel()), device=batch[LABELS].device)

    def model_labels(self, batch: Batch) -> torch.Tensor:
        # Collate gives 0/1 lists as int64: binary cross-entropy takes float targets (and Hugging
        # Face, without a problem_type, reads integer labels as single-label classes).
        return batch[LABELS].float()

    def loss_sum(self, output: Any, batch: Batch) -> torch.Tensor:
        y = batch[LABELS].float()
        logits = logits_of(output).float().reshape(y.shape)
        return F.binary_cross_entropy_with_logits(logits, y, reduction="sum")

    def metric_sums(self, output: Any, batch: Batch) -> dict[str, torch.Tensor]:
        y = batch[LABELS] > 0.5
        predicted = logits_of(output).reshape(y.shape) > 0
        return super().metric_sums(output, batch) | {
            "correct": (predicted == y).sum().double(), "tp": (predicted & y).sum().double(),
            "fp": (predicted & ~y).sum().double(), "fn": (~predicted & y).sum().double()}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        f1_denominator = 2 * sums["tp"] + sums["fp"] + sums["fn"]
        f1 = 2 * sums["tp"] / f1_denominator if f1_denominator else 0.0
        accuracy = sums["correct"] / sums["count"]
        return super().metrics(sums) | {"val_accuracy": accuracy, "val_f1": f1}


@TASKS.register("regression")
class Regression(Task):
    """Float targets (one per row, or a fixed-size list); squared error; MSE, RMSE, MAE and R²."""

    metric, mode = TASK_KINDS["regression"].metric, TASK_KINDS["regression"].mode
    problem_type = "regression"

    def count(self, batch: Batch) -> torch.Tensor:
        return torch.full((), float(batch[LABELS].numel()), device=batch[LABELS].device)

    def model_labels(self, batch: Batch) -> torch.Tensor:
        return batch[LABELS].float()  # integer targets are still numbers, not classes

    def _pair(self, output: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        y = batch[LABELS].float()
        prediction = logits_of(output).float()
        if prediction.numel() != y.numel():
            raise ValueError(f"regression: the model predicts {tuple(prediction.shape)} for "
                             f"targets of shape {tuple(y.shape)}: give the model one output per "
                             "target (num_classes=1 per column)")
        return prediction.reshape(y.shape), y

    def loss_sum(self, output: Any, batch: Batch) -> torch.Tensor:
        return F.mse_loss(*self._pair(output, batch), reduction="sum")

    def metric_sums(self, output: Any, batch: Batch) -> dict[str, torch.Tensor]:
        prediction, y = self._pair(output, batch)
        if y.dim() == 1:
            prediction, y = prediction[:, None], y[:, None]
        # rows x target columns
        prediction, y = prediction.double().flatten(1), y.double().flatten(1)
        sums = super().metric_sums(output, batch) | {"abs": (prediction - y).abs().sum(),
                                                     "rows": y.new_tensor(float(len(y)))}
        # R² per target column needs each column's own sums: one variance pooled over columns
        # counts the gaps between the columns' means as variance the model explains.
        columns = (("y", y.sum(0)), ("y2", (y * y).sum(0)), ("se", ((prediction - y) ** 2).sum(0)))
        for name, column_sums in columns:
            sums |= {f"{name}/{j}": value for j, value in enumerate(column_sums)}
        return sums

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        n, mse = sums["count"], sums["loss"] / sums["count"]
        return {"val_loss": mse, "val_mse": mse, "val_rmse": math.sqrt(mse),
                "val_mae": sums["abs"] / n, "val_r2": self.r2(sums)}

    @staticmethod
    def r2(sums: dict[str, float]) -> float:
        """R² averaged over the target columns weighted by their variance (scikit-learn's
        r2_score with multioutput="variance_weighted"): 1 - squared error / total variation, over
        the columns that vary."""
        rows, error, variation = sums["rows"], 0.0, 0.0
        for j in range(sum(key.startswith("y/") for key in sums)):
            y, y2 = sums[f"y/{j}"], sums[f"y2/{j}"]
            column = y2 - y * y / rows  # the sum of squared deviations from the column's mean
            if column > 1e-12 * y2:  # else constant up to rounding: weight 0, as in scikit-learn
                error, variation = error + sums[f"se/{j}"], variation + column
        return 1 - error / variation if variation > 0 else math.nan


@TASKS.register("causal_lm")
class CausalLM(Task):
    """Next-token prediction; padding (IGNORE_INDEX) counts nowhere. With `shift`, the model saw
    the whole sequence and `labels` are its tokens (the Hugging Face convention): position t
    predicts token t+1. Without, the batch's labels are already the next tokens (the built-in
    `gpt` on x = tokens[:-1])."""

    metric, mode = TASK_KINDS["causal_lm"].metric, TASK_KINDS["causal_lm"].mode
    counts_tokens = True

    def __init__(self, shift: bool = False) -> None:
        self.shift = shift

    def _pair(self, logits: torch.Tensor,
              labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        return logits.flatten(0, -2), labels.flatten()

    def count(self, batch: Batch) -> torch.Tensor:
        labels = batch[LABELS][:, 1:] if self.shift else batch[LABELS]
        return (labels != IGNORE_INDEX).sum().to(torch.float32)

    def loss_sum(self, output: Any, batch: Batch) -> torch.Tensor:
        logits, labels = self._pair(logits_of(output), batch[LABELS])
        return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORE_INDEX)

    def metric_sums(self, output: Any, batch: Batch) -> dict[str, torch.Tensor]:
        logits, labels = self._pair(logits_of(output), batch[LABELS])
        correct = ((logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum().double()
        return super().metric_sums(output, batch) | {"correct": correct}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums["loss"] / sums["count"]
        # val_accuracy: the share of next tokens predicted right (token accuracy)
        return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0)),
                "val_accuracy": sums["correct"] / sums["count"]}


def build_task(name: str, num_classes: int | None, shift: bool) -> Task:
    """The task of a resolved config (`task.name` is never null by then)."""
    if ":" in name:
        cls = load_entrypoint(name)
        task = cls() if isinstance(cls, type) else cls
    else:
        cls = TASKS.get(name)
        task = (Classification(num_classes) if cls is Classification
                else CausalLM(shift) if cls is CausalLM else cls())
    missing = [m for m in ("count", "loss_sum", "metric_sums", "metrics")
               if not callable(getattr(task, m, None))]
    if missing:
        raise ConfigError(f"task '{name}' lacks {missing}: subclass orchestrator.models.tasks.Task")
    return task


class ModelCall:
    """How the model is called on a batch. `inputs` None: `model(batch["x"])`, the one
    concatenated float vector (or token window) of the classic contract. Else keyword arguments
    by name: {argument: batch key}; with `labels`, the batch's targets go in too (for a model
    that computes its own loss), as `task.model_labels` gives them."""

    def __init__(self, inputs: dict[str, str] | None = None, labels: bool = False,
                 task: Task | None = None) -> None:
        self.inputs, self.labels, self.task = inputs, labels, task

    def __call__(self, model: torch.nn.Module, batch: Batch) -> Any:
        if self.inputs is None:
            return model(batch["x"])
        kwargs = {argument: batch[key] for argument, key in self.inputs.items()}
        if self.labels:
            # a user's task need not subclass Task
            to_model = getattr(self.task, "model_labels", None)
            kwargs["labels"] = to_model(batch) if to_model is not None else batch[LABELS]
        return model(**kwargs)


def check_forward(model: torch.nn.Module, call: ModelCall, name: str) -> None:
    """The model's forward accepts the named inputs (and labels when it computes the loss);
    ConfigError else."""
    if call.inputs is None:
        return
    params = inspect.signature(model.forward).parameters
    # A Hugging Face forward's **kwargs carry attention-backend options, never model inputs: judge
    # its named ones.
    huggingface = type(model).__module__.startswith("transformers.")
    if not huggingface and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    wanted = [*call.inputs, *(["labels"] if call.labels else [])]
    missing = [arg for arg in wanted if arg not in params]
    named = [n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if missing:
        key = "task.loss=model needs" if missing == ["labels"] else "config key 'model.inputs':"
        raise ConfigError(f"{key} the forward of model '{name}' ({type(model).__name__}) takes no "
                          f"argument {missing}; it takes {named}")


def align_model_loss(model: torch.nn.Module, task: Task) -> None:
    """Tell a Hugging Face model given `labels` which loss the task means. Without
    `config.problem_type` it guesses from the labels: integer ones are single-label classes, one
    output is regression, several float outputs are multi-label (so 0/1 lists, a single label, or
    multi-output regression would get the wrong loss)."""
    config, wanted = getattr(model, "config", None), getattr(task, "problem_type", None)
    if wanted is None or config is None or not hasattr(config, "problem_type"):
        return
    if config.problem_type is None:
        config.problem_type = wanted
    elif config.problem_type != wanted:
        raise ConfigError("task.loss=model: the model's config.problem_type is "
                          f"'{config.problem_type}', but the task needs '{wanted}': build the "
                          f"model with problem_type='{wanted}' (with model.pretrained, in its "
                          "config.json), or set task.loss=task")


def step_loss_sum(task: Task, output: Any, batch: Batch, from_model: bool) -> torch.Tensor:
    """The loss of one micro-batch as a sum over its targets: the task's, or the model's own mean
    loss times the task's target count (the same normaliser, so accumulation and ranks stay
    exact)."""
    if not from_model:
        return task.loss_sum(output, batch)
    count = task.count(batch)
    # A piece with no target (rows of 0 or 1 token: nothing follows a token) has a 0/0 mean, and NaN
    # x 0 is NaN, which would skip the whole step. Its sum is exactly 0. `where` keeps the loss in
    # the graph, so backward still reaches every parameter (as DDP expects) with a zero gradient,
    # and picks on the device (no host sync).
    return torch.where(count > 0, model_loss(output).float() * count, 0.0)


def task_parts(cfg: Config) -> tuple[Task, ModelCall, bool]:
    """The task, how the model is called and whether its own loss is used, for a resolved config."""
    model_loss = cfg.task.loss == "model"
    inputs = cfg.model.input_map
    # A model given the whole token sequence by name shifts for next-token targets (the Hugging Face
    # convention).
    name: str = cfg.task.name  # type: ignore[assignment]
    task = build_task(name, cfg.model.num_classes, shift=inputs is not None)
    return task, ModelCall(inputs, labels=model_loss, task=task), model_loss
