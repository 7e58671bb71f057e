"""Search spaces without Ray: parsing, the checks that run before any trial, trial configs, best.yaml, the table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrator.config import TASK_KINDS, Config, load_config
from orchestrator.config.space import Domain
from orchestrator.errors import ConfigError
from orchestrator.models.tasks import Classification
from orchestrator.tuning.search import (
    TRAIN_METRICS,
    check_capacity,
    check_study,
    max_concurrent,
    to_tune,
    trial_config,
    user_tree,
    val_metrics,
    widest_trial,
)
from orchestrator.tuning.trial import in_trial_process, trial_resources
from orchestrator.tuning.trials import format_table, trial_status

LR = "tune.space.optim.lr.loguniform=[1e-4, 1e-1]"


def study(*overrides: str) -> Any:
    return load_config(None, ["train.max_steps=100", *overrides])


def test_space_in_both_spellings_parses_to_dotted_keys() -> None:
    nested = study(LR, "tune.space.optim.warmup_steps.choice=[0, 20, 50]")
    dotted = study("tune.space={optim.lr: {loguniform: [1.0e-4, 0.1]}, optim.warmup_steps: {choice: [0, 20, 50]}}")
    assert nested.tune.space == dotted.tune.space == {
        "optim.lr": {"loguniform": [0.0001, 0.1]}, "optim.warmup_steps": {"choice": [0, 20, 50]}}
    # YAML 1.1 reads 1e-3 as a string: numbers in lists too, names left alone.
    listed = study("tune.space.optim.lr.grid=[1e-3, 3e-2]", "tune.space.optim.name.choice=[adamw, sgd]")
    assert listed.tune.space == {"optim.lr": {"grid": [0.001, 0.03]}, "optim.name": {"choice": ["adamw", "sgd"]}}


@pytest.mark.parametrize(("override", "message"), [
    ("tune.space.optim.lrr.loguniform=[1e-4, 1e-1]", "'optim.lrr' is not a config key (did you mean 'optim.lr'?)"),
    ("tune.space.optimm.lr.loguniform=[1e-4, 1e-1]", "'optimm.lr' is not a config key (did you mean 'optim'?)"),
    ("tune.space.optim.lr.loguniform=[1e-1, 1e-4]", "range [0.1, 0.0001] is empty or inverted"),
    ("tune.space.optim.lr.uniform=[0.1, 0.1]", "is empty or inverted"),
    ("tune.space.optim.lr.uniform=[]", "needs a non-empty list"),
    ("tune.space.optim.warmup_steps.choice=[]", "needs a non-empty list"),
    ("tune.space.optim.lr.loguniform=[0, 0.1]", "loguniform needs low > 0"),
    ("tune.space.optim.warmup_steps.randint=[0, 2.5]", "randint needs integer bounds"),
    ("tune.space={optim.lr: 0.1}", "must be one of"),
    ("tune.space.optim.lr.between=[1, 2]", "'optim.lr' is a value, not a section (a search space is {kind: [..]}"),
    ("tune.space.storage.path.choice=[a, b]", "shared by the whole study"),
    ("tune.space.optim.choice=[1]", "is a section"),
])
def test_bad_space_is_one_clear_line_at_load(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        study(override)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("overrides", "message"), [
    ([], "tune.space is empty"),
    ([LR, "tune.metric=val_acc"], "never reported by the training loop (did you mean 'tune.metric=val_accuracy'?)"),
    ([LR, "data.val=null"], "only reported with a validation split: set data.val"),
    ([LR, "tune.grace_period=100"], "ASHA could never stop a trial early"),
    (["tune.space.train.max_steps.choice=[50, 100]"], "ASHA's budget is the training length"),
    (["tune.space.optim.warmup_steps.choice=[-5, 20]"], "optim.warmup_steps=-5 would be invalid"),
    (["tune.space.model.hiden.choice=[[64], [128]]"], "takes no option 'hiden' (did you mean 'hidden'?)"),
    (["tune.space.scaling.num_workers.choice=[1, 3]", "train.global_batch_size=64"], "not divisible"),
    (["tune.space.optim.lr.grid=[0.01, 0.1]", "tune.searcher=optuna"], "only the random searcher expands"),
])
def test_bad_study_is_refused_before_any_trial(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_study(study(*overrides))
    assert message in str(info.value)


def test_dead_asha_option_is_refused_and_a_saved_config_loads_again() -> None:
    from orchestrator.config import config_from_dict, to_dict

    with pytest.raises(ConfigError, match="tune.grace_period has no effect with tune.scheduler=fifo"):
        study(LR, "tune.scheduler=fifo", "tune.grace_period=10")
    for scheduler in ("fifo", "asha"):
        cfg = study(LR, f"tune.scheduler={scheduler}")
        assert config_from_dict(to_dict(cfg)) == cfg  # what resolve_for_data and saved config.yaml do
    assert study(LR).tune.asha == (50, 3.0)


def test_good_study_passes_and_mode_follows_the_metric() -> None:
    from orchestrator.tuning.search import resolved_mode

    cfg = study(LR, "tune.space.model.hidden.choice=[[64], [128, 128]]")
    check_study(cfg)
    assert resolved_mode(cfg) == "max"
    assert resolved_mode(study(LR, "tune.metric=val_loss")) == "min"
    assert resolved_mode(study(LR, "tune.metric=val_loss", "tune.mode=max")) == "max"


def test_domains_map_to_tune_with_inclusive_randint() -> None:
    pytest.importorskip("ray.tune")
    lr = to_tune(Domain("loguniform", (1e-4, 1e-1)))
    assert (lr.lower, lr.upper) == (1e-4, 1e-1)
    warm = to_tune(Domain("randint", (0, 50)))
    assert (warm.lower, warm.upper) == (0, 51)
    assert to_tune(Domain("grid", (1, 2))) == {"grid_search": [1, 2]}


def test_trial_config_rederives_batch_for_a_searched_worker_count() -> None:
    base = study(LR, "scaling.num_workers=2", "train.global_batch_size=128")
    assert base.train.micro_batch_size == 64
    trial = trial_config(user_tree(base), {"scaling.num_workers": 4, "optim.lr": 0.02})
    assert trial.train.micro_batch_size == 32 and trial.optim.lr == 0.02
    assert base.optim.lr != 0.02  # the base config is untouched


@pytest.mark.parametrize(("overrides", "message"), [
    (["tune.scheduler=fifo", "tune.space.optim.warmup_steps.choice=[0, 50]"],
     "tune.space.optim.warmup_steps: a trial with optim.warmup_steps=50 would be invalid (config key "
     "'optim.warmup_steps': optim.warmup_steps=50 must be below the run's 12 optimizer steps"),
    ([LR], "tune.grace_period=50 is not below the run's 12 optimizer steps (train.epochs=1)"),
    (["tune.scheduler=fifo", "tune.space.cost.node_type.choice=[gpu_spot, gpu_b300]"],
     "tune.space.cost.node_type: a trial with cost.node_type='gpu_b300' would be invalid (cost.node_type=gpu_b300 "
     "is not in the aws price table"),
])
def test_what_the_data_decides_is_checked_for_every_trial_before_any_starts(overrides: list[str],
                                                                            message: str) -> None:
    """With epochs, steps are known only with the data: each searched extreme is resolved and priced up front."""
    from orchestrator.run.checks import resolve_for_data
    from orchestrator.tuning.plan import TrialPlanner, check_trials
    from pipelines.sources import DatasetInfo

    infos = {"train": DatasetInfo("train", [], num_rows=1438, num_bytes=0, feature_dim=64, num_classes=10)}
    cfg = load_config(None, ["train.epochs=1", "optim.warmup_steps=5", "scaling.use_gpu=true", *overrides])
    check_study(cfg)  # nothing to see without the data
    with pytest.raises(ConfigError) as info:
        check_trials(cfg, resolve_for_data(cfg, infos), TrialPlanner(user_tree(cfg), infos))
    assert message in str(info.value)
    fine = load_config(None, ["train.epochs=1", "optim.warmup_steps=5", "tune.grace_period=4", LR])
    check_trials(fine, resolve_for_data(fine, infos), TrialPlanner(user_tree(fine), infos))


def test_best_yaml_loads_unchanged_with_the_best_values(tmp_path: Path) -> None:
    from orchestrator.tuning.results import best_yaml

    base = study(LR, "tune.space.optim.warmup_steps.choice=[0, 20]", "scaling.num_workers=1", "model.hidden=[32]")
    path = tmp_path / "best.yaml"
    path.write_text(best_yaml(user_tree(base), {"optim.lr": 0.0123, "optim.warmup_steps": 20}, "# best\n"))
    text = path.read_text()
    assert text.startswith("# best\n") and "tune:" not in text
    loaded = load_config(path)
    assert loaded.optim.lr == 0.0123 and loaded.optim.warmup_steps == 20
    assert loaded.model.kwargs == {"hidden": [32]} and loaded.train.max_steps == 100
    assert loaded.tune.space == {}  # nothing tune-only left: `orchestrator train` takes it as is


def test_best_yaml_trains_at_an_ordinary_runs_cadence_not_the_studys(tmp_path: Path) -> None:
    """A study reports and evaluates often (ASHA compares trials at every report); retraining the winner at that
    cadence would spend most of its time evaluating. What the study searched stays as the best trial had it."""
    from orchestrator.config.train import TrainConfig
    from orchestrator.tuning.results import best_yaml

    base = study(LR, "train.log_every=10", "train.eval_every=10", "train.max_steps=40", "checkpoint.every=20")
    path = tmp_path / "best.yaml"
    path.write_text(best_yaml(user_tree(base), {"optim.lr": 0.0123}))
    loaded = load_config(path)
    ordinary = TrainConfig.model_fields
    assert (loaded.train.log_every, loaded.train.eval_every) == (ordinary["log_every"].default,
                                                                 ordinary["eval_every"].default) == (25, 100)
    assert loaded.train.max_steps == 40 and loaded.checkpoint.every == 20 and loaded.optim.lr == 0.0123
    searched = study(LR, "tune.space.train.eval_every.choice=[5, 10]", "train.log_every=5")
    path.write_text(best_yaml(user_tree(searched), {"optim.lr": 0.0123, "train.eval_every": 5}))
    assert load_config(path).train.eval_every == 5


def test_concurrency_and_capacity_follow_the_widest_trial() -> None:
    cfg = study(LR, "scaling.num_workers=2", "train.global_batch_size=128")
    assert max_concurrent(cfg, {"CPU": 9.0}).trials == 4  # one CPU kept for Ray Data's read tasks
    assert max_concurrent(cfg, {"CPU": 2.0}).trials == 1
    assert max_concurrent(study(LR, "tune.max_concurrent_trials=3"), {"CPU": 64.0}).trials == 3
    wide = study(LR, "tune.space.scaling.num_workers.choice=[1, 8]", "train.global_batch_size=128")
    assert max_concurrent(widest_trial(wide), {"CPU": 17.0}).trials == 2
    check_capacity(widest_trial(wide), {"CPU": 8.0})
    with pytest.raises(ConfigError, match=r"a trial needs 8 CPUs .* the Ray cluster has 4"):
        check_capacity(widest_trial(wide), {"CPU": 4.0})
    with pytest.raises(ConfigError, match="needs 2 GPUs"):
        check_capacity(study(LR, "scaling.num_workers=2", "scaling.use_gpu=true"), {"CPU": 16.0, "GPU": 1.0})
    typed = study(LR, "scaling.num_workers=2", "scaling.use_gpu=true", "scaling.accelerator_type=H100")
    check_capacity(typed, {"CPU": 16.0, "GPU": 8.0, "accelerator_type:H100": 1.0})
    with pytest.raises(ConfigError, match=r"needs H100 GPUs \(scaling.accelerator_type\) but the Ray cluster has A100"):
        check_capacity(typed, {"CPU": 16.0, "GPU": 8.0, "accelerator_type:A100": 1.0})


@pytest.mark.parametrize("overrides", [
    ["scaling.num_workers=1"], ["scaling.num_workers=1", "scaling.cpus_per_worker=2"],
    ["scaling.num_workers=1", "scaling.use_gpu=true", "scaling.cpus_per_worker=3"],
])
def test_a_trial_that_trains_in_its_own_process_holds_its_one_workers_share(overrides: list[str]) -> None:
    """What Tune reserves for a one-worker trial is what its one worker would hold, so the cluster fits as many of
    them at once as max_concurrent counts (one CPU kept for Ray Data); a wider trial's actor holds next to nothing
    beside the workers of its Ray Train run."""
    cfg = study(LR, "train.global_batch_size=128", *overrides)
    held = trial_resources(cfg)
    assert in_trial_process(cfg) and held["CPU"] == cfg.scaling.cpus_per_worker
    assert held.get("GPU", 0.0) == (1.0 if cfg.scaling.use_gpu else 0.0)
    cluster = {"CPU": 13.0, "GPU": 8.0}
    fits = min(int((cluster[k] - (1 if k == "CPU" else 0)) // v) for k, v in held.items())
    assert max_concurrent(cfg, cluster).trials == fits
    wide = study(LR, "train.global_batch_size=128", "scaling.num_workers=2")
    assert not in_trial_process(wide) and trial_resources(wide) == {"CPU": 0.01}
    assert not in_trial_process(study(LR, "train.global_batch_size=128", "scaling.num_workers=[1, 2]"))
    # Sharded checkpoints are written through Ray Train's reporting: a one-worker fsdp trial keeps its Train run.
    assert not in_trial_process(study(LR, "train.global_batch_size=128", "scaling.num_workers=1",
                                      "train.parallel=fsdp"))


def at_once(overrides: list[str], resources: dict[str, float]) -> tuple[int, str]:
    found = max_concurrent(widest_trial(study(LR, "train.global_batch_size=128", *overrides)), resources)
    return found.trials, found.bound


@pytest.mark.parametrize(("overrides", "resources", "trials", "bound"), [
    # One GPU per worker (Ray's ScalingConfig with use_gpu): 2 GPUs hold 2 one-worker trials, not 31.
    (["scaling.num_workers=1", "scaling.use_gpu=true"], {"CPU": 32.0, "GPU": 2.0}, 2, "GPUs"),
    (["scaling.num_workers=2", "scaling.use_gpu=true"], {"CPU": 32.0, "GPU": 4.0}, 2, "GPUs"),
    (["scaling.num_workers=2", "scaling.use_gpu=true"], {"CPU": 32.0, "GPU": 5.0}, 2, "GPUs"),
    # Elastic and searched worker counts: sized for the largest group, as the CPUs are (each trial can grow).
    (["scaling.num_workers=[1, 2]", "scaling.use_gpu=true"], {"CPU": 32.0, "GPU": 4.0}, 2, "GPUs"),
    (["tune.space.scaling.num_workers.choice=[1, 4]", "scaling.use_gpu=true"], {"CPU": 32.0, "GPU": 8.0}, 2, "GPUs"),
    # The workers' CPUs still count on a GPU cluster (one kept for Ray Data's read tasks).
    (["scaling.num_workers=1", "scaling.use_gpu=true", "scaling.cpus_per_worker=4"], {"CPU": 9.0, "GPU": 8.0},
     2, "CPUs"),
    (["scaling.num_workers=1"], {"CPU": 32.0, "GPU": 2.0}, 31, "CPUs"),  # no GPUs asked for: CPU-bound as before
    (["scaling.num_workers=1", "scaling.use_gpu=true"], {"CPU": 32.0}, 1, "GPUs"),  # never below one
    (["scaling.num_workers=1", "scaling.use_gpu=true", "tune.max_concurrent_trials=1"], {"CPU": 32.0, "GPU": 2.0},
     1, "tune.max_concurrent_trials"),
    (["scaling.num_workers=1", "scaling.use_gpu=true", "tune.max_concurrent_trials=8"], {"CPU": 32.0, "GPU": 2.0},
     2, "GPUs"),
])
def test_trials_at_once_are_bounded_by_the_gpus_too(overrides: list[str], resources: dict[str, float],
                                                     trials: int, bound: str) -> None:
    found, why = at_once(overrides, resources)
    assert found == trials, why
    assert why.startswith(bound), why


def test_metric_list_matches_what_the_loop_reports() -> None:
    """tune.metric may only name what loop.py reports: fails if the loop stops reporting a listed key."""
    from orchestrator.models.zoo import build_model
    from orchestrator.training.loop import Data, run
    from orchestrator.training.optim import build_optimizer
    from orchestrator.training.parts import Parts
    from orchestrator.training.precision import Precision

    class Recorder:
        def __init__(self) -> None:
            self.reports: list[tuple[dict[str, Any], None]] = []

        def publish(self, metrics: dict[str, Any]) -> None:
            self.reports.append((metrics, None))

        def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
            pass

    cfg = load_config(None, ["scaling.num_workers=1", "train.global_batch_size=16", "train.max_steps=4",
                             "train.log_every=2", "train.eval_every=4", "model.hidden=[8]", "train.precision=fp32",
                             "optim.warmup_steps=1"])
    cpu = torch.device("cpu")
    model = build_model("mlp", None, 4, 10, {"hidden": [8]})
    optimizer, scheduler = build_optimizer(model, cfg.optim, 4)
    parts = Parts(model, optimizer, scheduler, Precision("fp32", cpu), cpu, 1.0, task=Classification(10))
    x, y = torch.randn(64, 4), torch.randint(0, 10, (64,))
    data = [{"x": x[i:i + 16], "labels": y[i:i + 16]} for i in range(0, 64, 16)]
    VAL_METRICS = val_metrics(cfg)  # noqa: N806
    recorder = Recorder()
    run(cfg, parts, Data(lambda epoch: data, lambda: data), recorder)
    reports = [metrics for metrics, _ in recorder.reports]
    # Subsets: a new loop metric is only searchable once listed; a listed metric must really be reported.
    assert set(TRAIN_METRICS) <= set(reports[0]) and not set(VAL_METRICS) & set(reports[0])
    assert set(TRAIN_METRICS + VAL_METRICS) <= set(reports[-1])


def test_trial_status_and_table() -> None:
    assert trial_status({"done": True, "step": 40}, 40) == "completed"
    assert trial_status({"done": True, "step": 10}, 40) == "stopped"
    assert trial_status({"step": 10}, 40) == "running"
    assert trial_status({}, 40, errored=True) == "error"
    table = format_table([{"trial_id": "a_00000", "status": "stopped", "params": {"optim.lr": 0.00012},
                           "step": 10, "metric": 0.5}], ["optim.lr"], "val_accuracy")
    header, row = table.splitlines()
    assert header.split() == ["trial", "status", "optim.lr", "step", "val_accuracy"]
    assert row.split() == ["a_00000", "stopped", "1.20e-04", "10", "0.5000"]


def test_only_driver_modules_import_ray_tune() -> None:
    import ast

    root = Path(__file__).resolve().parents[3] / "orchestrator"
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "ray.tune" or n.startswith("ray.tune.") for n in names):
                found.add(path.relative_to(root).as_posix())
    assert found and all(p.startswith("tuning/") for p in found), found


def test_cli_tune_refuses_bad_input_with_one_line() -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-m", "orchestrator", "tune", "--config", "examples/digits-tune.yaml",
                          "--set", "tune.metric=val_acc"], capture_output=True, text=True, cwd=root, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: tune.metric=val_acc is never reported by the training loop (did you mean "
        "'tune.metric=val_accuracy'?); reported: " + ", ".join(TRAIN_METRICS + TASK_KINDS["classification"].metrics)]


def test_trials_are_named_by_their_searched_values_short_and_filesystem_safe() -> None:
    from orchestrator.tuning.search import MAX_NAME, TrialNamer, short_keys

    cfg = study(LR, "tune.space.optim.warmup_steps.choice=[0, 10, 20]",
                "tune.space.model.hidden.choice=[[64], [128, 128]]", "tune.space.optim.name.choice=[adamw, sgd]")
    namer = TrialNamer.for_config(cfg)
    name = namer({"optim.lr": 0.0032134, "optim.warmup_steps": 20, "model.hidden": [128, 128], "optim.name": "sgd"})
    assert name == "lr=3.2e-03,warmup=20,name=sgd,hidden=128x128"  # in the order of tune.space
    # Log-scale keys are always scientific (names of one study line up); others keep 3 significant digits.
    assert namer({"optim.lr": 0.05, "optim.warmup_steps": 0}) == "lr=5.0e-02,warmup=0"
    uniform = TrialNamer.for_config(study("tune.space.optim.weight_decay.uniform=[0.0, 0.1]"))
    assert uniform({"optim.weight_decay": 0.0123456}) == "wd=0.0123"
    # Keys whose short forms clash keep their dotted form; nothing but [A-Za-z0-9._+-] in a value.
    assert short_keys(["optim.lr", "model.lr"]) == {"optim.lr": "optim.lr", "model.lr": "model.lr"}
    odd = TrialNamer((("model.act", "act"),))
    assert odd({"model.act": "a/b c:d"}) == "act=a-b-c-d"
    # A long name is cut, and keeps a hash of the whole so two long names still differ.
    wide = TrialNamer(tuple((f"model.k{i}", f"k{i}") for i in range(20)))
    one, two = wide({f"model.k{i}": 1000 + i for i in range(20)}), wide({f"model.k{i}": 2000 + i for i in range(20)})
    assert len(one) == MAX_NAME and one != two


def test_peak_concurrency_counts_overlapping_spans() -> None:
    from orchestrator.tuning.search import peak_concurrency

    assert peak_concurrency([]) == 0
    assert peak_concurrency([(0, 10), (1, 5), (2, 3)]) == 3
    assert peak_concurrency([(0, 10), (10, 20), (20, 30)]) == 1  # a trial starts as the one before ends
    assert peak_concurrency([(0, 10), (0, 10), (10, 20), (12, 30)]) == 2


def test_the_searcher_holds_the_study_to_its_concurrency() -> None:
    """TuneConfig.max_concurrent_trials is ignored beside a BasicVariantGenerator: the searcher carries it."""
    pytest.importorskip("ray.tune")
    from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter

    from orchestrator.tuning.study import _searcher

    random = _searcher(study(LR, "tune.seed=1"), 2)
    assert isinstance(random, BasicVariantGenerator) and random.max_concurrent == 2
    pytest.importorskip("optuna")
    optuna = _searcher(study(LR, "tune.searcher=optuna"), 3)
    assert isinstance(optuna, ConcurrencyLimiter) and optuna.max_concurrent == 3


def _trial(lr: float, warmup: Any, metric: float, status: str = "completed", name: str = "") -> Any:
    from orchestrator.tuning.results import TrialSummary

    return TrialSummary(trial_id=f"t_{lr}", params={"optim.lr": lr, "optim.warmup_steps": warmup}, status=status,
                        steps=40, metric=metric, name=name)


def test_sweep_plot_draws_a_choice_as_categories_and_a_range_on_a_colour_bar() -> None:
    from orchestrator.report.plots import sweep_figure

    keys = ["optim.lr", "optim.warmup_steps"]
    trials = [_trial(1e-3, 0, 0.5), _trial(3e-3, 20, 0.7, "stopped"), _trial(1e-2, 10, 0.9),
              _trial(3e-2, 20, 0.8)]
    fig = sweep_figure(trials, keys, "val_accuracy", categorical={"optim.warmup_steps"})
    assert len(fig.axes) == 1  # no colour bar
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["optim.warmup_steps=0", "optim.warmup_steps=10", "optim.warmup_steps=20", "ran to the end",
                      "stopped early"]
    continuous = [_trial(1e-3, 0.1, 0.5), _trial(3e-3, 0.05, 0.7, "stopped"), _trial(1e-2, 0.2, 0.9)]
    fig = sweep_figure(continuous, keys, "val_accuracy")
    assert len(fig.axes) == 2 and fig.axes[1].get_ylabel() == "optim.warmup_steps"  # the colour bar
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["ran to the end", "stopped early"]
    # Values that are not numbers are categories even when the searcher did not list them.
    named = [_trial(1e-3, "cosine", 0.5), _trial(3e-3, "linear", 0.7)]
    fig = sweep_figure(named, keys, "val_accuracy")
    assert len(fig.axes) == 1
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()][:2] == [
        "optim.warmup_steps=cosine", "optim.warmup_steps=linear"]


def test_curves_are_labelled_by_name_and_a_shared_name_gets_its_id() -> None:
    from orchestrator.report.plots import trial_labels

    trials = [_trial(1e-3, 0, 0.5, name="lr=1.0e-03,warmup=0"), _trial(2e-3, 0, 0.6, name="lr=2.0e-03,warmup=0"),
              _trial(2.01e-3, 0, 0.7, name="lr=2.0e-03,warmup=0"), _trial(5e-3, 0, 0.7)]
    assert trial_labels(trials) == ["lr=1.0e-03,warmup=0", "lr=2.0e-03,warmup=0 (t_0.002)",
                                    "lr=2.0e-03,warmup=0 (t_0.00201)", "t_0.005"]


def test_study_cost_line_shows_a_small_productive_share_with_what_took_the_time() -> None:
    from orchestrator.report.cost import Ledger, Pricing, study_metrics
    from orchestrator.tuning.results import study_cost_line

    pricing = Pricing(1, 2.0, "1 node at $2/h")
    ledgers = [Ledger(30.0, pricing, {"startup": 29.0, "compute": 0.06, "eval": 0.8, "other": 0.14}),
               Ledger(40.0, pricing, {"startup": 39.0, "compute": 0.08, "eval": 0.8, "other": 0.12})]
    line = study_cost_line(study_metrics(ledgers))
    assert line.startswith("study cost: $0.0389 over 2 trials, 0.0194 node-hours | productive 0.2% | start-up 97%"
                           " | eval 2.3%"), line
    assert "other" not in line  # under 0.5%
    unknown = study_cost_line({"cost/trials": 2.0, "cost/node_hours": 0.01})
    assert unknown.endswith("productive share unknown: no trial ran long enough to report its timings")


def test_a_study_shares_one_autopilot_search_unless_it_searches_what_the_search_depends_on() -> None:
    from orchestrator.tuning.autopilot import Board, chosen_config, per_trial_reason

    def study(*overrides: str) -> Config:
        return load_config(None, ["tune.space={optim.lr: {loguniform: [1.0e-4, 1.0e-1]}}", *overrides])

    assert per_trial_reason(study()) is None  # no autopilot: nothing to share
    assert per_trial_reason(study("autopilot.enabled=true")) is None  # lr: one search serves every trial
    for key in ("train.micro_batch_size", "model.hidden", "scaling.num_workers", "train.precision"):
        space = f"tune.space={{optim.lr: {{loguniform: [1.0e-4, 1.0e-1]}}, {key}: {{choice: [1, 2]}}}}"
        reason = per_trial_reason(study("autopilot.enabled=true", space))
        assert reason is not None and key in reason and "each trial searches its own" in reason

    # The board: the first trial to ask searches, the others wait; a searcher that ended without a choice hands the
    # search to the next one; once posted, every trial (the searcher too, when restarted) applies the choice.
    board = Board(None)
    assert board.ask("a") == ("search", None) and board.ask("b") == ("wait", None) and board.ask("a")[0] == "search"
    board.post("b", {"chosen": {"micro_batch_size": 1}})  # only the searcher posts
    board.release("b")
    assert board.ask("b") == ("wait", None)
    board.release("a")
    assert board.ask("b") == ("search", None)
    chosen = {"micro_batch_size": 32, "grad_accum_steps": 2, "compile": False, "torch_threads": 1,
              "flush_denormal": True, "precision": "fp32"}
    board.post("b", {"chosen": chosen})
    assert board.ask("a") == ("apply", chosen) == board.ask("b") and board.result()["trial_id"] == "b"
    applied = chosen_config(study("autopilot.enabled=true", "train.global_batch_size=64", "scaling.num_workers=1"),
                            chosen)
    assert not applied.autopilot.enabled
    assert {k: getattr(applied.train, k) for k in chosen} == chosen
