"""The examples' BERT classifier, unchanged, with a forward pre-hook that records what each forward pass was given:
per call one JSON line `{"training": bool, "input_ids": [...], "attention_mask": [...]}` in
`<out_dir>/<pid>.jsonl` (one file per process: ranks and the driver never share one). The test compares these
with the data's rows: each micro-batch's width, every row's real tokens and its mask."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from examples.models import bert_classifier


def build(num_classes: int, out_dir: str, vocab: int = 64, width: int = 64, layers: int = 2) -> torch.nn.Module:
    model = bert_classifier(num_classes=num_classes, vocab=vocab, width=width, layers=layers)
    Path(out_dir).mkdir(parents=True, exist_ok=True)

    def record(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        line = {"training": module.training, "input_ids": kwargs["input_ids"].tolist(),
                "attention_mask": kwargs["attention_mask"].tolist()}
        with open(Path(out_dir, f"{os.getpid()}.jsonl"), "a") as out:
            out.write(json.dumps(line) + "\n")

    model.register_forward_pre_hook(record, with_kwargs=True)
    return model


def read_calls(out_dir: str) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(Path(out_dir).glob("*.jsonl"))
            for line in path.read_text().splitlines()]
