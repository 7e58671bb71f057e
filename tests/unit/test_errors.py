"""The typical mistakes, each refused before Ray starts with one line that names the key and the fix."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.config import load_config
from orchestrator.errors import ConfigError
from orchestrator.run.checks import resolve_for_data
from orchestrator.run.model_checks import check_model_build, check_model_options
from pipelines.sources import DatasetInfo

ROOT = Path(__file__).resolve().parents[2]
DIGITS = {"train": DatasetInfo("train", [], num_rows=1438, num_bytes=0, feature_dim=64, num_classes=10)}


def refusal(path: str | Path | None = None, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_for_data(load_config(path, overrides), DIGITS)
    assert "\n" not in str(info.value)
    return str(info.value)


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


@pytest.fixture
def my_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A user's module `my_models` in the working directory (fresh: other tests write their own `my_models`)."""
    monkeypatch.delitem(sys.modules, "my_models", raising=False)
    (tmp_path / "my_models.py").write_text(
        "import torch\n"
        "def build(in_features, num_classes, width=8):\n"
        "    return torch.nn.Linear(in_features, num_classes)\n"
        "def picky(in_features, num_classes, depth=2):\n"
        "    if depth < 1:\n"
        "        raise ValueError(f'depth must be at least 1, got {depth}')\n"
        "    return torch.nn.Linear(in_features, num_classes)\n"
        "def needs_vocab(vocab, num_classes):\n"
        "    return torch.nn.Embedding(vocab, num_classes)\n"
        "def data_dependent(in_features, num_classes, width=8):\n"
        "    scale = torch.ones(1).item()  # no meta kernel can answer this: checked in the workers instead\n"
        "    return torch.nn.Linear(in_features, int(width * scale))\n"
        "def needs_file(in_features, num_classes):\n"
        "    return torch.load('/nonexistent/weights.pt')\n"
        "def in_a_worker(in_features, num_classes):\n"
        "    import ray.train\n"
        "    ray.train.get_context().get_world_rank()  # only a Ray Train worker can answer this\n"
        "    return torch.nn.Linear(in_features, num_classes)\n"
        "def gpu_only(in_features, num_classes, width=8):\n"
        "    torch.cuda.current_device()  # a driver without a GPU cannot run this; the workers can\n"
        "    return torch.nn.Linear(in_features, num_classes)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_models", None)  # the next test's my_models is another file


# 1. The model is built once on the driver (meta device), for the classic forward(x) too.

def test_options_the_builder_cannot_take_are_refused_naming_the_key() -> None:
    assert refusal(None, ["model.hidden=512"]) == (
        "config key 'model.hidden': model 'mlp' cannot be built with hidden=512 (TypeError: 'int' object is not "
        "iterable)")
    assert refusal(None, ["model.hidden=512", "model.dropout=0.1"]).startswith(
        "config keys 'model.hidden', 'model.dropout': model 'mlp' cannot be built with hidden=512, dropout=0.1 "
        "(TypeError: ")
    assert refusal(None, ["model.name=cnn", "model.channels=16"]).startswith(
        "config key 'model.channels': model 'cnn' cannot be built with channels=16 (TypeError: ")
    # The builder's own ConfigError stays as it is.
    assert refusal(None, ["model.name=gpt", "model.d_model=30", "model.n_head=4", "data.label=null",
                          "model.num_classes=16"]) == "model 'gpt': d_model=30 must be divisible by n_head=4"


def test_a_users_builder_is_checked_with_its_options(my_models: Path) -> None:
    assert refusal(None, ["model.entrypoint=my_models:picky", "model.depth=0"]) == (
        "config key 'model.depth': model 'my_models:picky' cannot be built with depth=0 (ValueError: depth must be "
        f"at least 1, got 0 at {_line(my_models, 'raise ValueError')})")
    assert refusal(None, ["model.entrypoint=my_models:needs_vocab"]) == (
        "config key 'model.entrypoint': model 'my_models:needs_vocab' cannot be built (TypeError: needs_vocab() "
        "missing 1 required positional argument: 'vocab')")
    # Any error of the builder, not only a TypeError or ValueError: every worker would raise it again.
    assert refusal(None, ["model.entrypoint=my_models:needs_file"]) == (
        "config key 'model.entrypoint': model 'my_models:needs_file' cannot be built (FileNotFoundError: [Errno 2] "
        f"No such file or directory: '/nonexistent/weights.pt' at {_line(my_models, 'nonexistent')})")


def _line(folder: Path, text: str) -> str:
    """'path:line' of the line of my_models.py that holds `text`."""
    path = folder / "my_models.py"
    return f"{path}:{next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)}"
    resolve_for_data(load_config(None, ["model.entrypoint=my_models:picky", "model.depth=3"]), DIGITS)


@pytest.mark.parametrize("builder", ["data_dependent", "gpu_only", "in_a_worker"])
def test_a_builder_the_driver_cannot_run_is_left_to_the_workers(my_models: Path, builder: str) -> None:
    config = load_config(None, [f"model.entrypoint=my_models:{builder}"])
    assert check_model_build(config.model, 64, 10) is None
    resolve_for_data(config, DIGITS)  # not refused


def test_the_driver_builds_the_workers_model_without_memory() -> None:
    model = check_model_build(load_config(None, ["model.hidden=[4096, 4096]"]).model, 64, 10)
    assert model is not None and {p.device.type for p in model.parameters()} == {"meta"}


def test_cli_refuses_the_option_before_ray_starts(tmp_path: Path, digits_dir: str) -> None:
    out = cli("train", "--set", f"data.train={digits_dir}/train", "--set", f"data.val={digits_dir}/val",
              "--set", "tracking.enabled=false", "--set", f"storage.path={tmp_path}/runs", "--set", "model.hidden=512",
              cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "error: config key 'model.hidden': model 'mlp' cannot be built with hidden=512 (TypeError: 'int' object is "
        "not iterable)"]


# 2. A YAML syntax error: one line with its place.

@pytest.mark.parametrize(("text", "message"), [
    ("optim: {lr: [1,\nfoo: 2\n", "at line 3, column 1: expected ',' or ']', but got '<stream end>' (while parsing a "
                                  "flow sequence that starts at line 1, column 13)"),
    ("a: b: c\n", "at line 1, column 5: mapping values are not allowed here"),
    ("optim:\n\tlr: 1\n", "at line 2, column 1: found character '\\t' that cannot start any token"),
])
def test_yaml_syntax_errors_are_one_line(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "x.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "x.yaml")
    assert str(info.value) == f"config file '{tmp_path / 'x.yaml'}' is not valid YAML {message}"


def test_cli_prints_one_line_for_a_yaml_error(tmp_path: Path) -> None:
    (tmp_path / "x.yaml").write_text("optim: {lr: [1,\nfoo: 2\n")
    out = cli("show-config", "--config", "x.yaml", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "error: config file 'x.yaml' is not valid YAML at line 3, column 1: expected ',' or ']', but got "
        "'<stream end>' (while parsing a flow sequence that starts at line 1, column 13)"]


# 3. A value that fits no member of a union: the key once, and what it takes.

@pytest.mark.parametrize(("override", "message"), [
    ("scaling.num_workers=abc", "config key 'scaling.num_workers': give a count or [min, max], got 'abc'"),
    ("scaling.num_workers=[1, a]", "config key 'scaling.num_workers': give a count or [min, max], got [1, 'a']"),
    ("train.micro_batch_size=abc", "config key 'train.micro_batch_size': give a count, auto, or null to derive it, "
                                   "got 'abc'"),
    ("model.inputs=3", "config key 'model.inputs': give a list of argument names, {argument: column}, or null, got 3"),
])
def test_union_errors_name_the_key_once(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value) == message


def test_union_errors_keep_the_other_problems() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["scaling.num_workers=abc", "optim.lrr=1", "train.micro_batch_size=x"])
    assert str(info.value) == ("config key 'train.micro_batch_size': give a count, auto, or null to derive it, got "
                               "'x'; unknown config key 'optim.lrr' (did you mean 'optim.lr'?); config key "
                               "'scaling.num_workers': give a count or [min, max], got 'abc'")


def test_a_union_without_a_note_is_described_from_its_members() -> None:
    from typing import Literal

    from pydantic import BaseModel

    from orchestrator.config.load import _accepts

    class Loose(BaseModel):
        size: int | list[str] | None = None
        mode: float | Literal["auto", "off"] | dict[str, int] = "auto"

    assert _accepts(Loose.model_fields["size"]) == "a whole number, a list of strings or null"
    assert _accepts(Loose.model_fields["mode"]) == "a number, auto, off or a mapping"


# 4. A key in the wrong place: the full dotted key where it lives.

@pytest.mark.parametrize(("override", "message"), [
    ("lr=1e-3", "unknown config key 'lr' (did you mean 'optim.lr'?)"),
    ("train.lr=1e-3", "unknown config key 'train.lr' (did you mean 'optim.lr'?)"),
    ("max_steps=10", "unknown config key 'max_steps' (did you mean 'train.max_steps'?)"),
    ("seed=1", "unknown config key 'seed' (did you mean 'train.seed' or 'tune.seed'?)"),
    ("s3.region=x", "unknown config key 's3' (did you mean 'data.s3'?)"),
    ("optim.lrr=1", "unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"),  # a typo: its own section
])
def test_a_key_in_the_wrong_section_suggests_where_it_lives(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value) == message


def test_a_config_key_under_model_suggests_where_it_lives() -> None:
    with pytest.raises(ConfigError) as info:
        check_model_options(load_config(None, ["model.lr=1e-3"]).model)
    assert str(info.value) == ("config key 'model.lr': model 'mlp' takes no option 'lr' (did you mean 'optim.lr'?) "
                               "(from --set); its options: ['hidden', 'dropout']")


# 5. A config file that is not there: the closest one in its directory.

def test_a_missing_config_file_suggests_the_closest(tmp_path: Path) -> None:
    (tmp_path / "digits.yaml").write_text("{}\n")
    (tmp_path / "text-gpt.yaml").write_text("{}\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "digit.yaml")
    assert str(info.value) == (f"config file '{tmp_path}/digit.yaml' not found (did you mean "
                               f"'{tmp_path}/digits.yaml'?)")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "zzz.yaml")
    assert str(info.value) == f"config file '{tmp_path}/zzz.yaml' not found"


def test_cli_suggests_the_example_file() -> None:
    out = cli("show-config", "--config", "examples/digit.yaml")
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "error: config file 'examples/digit.yaml' not found (did you mean 'examples/digits.yaml'?)"]


# 6. A file's options for another model: where they came from, and how to drop them.

def test_options_from_the_file_are_named_with_their_file(my_models: Path) -> None:
    path = my_models / "exp.yaml"
    path.write_text("model: {name: mlp, hidden: [256, 256], dropout: 0.1}\n")
    with pytest.raises(ConfigError) as info:
        check_model_options(load_config(path, ["model.entrypoint=my_models:build", "model.layers=3"]).model)
    assert str(info.value) == (
        f"config keys 'model.hidden', 'model.dropout', 'model.layers': model 'my_models:build' takes no options "
        f"'hidden' (from {path}), 'dropout' (from {path}), 'layers' (from --set); its options: ['width']; remove "
        f"them "
        f"from {path} or with --set model.hidden=null --set model.dropout=null")
    # null drops a model option: the builder's default applies.
    config = load_config(path, ["model.entrypoint=my_models:build", "model.hidden=null", "model.dropout=null"])
    assert config.model.kwargs == {}
    check_model_options(config.model)
    resolve_for_data(config, DIGITS)


def test_a_null_model_option_is_left_out() -> None:
    config = load_config(None, ["model.dropout=null"])
    assert config.model.kwargs == {}
    assert config.model.model_extra == {"dropout": None}  # shown by show-config as the user wrote it


def test_where_options_came_from_is_not_part_of_the_config() -> None:
    from orchestrator.config import config_from_dict, to_dict

    config = load_config(None, ["model.hidden=[32]"])
    assert config.model.origins == {"hidden": "--set"}
    rebuilt = config_from_dict(to_dict(config))
    assert rebuilt == config and rebuilt.model.origins == {}
    assert "origins" not in str(to_dict(config))


def test_cli_names_the_file_of_a_stale_option(my_models: Path) -> None:
    out = cli("show-config", "--config", str(ROOT / "examples/digits.yaml"), "--set",
              "model.entrypoint=my_models:build", cwd=my_models)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"error: config key 'model.hidden': model 'my_models:build' takes no option 'hidden' (from {ROOT}/examples/"
        f"digits.yaml); its options: ['width']; remove it from {ROOT}/examples/digits.yaml or with --set "
        "model.hidden=null"]
    out = cli("show-config", "--config", str(ROOT / "examples/digits.yaml"), "--set",
              "model.entrypoint=my_models:build", "--set", "model.hidden=null", cwd=my_models)
    assert out.returncode == 0, out.stderr
