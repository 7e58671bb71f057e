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

ROOT = Path(__file__).resolve().parents[3]


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
    from orchestrator.run.checks import resolve_for_data
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
        resolve(text, "model.entrypoint=test_model_checks:gpt2", "model.positions=64")
    message = str(refused.value)
    assert "\n" not in message
    assert "65 tokens" in message and "64 positions" in message and "n_positions" in message
    assert "orchestrator prepare text --seq-len 63" in message and "'tokens'" in message
    resolve(text, "model.entrypoint=test_model_checks:gpt2", "model.positions=65")  # room for all 65: accepted


def test_forward_x_takes_the_window_less_its_last_token(text: Path) -> None:
    # model.inputs unset: forward(x) with x = the window's first 64 tokens, the targets shifted by one.
    resolve(text, "model.entrypoint=test_model_checks:gpt2", "model.positions=64", named=False)
    with pytest.raises(ConfigError, match=r"64 tokens,.* 32 positions .*--seq-len 32\b"):
        resolve(text, "model.entrypoint=test_model_checks:gpt2", "model.positions=32", named=False)


def test_the_positions_of_a_pretrained_model_are_its_saved_configs(text: Path, tmp_path: Path) -> None:
    # The builder's default has 1024 positions; the saved model has 64, which is what the workers build.
    gpt2(positions=64).save_pretrained(tmp_path / "base")
    with pytest.raises(ConfigError, match=r"65 tokens,.* 64 positions \(n_positions in .*base/config.json\)"):
        resolve(text, "model.entrypoint=test_model_checks:gpt2", "model.positions=1024",
                f"model.pretrained={tmp_path}/base")
    with pytest.raises(ConfigError, match=r"'model.pretrained': .*missing holds no config.json: .*save_pretrained"):
        resolve(text, "model.entrypoint=test_model_checks:gpt2", f"model.pretrained={tmp_path}/missing")


def test_rotary_positions_have_no_table_and_are_not_refused(text: Path) -> None:
    run_past_the_table(text, llama(positions=32))  # runs: nothing to refuse
    resolve(text, "model.entrypoint=test_model_checks:llama", "model.positions=32")


def roberta(num_classes: int = 64, positions: int = 34) -> Any:
    """RoBERTa's table: positions start at padding_idx + 1, so max_position_embeddings=34 holds 32 tokens."""
    from transformers import RobertaConfig, RobertaModel

    return RobertaModel(RobertaConfig(vocab_size=num_classes, hidden_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=32, max_position_embeddings=positions))


def test_roberta_limit_is_the_longest_sequence_its_table_runs() -> None:
    from orchestrator.models.zoo import position_limit

    model = roberta(positions=34)
    found = position_limit(model)
    assert found is not None
    limit, key = found
    assert key == "max_position_embeddings"

    def forward(length: int) -> None:
        # token_type_ids given, so the position table (not RoBERTa's token-type buffer) is what a longer row hits.
        with torch.no_grad():
            model(input_ids=torch.full((1, length), 5), token_type_ids=torch.zeros(1, length, dtype=torch.long))

    forward(limit)  # the limit runs
    with pytest.raises(IndexError, match="index out of range"):
        forward(limit + 1)


@pytest.fixture(scope="module")
def ragged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Variable-length token rows of 58, 40 and 12 tokens (a mask comes with them), two micro-batches' worth."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path_factory.mktemp("ragged")
    (out / "train").mkdir()
    rows = [list(range(1, n + 1)) for n in (58, 40, 12) * 43]
    pq.write_table(pa.table({"tokens": pa.array(rows, pa.list_(pa.int64()))}), out / "train" / "part-0.parquet")
    return out


def forward_sample(data: Path, model: torch.nn.Module, *overrides: str) -> None:
    """The model's forward on the sample rows collated as the workers collate them (mask and all)."""
    from pipelines.batches import collate_sample
    from pipelines.datasets import inspect_datasets

    config = load_config(None, [f"data.train={data}/train", "data.val=null", "data.features=[tokens]",
                                "data.label=null", *overrides])
    batch = collate_sample(inspect_datasets(config.data, named=True)["train"].sample, config.data, named=True)
    with torch.no_grad():
        model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"])


def test_rounding_alone_past_the_table_names_pad_to_multiple_of_and_the_real_length(ragged: Path) -> None:
    # 58 real tokens fit 60 positions, but rounded up to a multiple of 16 the rows are 64 wide: the workers fail.
    forward_sample(ragged, gpt2(positions=60))
    with pytest.raises(IndexError, match="index out of range"):
        forward_sample(ragged, gpt2(positions=60), "data.pad_to_multiple_of=16")
    with pytest.raises(ConfigError) as refused:
        resolve(ragged, "model.entrypoint=test_model_checks:gpt2", "model.positions=60",
                "data.pad_to_multiple_of=16")
    message = str(refused.value)
    assert "\n" not in message
    assert "58 tokens" in message and "64 tokens" in message and "60 positions" in message
    assert "data.pad_to_multiple_of" in message
    resolve(ragged, "model.entrypoint=test_model_checks:gpt2", "model.positions=60")  # unrounded: accepted
    resolve(ragged, "model.entrypoint=test_model_checks:gpt2", "model.positions=60", "data.pad_to_multiple_of=4")


def test_rows_past_the_table_report_the_longest_real_row_not_the_padded_width(ragged: Path) -> None:
    with pytest.raises(ConfigError) as refused:  # 58 real tokens, padded to 64, 32 positions
        resolve(ragged, "model.entrypoint=test_model_checks:gpt2", "model.positions=32",
                "data.pad_to_multiple_of=16")
    message = str(refused.value)
    assert "sequences of 58 tokens" in message and "32 positions" in message
    assert "at most 32 tokens" in message and "n_positions >= 64" in message  # the workers pad 58 to 64
