"""Models as a user writes them, for the examples: each is `model.entrypoint: "examples.models:<function>"`, called
with the options under `model:` (and `num_classes` where its signature takes it). The module must import on every
node: the repository root is on the workers' path when you run from it (or ship it with the job's working_dir)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class TwoInputRegressor(nn.Module):
    """Category ids through embeddings, next to dense floats: a model with several named inputs of their own
    dtypes (int64 ids, float32 features), which a single concatenated float vector cannot feed."""

    def __init__(self, categories: dict[str, int], dense: int, embedding: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.embeddings = nn.ModuleDict({name: nn.Embedding(count, embedding) for name, count in categories.items()})
        self.head = nn.Sequential(nn.Linear(embedding * len(categories) + dense, hidden), nn.ReLU(),
                                  nn.Linear(hidden, 1))

    def forward(self, dense: torch.Tensor, **ids: torch.Tensor) -> torch.Tensor:
        embedded = [self.embeddings[name](ids[name]) for name in self.embeddings]
        return self.head(torch.cat([*embedded, dense], dim=1)).squeeze(1)


def two_input(sex: int = 2, age_bucket: int = 10, dense: int = 8, embedding: int = 4, hidden: int = 64
              ) -> nn.Module:
    """For `orchestrator prepare diabetes`: sex (2 ids) and age bucket (10 ids) embedded, 8 dense features."""
    return TwoInputRegressor({"sex": sex, "age_bucket": age_bucket}, dense, embedding, hidden)


def gpt2(num_classes: int = 256, context: int = 256, width: int = 64, layers: int = 2, heads: int = 2) -> Any:
    """A tiny Hugging Face GPT-2, returned as-is: its forward takes input_ids (and labels) and returns a
    ModelOutput. `num_classes` is the vocabulary, from the token column's metadata (256 bytes for `prepare text`)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    # No GPT-2 BPE special tokens in a byte vocabulary.
    model = GPT2LMHeadModel(GPT2Config(vocab_size=num_classes, n_positions=context, n_embd=width, n_layer=layers,
                                       n_head=heads, bos_token_id=None, eos_token_id=None))
    model.loss_type = "ForCausalLM"  # transformers guesses it from the class name, and warns for this one
    return model


def bert_classifier(num_classes: int = 2, vocab: int = 64, width: int = 64, layers: int = 2, heads: int = 2,
                    context: int = 64) -> Any:
    """A tiny Hugging Face BERT sequence classifier over variable-length token ids with their attention mask."""
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(
        vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * width, max_position_embeddings=context, num_labels=num_classes))
