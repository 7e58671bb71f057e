"""The config reference (orchestrator/config/reference.py): docs/config.md is what `markdown()` generates from the
schema's descriptions, every key has a description, and `explain()` is YAML that loads back to the same config and
carries every key's description as a comment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from orchestrator.config import config_from_dict, load_config, to_dict
from orchestrator.config.reference import REGENERATE, description, explain, keys, markdown

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def test_docs_config_md_is_current() -> None:
    page = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert page == markdown(), f"docs/config.md is out of date with the config schema: run `{REGENERATE}`"


def test_every_key_has_a_description() -> None:
    missing = [k.name for k in keys() if not (k.field.description or "").strip()]
    assert missing == [], ("add description= to these config fields (orchestrator/config/, "
                           f"pipelines/config.py): {missing}")


def test_the_page_lists_every_key_and_section() -> None:
    page = markdown()
    for key in keys():
        if key.section is None:
            assert f"| `{key.name}` |" in page, key.name
        else:
            assert f"\n## {key.name}\n" in page, key.name


def _comments(text: str) -> str:
    """The comment text of a YAML document, joined into one whitespace-normalised string."""
    return " ".join(" ".join(line.split("#", 1)[1].split()) for line in text.splitlines()
                    if line.lstrip().startswith("#"))


@pytest.mark.parametrize("path", [None, *EXAMPLES], ids=lambda p: p.name if p else "defaults")
def test_explain_is_the_config_as_yaml_with_every_description(path: Path | None) -> None:
    config = load_config(path)
    text = explain(config)
    loaded = yaml.safe_load(text)
    assert loaded == to_dict(config)
    assert config_from_dict(loaded) == config
    comments = _comments(text)
    for key in keys():
        assert " ".join(key.field.description.split()) in comments, key.name  # type: ignore[union-attr]
    # A model option (not a field of ModelConfig) is explained as one.
    options = [k for k in (config.model.model_extra or {})]
    for option in options:
        assert re.search(rf"# {re.escape(description('model.' + option))}\n\s+{option}:", text), option


def test_explain_comments_sit_above_their_key() -> None:
    text = explain(load_config(None))
    lines = text.splitlines()
    at = lines.index("  lr: 0.003")
    assert lines[at - 1].strip() == f"# {description('optim.lr')}"
    above_train = lines[:lines.index("train:")]
    assert [line for line in above_train if line.startswith("# Length of training")], "train's comment is missing"
    assert above_train[-1].startswith("# ") and above_train[-1].endswith("parallel mode.")
