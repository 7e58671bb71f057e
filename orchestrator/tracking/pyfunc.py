"""The `python_function` flavour of the logged model:
`mlflow.pyfunc.load_model(uri).predict(frame)` takes a pandas DataFrame with the training data's
feature columns, by name and in any order, and returns what the task means:

- classification: `class` (the argmax) and `probabilities` (softmax over the classes);
- multilabel: `labels` (0/1 per label, logit > 0) and `probabilities` (sigmoid per label);
- regression: `prediction` (a number per row, or a list with several targets);
- causal_lm: `next_token` (the argmax at the last position);
- a user's own task: `output` (the model's raw output).

This file is copied into every logged model (its `code/` folder, as `orchestrator_pyfunc.py`, the
flavour's loader module) and imports only numpy, pandas, torch and mlflow: the model loads where
the orchestrator is not installed. The torch module itself is loaded by `mlflow.pytorch` (pt2 or
pickle), so `mlflow.pytorch.load_model` is unchanged."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

LOADER_MODULE = "orchestrator_pyfunc"  # the name this file has inside the model
# beside MLmodel: how the model is called and what its task is
SETTINGS_FILE = "orchestrator_pyfunc.json"


def _load_pyfunc(data_path: str, model_config: dict[str, Any] | None = None) -> TaskPredictor:
    """pyfunc's loader hook: the torch module as mlflow.pytorch loads it (device choice
    included), wrapped."""
    import mlflow.pytorch

    torch_wrapper = mlflow.pytorch._load_pyfunc(data_path, model_config)
    with open(os.path.join(os.path.dirname(data_path), SETTINGS_FILE)) as file:
        settings = json.load(file)
    return TaskPredictor(torch_wrapper.get_raw_model(), settings, torch_wrapper.device)


class TaskPredictor:
    """`settings`: `task` (a built-in task name, else raw output), `columns` (the feature columns
    in the order the model takes them), `inputs` (None: the columns concatenated into one float
    tensor, as training's collate does; else {forward argument: column}), `tokens` (the single
    column holds token ids: kept as integers)."""

    def __init__(self, model: Any, settings: dict[str, Any], device: str = "cpu") -> None:
        self.model, self.settings, self.device = model, settings, device

    def get_raw_model(self) -> Any:
        return self.model

    def predict(self, data: Any, params: dict[str, Any] | None = None) -> Any:
        import pandas as pd
        import torch

        if isinstance(data, Mapping):
            data = pd.DataFrame(dict(data))
        columns = self.settings["columns"]
        if not isinstance(data, pd.DataFrame):
            raise TypeError(f"predict takes a pandas DataFrame with the columns {columns}, got "
                            f"{type(data).__name__}")
        missing = [name for name in columns if name not in data.columns]
        if missing:
            raise ValueError(f"the input lacks the columns {missing}: this model takes {columns} "
                             "(by name, in any order)")
        with torch.no_grad():
            output = self._call(data)
        return self._meaning(_logits(output).detach().to("cpu"), len(data))

    def _call(self, data: Any) -> Any:
        import torch

        def tensor(name: str, dtype: Any = None) -> Any:
            array = column_values(data[name], name)
            if dtype is not None:
                array = array.astype(dtype, copy=False)
            # pandas widens float32 columns: train-time tensors are float32
            elif array.dtype == np.float64:
                array = array.astype(np.float32)
            # token ids and flags: torch's embeddings index with int64
            elif array.dtype.kind in "iub":
                array = array.astype(np.int64)
            # a copy: frames may hold read-only arrays
            return torch.tensor(array, device=self.device)

        inputs = self.settings.get("inputs")
        if inputs:
            return self.model(**{argument: tensor(column) for argument, column in inputs.items()})
        if self.settings.get("tokens"):
            return self.model(tensor(self.settings["columns"][0], np.int64))
        parts = [tensor(name, np.float32).reshape(len(data), -1)
                 for name in self.settings["columns"]]
        return self.model(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))

    def _meaning(self, logits: Any, rows: int) -> Any:
        import pandas as pd
        import torch

        task, logits = self.settings.get("task"), logits.float()
        if task == "classification":
            return pd.DataFrame({"class": _rows(logits.argmax(-1)),
                                 "probabilities": _rows(logits.softmax(-1))})
        if task == "multilabel":
            return pd.DataFrame({"labels": _rows((logits > 0).long()),
                                 "probabilities": _rows(torch.sigmoid(logits))})
        if task == "regression":
            values = logits.reshape(rows, -1)
            prediction = values[:, 0] if values.shape[1] == 1 else values
            return pd.DataFrame({"prediction": _rows(prediction)})
        if task == "causal_lm":
            last = logits[:, -1] if logits.dim() == 3 else logits
            return pd.DataFrame({"next_token": _rows(last.argmax(-1))})
        return pd.DataFrame({"output": _rows(logits)})


def column_values(column: Any, name: str) -> np.ndarray:
    """A DataFrame column as one array, rows first: list-valued cells (a fixed-size list, an
    image) stacked."""
    values = column.to_numpy()
    if values.dtype != object:
        return values
    try:
        return np.stack([np.asarray(cell) for cell in values])
    except ValueError:
        raise ValueError(f"column '{name}' holds lists of different lengths: give every row the "
                         "same length, as in the training data") from None


def _logits(output: Any) -> Any:
    """The prediction in a model's output: a tensor, `logits` of a dict/ModelOutput, or a tuple's
    first element (tasks.logits_of's rule, written again: this file loads where the orchestrator
    is not installed)."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    logits = (output.get("logits") if isinstance(output, Mapping)
              else getattr(output, "logits", None))
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"the model returned {type(output).__name__}, not a tensor or logits")


def _rows(values: Any) -> Any:
    """A tensor as a DataFrame column: one scalar per row, or one array per row."""
    array = values.numpy()
    return array if array.ndim == 1 else list(array)
