from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config import flatten, load_config, parse_override, to_dict
from orchestrator.errors import ConfigError
from orchestrator.run.model_checks import check_model_options


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    return path


def test_defaults_file_then_overrides_take_precedence(tmp_path: Path) -> None:
    path = write(tmp_path, "optim: {lr: 0.01, warmup_steps: 7}\nscaling: {num_workers: 4}\n")
    cfg = load_config(path, ["optim.lr=1e-3", "train.global_batch_size=64"])
    assert cfg.optim.lr == pytest.approx(1e-3)  # --set beats the file
    assert cfg.optim.warmup_steps == 7  # file beats the default
    assert cfg.optim.weight_decay == 0.01  # default kept
    assert cfg.scaling.num_workers == 4
    assert (cfg.train.micro_batch_size, cfg.train.grad_accum_steps) == (16, 1)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["train.global_batch_size=256", "train.micro_batch_size=32"], (256, 32, 4)),
        (["train.global_batch_size=256", "train.grad_accum_steps=4"], (256, 32, 4)),
        (["train.micro_batch_size=8", "train.grad_accum_steps=4"], (64, 8, 4)),
        (["train.global_batch_size=64"], (64, 32, 1)),
    ],
)
def test_any_two_batch_sizes_derive_the_third(overrides: list[str], expected: tuple[int, int, int]) -> None:
    t = load_config(None, overrides).train  # 2 workers by default
    assert (t.global_batch_size, t.micro_batch_size, t.grad_accum_steps) == expected


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optim.lrr=1"], "unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"),
        (["trian.max_steps=3"], "unknown config key 'trian' (did you mean 'train'?)"),
        # Names other libraries use for the same key (too unlike ours for a spelling match).
        (["optim.learning_rate=1e-3"], "unknown config key 'optim.learning_rate' (did you mean 'optim.lr'?)"),
        (["train.learning_rate=1e-3"], "unknown config key 'train.learning_rate' (did you mean 'optim.lr'?)"),
        (["train.batch_size=64"], "unknown config key 'train.batch_size' (did you mean 'train.global_batch_size' or "
                                  "'train.micro_batch_size'?)"),
        (["scaling.workers=2"], "unknown config key 'scaling.workers' (did you mean 'scaling.num_workers'?)"),
        (["optim.lr=-1"], "config key 'optim.lr': Input should be greater than 0"),
        (["train.precision=fp8"], "config key 'train.precision'"),
        (["train.precision=fp16"], "fp16 needs a GPU"),
        (["train.global_batch_size=100", "scaling.num_workers=3"], "not divisible by scaling.num_workers=3"),
        (["train.global_batch_size=128", "train.micro_batch_size=48"], "must equal micro_batch_size=48"),
        (["train.epochs=2", "train.max_steps=10"], "set exactly one of train.max_steps and train.epochs"),
        (["optim.momentum=0.9"], "optim.momentum has no effect with optim.name=adamw"),
        (["optim.schedule=constant", "optim.min_lr_ratio=0.1"], "min_lr_ratio has no effect"),
        (["train.parallel=fsdp", "train.sync=local_sgd"], "train.sync=local_sgd averages whole replicas and cannot "
                                                          "run on sharded parameters"),
        (["train.fsdp.defer_sync=true"], "train.fsdp has no effect with train.parallel=ddp"),
        # What the workers could only refuse after the worker group started: refused on the driver instead.
        (["train.parallel=fsdp", "train.compile=true"], "train.compile=true does not combine with "
                                                        "train.parallel=fsdp"),
        (["train.parallel=fsdp", "train.micro_batch_size=auto"], "train.micro_batch_size=auto cannot probe memory "
                                                                 "under train.parallel=fsdp"),
        (["train.parallel=zero3"], "config key 'train.parallel'"),
        (["scaling.accelerator_type=H100"], "scaling.accelerator_type needs scaling.use_gpu=true"),
        (["optim.lr"], "must look like section.key=value"),
        # Values that used to pass and crash later (ZeroDivisionError, workers' IndexError, numpy's seed check)
        # or silently misbehave (an LR that never reaches its peak).
        (["train.micro_batch_size=0"], "config key 'train.micro_batch_size': must be at least 1"),
        (["train.micro_batch_size=-4"], "config key 'train.micro_batch_size': must be at least 1"),
        (["train.micro_batch_size=-4", "scaling.num_workers=[1, 2]"], "config key 'train.micro_batch_size'"),
        (["train.max_steps=12"], "config key 'optim.warmup_steps': optim.warmup_steps=20 must be below "
                                 "train.max_steps=12"),
        (["train.max_steps=20"], "config key 'optim.warmup_steps': optim.warmup_steps=20 must be below"),
        (["train.seed=-1"], "config key 'train.seed': Input should be greater than or equal to 0"),
        (["train.seed=4294967296"], "config key 'train.seed': Input should be less than or equal to 4294967295"),
        (["tune.seed=-1"], "config key 'tune.seed': Input should be greater than or equal to 0"),
        (["optim.lr=.inf"], "config key 'optim.lr': Input should be a finite number"),
        (["optim.weight_decay=.inf"], "config key 'optim.weight_decay': Input should be a finite number"),
        (["train.epochs=.inf"], "config key 'train.epochs': Input should be a finite number"),
        (["data.s3.request_timeout_s=.inf"], "config key 'data.s3.request_timeout_s': Input should be a finite"),
        (["data.transforms=[{normalize: {mean: .nan}}]"], "config key 'data.transforms.mean': Input should be a "
                                                          "finite number"),
        (["failure.preemption_grace_s=.inf"], "config key 'failure.preemption_grace_s': Input should be a finite"),
        (["cost.price_per_hour=.inf"], "config key 'cost.price_per_hour': Input should be a finite number"),
        (["tracking.experiment="], "config key 'tracking.experiment': String should have at least 1 character"),
        (["storage.path="], "config key 'storage.path': String should have at least 1 character"),
        (["data.train="], "config key 'data.train': String should have at least 1 character"),
    ],
)
def test_bad_config_names_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_warmup_must_fit_the_steps_epochs_make(tmp_path: Path) -> None:
    from orchestrator.run.checks import resolve_for_data
    from pipelines.sources import DatasetInfo

    # The default config (warmup 20, global batch 128, 2 workers) for one epoch of 1438 rows: 12 steps.
    infos = {"train": DatasetInfo("train", [], num_rows=1438, num_bytes=0, feature_dim=64, num_classes=10)}
    with pytest.raises(ConfigError) as info:
        resolve_for_data(load_config(None, ["train.epochs=1"]), infos)
    assert str(info.value) == ("config key 'optim.warmup_steps': optim.warmup_steps=20 must be below the run's 12 "
                               "optimizer steps (train.epochs=1 over 1438 rows at global batch 128): lower "
                               "optim.warmup_steps or train longer")
    resolved = resolve_for_data(load_config(None, ["train.epochs=1", "optim.warmup_steps=11"]), infos)
    assert (resolved.train.max_steps, resolved.optim.warmup_steps) == (12, 11)
    assert load_config(None, ["train.max_steps=12", "optim.warmup_steps=0"]).train.max_steps == 12


def test_file_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "optim: {lr: [1,\n"))
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_epochs_replace_the_default_step_count() -> None:
    cfg = load_config(None, ["train.epochs=3"])
    assert cfg.train.max_steps is None and cfg.train.epochs == 3


def test_override_values_parse_as_yaml() -> None:
    assert parse_override("model.hidden=[32, 16]") == ("model.hidden", [32, 16])
    assert parse_override("optim.lr=1e-3") == ("optim.lr", pytest.approx(1e-3))
    assert parse_override("data.val=null") == ("data.val", None)
    assert parse_override("experiment=abc") == ("experiment", "abc")


def test_resolved_config_round_trips_and_flattens() -> None:
    cfg = load_config(None, ["model.hidden=[32]"])
    again = load_config(None, [])
    assert again != cfg
    tree = to_dict(cfg)
    assert tree["model"]["hidden"] == [32]
    flat = flatten(tree)
    assert flat["optim.lr"] == cfg.optim.lr and flat["model.hidden"] == [32]
    from orchestrator.config import config_from_dict

    assert config_from_dict(tree) == cfg  # what crosses into workers rebuilds the same tree


def test_user_entrypoint_options_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_models.py").write_text(
        "import torch\n"
        "def build(in_features, num_classes, width=8):\n"
        "    return torch.nn.Linear(in_features, num_classes)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ["model.entrypoint=my_models:build", "model.width=4"])
    assert cfg.model.kwargs == {"width": 4}
    check_model_options(cfg.model)
    with pytest.raises(ConfigError, match="takes no option 'depth'"):
        check_model_options(load_config(None, ["model.entrypoint=my_models:build", "model.depth=4"]).model)
    with pytest.raises(ConfigError, match="has no callable 'nope'"):
        check_model_options(load_config(None, ["model.entrypoint=my_models:nope"]).model)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.hiden=[8]"], "config key 'model.hiden': model 'mlp' takes no option 'hiden' (did you mean 'hidden'?)"),
        (["model.name=mlpp"], "config key 'model.name': unknown model 'mlpp' (did you mean 'mlp'?)"),
        (["model.entrypoint=no_such_module:build"],
         "config key 'model.entrypoint': entrypoint 'no_such_module:build': cannot import"),
    ],
)
def test_model_options_are_checked_by_the_driver(overrides: list[str], message: str) -> None:
    # The config loads without importing the model zoo; the driver checks the model before taking any resource.
    config = load_config(None, overrides)
    with pytest.raises(ConfigError) as info:
        check_model_options(config.model)
    assert message in str(info.value)


def test_tracking_uri_falls_back_to_environment_then_local_sqlite(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    from orchestrator.tracking.uri import resolve_uri

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_uri(None) == f"sqlite:///{tmp_path}/mlruns.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    assert resolve_uri(None) == "http://mlflow.internal:5000"
    assert resolve_uri("sqlite:////abs/x.db") == "sqlite:////abs/x.db"  # the config wins


def test_one_split_of_the_global_batch() -> None:
    from orchestrator.config.batching import common_micro_batch, split_batch

    assert split_batch(256, 2) == (128, 1)
    assert split_batch(256, 2, accum=4) == (32, 4)
    assert split_batch(256, 2, micro=32) == (32, 4)
    assert split_batch(256, 2, micro=32, accum=4) == (32, 4)
    for args, message in [((100, 3), "not divisible by scaling.num_workers=3"),
                          ((128, 2, 48), "must equal micro_batch_size=48"),
                          ((128, 2, 32, 3), "must equal micro_batch_size=32 x grad_accum_steps=3 x num_workers=2"),
                          ((128, 2, None, 3), "not divisible by grad_accum_steps=3")]:
        with pytest.raises(ValueError, match=message):
            split_batch(*args)
    # A micro-batch set alone beside a config's accumulation (examples/digits.yaml's 1): the refusal says the fix.
    with pytest.raises(ValueError, match=r"must equal micro_batch_size=8 x grad_accum_steps=1 x num_workers=2: set "
                                         r"train.grad_accum_steps=8, or null to derive it"):
        split_batch(128, 2, micro=8, accum=1)
    with pytest.raises(ValueError, match=r"micro_batch_size=48 does not divide the 64 rows each of the 2 workers "
                                         r"takes a step: pick one that does \(1, 2, 4, 8, 16, 32, 64\)"):
        split_batch(128, 2, micro=48)
    assert common_micro_batch(120, range(2, 4)) == 20
