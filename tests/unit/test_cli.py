"""CLI errors that happen before Ray starts: non-zero exit and one line naming the problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_bad_config_key_exits_non_zero_naming_it() -> None:
    out = cli("train", "--set", "optim.learning_rate=0.1")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: unknown config key 'optim.learning_rate' (did you mean 'optim.lr'?)"]


def test_typo_gets_a_suggestion(tmp_path: Path) -> None:
    (tmp_path / "exp.yaml").write_text("optim:\n  wieght_decay: 0.1\n")
    out = cli("show-config", "--config", str(tmp_path / "exp.yaml"))
    assert out.returncode == 2
    assert "unknown config key 'optim.wieght_decay' (did you mean 'optim.weight_decay'?)" in out.stderr


def test_missing_data_path_exits_non_zero_naming_it(tmp_path: Path) -> None:
    out = cli("train", "--set", f"data.train={tmp_path}/absent")
    assert out.returncode == 2
    assert f"data path '{tmp_path}/absent' does not exist" in out.stderr
    assert "Traceback" not in out.stderr


def test_missing_column_exits_non_zero_naming_it(digits_dir: str) -> None:
    out = cli("train", "--set", f"data.train={digits_dir}/train", "--set", f"data.val={digits_dir}/val",
              "--set", "data.features=[pixles]")
    assert out.returncode == 2
    assert "column(s) ['pixles'] not found" in out.stderr


@pytest.mark.parametrize(("override", "key"), [
    ("train.micro_batch_size=0", "train.micro_batch_size"),  # was a ZeroDivisionError traceback
    ("train.micro_batch_size=-4", "train.micro_batch_size"),  # was accepted: accumulation -16
    ("train.max_steps=12", "optim.warmup_steps"),  # the default warmup of 20 never ends
    ("train.seed=-1", "train.seed"),
    ("optim.lr=.inf", "optim.lr"),
    ("data.s3.connect_timeout_s=.inf", "data.s3.connect_timeout_s"),
    ("storage.path=", "storage.path"),
])
def test_bad_value_exits_with_one_line_naming_the_key(override: str, key: str) -> None:
    out = cli("show-config", "--set", override)
    assert out.returncode == 2, out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: config key '{key}': "), out.stderr


def test_warmup_longer_than_the_epochs_is_refused_before_ray_starts(tmp_path: Path, digits_dir: str) -> None:
    out = cli("train", "--set", f"data.train={digits_dir}/train", "--set", f"data.val={digits_dir}/val",
              "--set", "train.epochs=1", "--set", "tracking.enabled=false", "--set", f"storage.path={tmp_path}/runs",
              cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "error: config key 'optim.warmup_steps': optim.warmup_steps=20 must be below the run's 12 optimizer steps "
        "(train.epochs=1 over 1438 rows at global batch 128): lower optim.warmup_steps or train longer"]


def test_show_config_prints_resolved_yaml() -> None:
    out = cli("show-config", "--set", "optim.lr=1e-3", "--set", "scaling.num_workers=1")
    assert out.returncode == 0, out.stderr
    import yaml

    tree = yaml.safe_load(out.stdout)
    assert tree["optim"]["lr"] == pytest.approx(1e-3)
    assert tree["train"]["micro_batch_size"] == 128  # derived for one worker


def test_show_config_explain_is_the_same_yaml_with_each_keys_meaning() -> None:
    import yaml

    plain, explained = cli("show-config"), cli("show-config", "--explain")
    assert plain.returncode == 0 and explained.returncode == 0, explained.stderr
    assert yaml.safe_load(explained.stdout) == yaml.safe_load(plain.stdout)
    assert "  # Linear warmup from 0 to lr.\n  warmup_steps: 20\n" in explained.stdout


def test_show_config_plan_prints_what_train_decides_before_ray_starts(tmp_path: Path, digits_dir: str) -> None:
    """The config resolved for the data, then the plan: rows counted here by pyarrow, and a warmup the data's step
    count cannot hold refused as `train` refuses it."""
    import pyarrow.parquet as pq
    import yaml

    sets = ["--set", f"data.train={digits_dir}/train", "--set", f"data.val={digits_dir}/val", "--set",
            f"storage.path={tmp_path}/runs", "--set", "tracking.enabled=false", "--set", "train.epochs=2",
            "--set", "train.max_steps=null", "--set", "scaling.num_workers=2"]
    out = cli("show-config", "--plan", *sets)
    assert out.returncode == 0, out.stderr
    config, plan = yaml.safe_load_all(out.stdout)
    rows = pq.ParquetDataset(f"{digits_dir}/train").read().num_rows
    steps = -(-2 * (rows // 2) // (config["train"]["global_batch_size"] // 2))  # 2 epochs of each worker's rows
    assert config["train"]["max_steps"] == plan["training"]["steps"] == steps and config["model"]["num_classes"] == 10
    assert plan["data"]["train"]["rows"] == rows and plan["run"]["place"].startswith(f"{tmp_path}/runs/")
    assert plan["tracking"] is None and not (tmp_path / "runs").exists()  # planned, nothing written
    # The precision the CPU workers will run, resolved as they resolve it: never `auto` itself.
    from orchestrator.training.precision import resolve_precision

    assert config["train"]["precision"] == "auto" and plan["training"]["precision"] == resolve_precision(
        "auto", torch.device("cpu"))
    refused = cli("show-config", "--plan", *sets, "--set", f"optim.warmup_steps={steps}")
    assert refused.returncode == 2 and "optim.warmup_steps" in refused.stderr


def test_train_and_tune_help_name_where_every_config_key_is_explained() -> None:
    for command in ("train", "tune"):
        out = cli(command, "--help")
        assert out.returncode == 0, out.stderr
        assert "Every configuration key with its meaning: orchestrator show-config --explain" in out.stdout


def test_prepare_writes_shards(tmp_path: Path) -> None:
    out = cli("prepare", "synthetic", "--out", str(tmp_path), "--rows", "100", "--shards", "2")
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["part-00000.parquet", "part-00001.parquet"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_gpu_run_on_a_local_cluster_without_gpus_stops_instead_of_waiting(tmp_path: Path, digits_dir: str) -> None:
    """A local cluster never grows: a worker group it cannot hold is refused once Ray is up, not waited for."""
    out = cli("train", "--set", f"data.train={digits_dir}/train", "--set", f"data.val={digits_dir}/val",
              "--set", "scaling.use_gpu=true", "--set", "scaling.num_workers=1", "--set", "tracking.enabled=false",
              cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error: this run needs 1 GPUs (scaling.num_workers with scaling.use_gpu) but the Ray cluster has 0" \
        in out.stderr
    assert "Traceback" not in out.stderr


def test_version_prints_the_package_version() -> None:
    from importlib.metadata import version

    out = cli("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"orchestrator {version('orchestrator')}\n"


def test_every_option_of_every_subcommand_has_help() -> None:
    import argparse

    from orchestrator.cli import build_parser

    def undocumented(parser: argparse.ArgumentParser, path: str) -> list[str]:
        found = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {choice.dest: choice.help for choice in action._choices_actions}  # only those given help
                for name, sub in action.choices.items():
                    found += [] if helps.get(name) else [f"{path} {name}"]
                    found += undocumented(sub, f"{path} {name}")
            elif not action.help or action.help == argparse.SUPPRESS:
                found.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
        return found

    assert undocumented(build_parser(), "orchestrator") == []


def test_an_address_where_no_ray_cluster_answers_is_named_at_once(tmp_path: Path, digits_dir: str) -> None:
    """`--address host:port` with nothing listening: one line naming the address and the fix, at once, instead of
    Ray's minutes of retries."""
    import socket

    with socket.socket() as sock:  # a port nothing listens on once the socket is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = cli("train", "--address", f"127.0.0.1:{port}", "--set", f"data.train={digits_dir}/train",
              "--set", f"data.val={digits_dir}/val", "--set", "tracking.enabled=false", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"error: no Ray cluster answers at 127.0.0.1:{port} (--address or RAY_ADDRESS)" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
