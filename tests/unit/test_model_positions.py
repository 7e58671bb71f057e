"""Sequences longer than a model's learned position table are refused on the driver, before Ray starts, in one line
naming both lengths and the fix, instead of 'IndexError: index out of range in self' in every worker. Checked on
real `prepare text` windows (seq_len + 1 tokens) and tiny Hugging Face models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrator import load_config
from orchestrator.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def gpt2(num_classes: int = 256, positions: int = 64) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=num_classes, n_positions=positions, n_embd=16, n_layer=1, n_head=2,
                                      bos_token_id=None, eos_token_id=None))


def llama(num_classes: int = 256, positions: int = 32) -> Any:
    """Rotary positions: no table to run past, longer sequences run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=num_classes, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=positions))


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`orchestrator prepare text --seq-len 64`: windows of 65 tokens."""
    from pipelines.prepare import prepare_text

    out = tmp_path_factory.mktemp("text")
    prepare_text([str(ROOT / "README.md")], str(out), seq_len=64, shards=1)
    return out


def resolve(text: Path, *overrides: str, named: bool = True) -> Any:
    """The driver's checks (trainer.resolve_for_data, which `train` runs before Ray starts) on the prepared text."""
    from orchestrator.trainer import resolve_for_data
    from pipelines.datasets import inspect_datasets

    config = load_config(None, [f"data.train={text}/train", "data.val=null", "data.features=[tokens]",
                                "data.label=null", "task.name=causal_lm", "task.loss=model" if named else
                                "task.loss=task", *(["model.inputs={input_ids: tokens}"] if named else []),
                                *overrides])
    return resolve_for_data(config, inspect_datasets(config.data, named=named))


def run_past_the_table(text: Path, model: torch.nn.Module) -> None:
    """What each worker would do with the sample rows: the model's forward on 65 tokens."""
    from pipelines.batches import collate_sample
    from pipelines.datasets import inspect_datasets

    config = load_config(None, [f"data.train={text}/train", "data.val=null", "data.features=[tokens]",
                                "data.label=null"])
    batch = collate_sample(inspect_datasets(config.data, named=True)["train"].sample, config.data, named=True)
    assert batch["tokens"].shape[1] == 65
    with torch.no_grad():
        model(input_ids=batch["tokens"])


def test_windows_longer_than_the_models_positions_are_refused_naming_both_and_the_fix(text: Path) -> None:
    with pytest.raises(IndexError, match="index out of range"):  # what the workers hit without the check
        run_past_the_table(text, gpt2(positions=64))
    with pytest.raises(ConfigError) as refused:
        resolve(text, "model.entrypoint=test_model_positions:gpt2", "model.positions=64")
    message = str(refused.value)
    assert "\n" not in message
    assert "65 tokens" in message and "64 positions" in message and "n_positions" in message
    assert "orchestrator prepare text --seq-len 63" in message and "'tokens'" in message
    resolve(text, "model.entrypoint=test_model_positions:gpt2", "model.positions=65")  # room for all 65: accepted


def test_forward_x_takes_the_window_less_its_last_token(text: Path) -> None:
    # model.inputs unset: forward(x) with x = the window's first 64 tokens, the targets shifted by one.
    resolve(text, "model.entrypoint=test_model_positions:gpt2", "model.positions=64", named=False)
    with pytest.raises(ConfigError, match=r"64 tokens,.* 32 positions .*--seq-len 32\b"):
        resolve(text, "model.entrypoint=test_model_positions:gpt2", "model.positions=32", named=False)


def test_the_positions_of_a_pretrained_model_are_its_saved_configs(text: Path, tmp_path: Path) -> None:
    # The builder's default has 1024 positions; the saved model has 64, which is what the workers build.
    gpt2(positions=64).save_pretrained(tmp_path / "base")
    with pytest.raises(ConfigError, match=r"65 tokens,.* 64 positions \(n_positions in .*base/config.json\)"):
        resolve(text, "model.entrypoint=test_model_positions:gpt2", "model.positions=1024",
                f"model.pretrained={tmp_path}/base")
    with pytest.raises(ConfigError, match=r"'model.pretrained': .*missing holds no config.json: .*save_pretrained"):
        resolve(text, "model.entrypoint=test_model_positions:gpt2", f"model.pretrained={tmp_path}/missing")


def test_rotary_positions_have_no_table_and_are_not_refused(text: Path) -> None:
    run_past_the_table(text, llama(positions=32))  # runs: nothing to refuse
    resolve(text, "model.entrypoint=test_model_positions:llama", "model.positions=32")
