"""Reliability in-process (no Ray): non-finite steps skipped and budgeted, complete-or-invisible checkpoints and
the fallback past an incomplete one, the data position after a resize, drain checkpoints, elastic batch config."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
from test_loop import Recorder, batches, config, dataset, make_parts

from orchestrator.config import load_config
from orchestrator.errors import ConfigError
from orchestrator.training.cadence import Notices
from orchestrator.training.checkpoint import MANIFEST, STATE_FILE, check_complete, load_state, restore, save_state
from orchestrator.training.loop import Data, NonFiniteLossError, run
from orchestrator.training.optim import lr_factor
from orchestrator.training.step import train_step


class NanOnce(torch.nn.Module):
    """Returns NaN logits on its `at`-th training forward."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.net = torch.nn.Linear(16, 4)
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if self.training:
            self.calls += 1
            if self.calls == self.at:
                return out * float("nan")
        return out


def test_a_nan_batch_is_skipped_counted_and_never_reaches_the_weights() -> None:
    cfg = config("train.max_steps=6", "train.log_every=3", "checkpoint.every=3")
    parts = make_parts(cfg)
    # The loop counts FLOPs with one forward first: the 3rd forward is step 2's.
    parts.model = NanOnce(at=3)
    parts.optimizer = torch.optim.SGD(parts.model.parameters(), lr=0.1)
    parts.scheduler = torch.optim.lr_scheduler.LambdaLR(parts.optimizer, lambda step: 1.0)
    before = copy.deepcopy(parts.model.state_dict())
    report = Recorder()
    x, y = dataset(64)
    run(cfg, parts, Data(lambda epoch: batches(x, y, 32)), report)
    metrics = [m for m, _ in report.reports]
    assert [m["nonfinite_skipped"] for m in metrics] == [1, 1]
    assert all(torch.isfinite(torch.tensor(m["train_loss"])) for m in metrics)
    final = report.reports[-1][1]
    assert final is not None and final["progress"]["nonfinite_skipped"] == 1 and final["progress"]["step"] == 6
    assert all(torch.isfinite(v).all() for v in final["model"].values())
    assert not torch.equal(before["net.weight"], final["model"]["net.weight"])


def test_the_non_finite_budget_stops_the_run_with_a_clear_error() -> None:
    cfg = config("train.max_steps=6", "train.log_every=3", "train.max_nonfinite_steps=2")
    parts = make_parts(cfg)
    x, y = dataset(64)
    x[0, 0] = float("nan")  # in the first batch of every epoch: steps 1, 3, 5
    with pytest.raises(NonFiniteLossError, match=r"3 steps .* more than train.max_nonfinite_steps=2"):
        run(cfg, parts, Data(lambda epoch: batches(x, y, 32)), Recorder())


def test_non_finite_weights_are_never_checkpointed() -> None:
    cfg = config("train.max_steps=4", "train.log_every=2", "checkpoint.every=2")
    parts = make_parts(cfg)
    with torch.no_grad():
        next(parts.model.parameters())[0, 0] = float("inf")
    report = Recorder()
    x, y = dataset(64)
    with pytest.raises(NonFiniteLossError):
        run(cfg, parts, Data(lambda epoch: batches(x, y, 32)), report)
    assert all(ckpt is None for _, ckpt in report.reports)


def write_checkpoint(root: Path, step: int) -> Path:
    directory = root / f"checkpoint_{step:08d}_abcdef"
    directory.mkdir(parents=True)
    save_state(directory, {"progress": {"step": step}, "model": {"w": torch.full((256,), float(step))}})
    return directory


def test_a_checkpoint_is_complete_only_with_its_manifest_and_every_byte(tmp_path: Path) -> None:
    fs = pafs.LocalFileSystem()
    good = write_checkpoint(tmp_path, 5)
    assert check_complete(fs, str(good)) is None
    assert not list(good.glob(".*"))  # no temporary files left
    truncated = write_checkpoint(tmp_path, 10)
    data = (truncated / STATE_FILE).read_bytes()
    (truncated / STATE_FILE).write_bytes(data[: len(data) // 2])  # a copy cut off by a kill
    assert "state.pt has" in (check_complete(fs, str(truncated)) or "")
    unfinished = write_checkpoint(tmp_path, 15)
    (unfinished / MANIFEST).unlink()  # killed before the manifest, which is written last
    assert "no readable manifest" in (check_complete(fs, str(unfinished)) or "")


def test_an_incomplete_latest_checkpoint_falls_back_to_the_previous_complete_one(tmp_path: Path) -> None:
    import ray.train

    from orchestrator.training.resume import loadable_checkpoint

    write_checkpoint(tmp_path, 5)
    write_checkpoint(tmp_path, 10)
    latest = write_checkpoint(tmp_path, 15)
    (latest / STATE_FILE).write_bytes(b"\0" * 10)
    write_checkpoint(tmp_path, 20)  # complete but not the one Ray registered: never a fallback for an older one
    with pytest.warns(UserWarning, match="resuming from step 10"):
        chosen = loadable_checkpoint(ray.train.Checkpoint(str(latest)))
    assert chosen is not None and load_state(chosen.path)["progress"]["step"] == 10
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loadable_checkpoint(ray.train.Checkpoint(str(tmp_path / "checkpoint_00000005_abcdef"))) is not None


def test_only_our_never_registered_checkpoint_dirs_are_left_over(tmp_path: Path) -> None:
    from orchestrator.training.resume import unregistered_checkpoints

    kept = [write_checkpoint(tmp_path, step) for step in (10, 20)]
    orphan = write_checkpoint(tmp_path, 15)
    for other in ("checkpoint_manager_snapshot.json", "checkpoint_tmp_x", "notes"):
        (tmp_path / other).mkdir()  # Ray's and the user's own entries are not ours to delete
    fs = pafs.LocalFileSystem()
    assert unregistered_checkpoints(fs, str(tmp_path), [str(p) for p in kept]) == [str(orphan)]
    assert unregistered_checkpoints(fs, str(tmp_path), [str(p) + "/" for p in [*kept, orphan]]) == []
    assert unregistered_checkpoints(fs, str(tmp_path / "missing"), []) == []


def test_resume_after_a_resize_continues_at_the_next_epoch_boundary() -> None:
    cfg = config("train.max_steps=8", "train.log_every=3", "checkpoint.every=3")  # an 8-step schedule
    short = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": 3})})
    report = Recorder()
    x, y = dataset(256)
    run(short, make_parts(cfg), Data(lambda epoch: batches(x, y, 32)), report)
    state = report.reports[-1][1]
    assert state is not None
    same = restore(make_parts(cfg), copy.deepcopy(state))
    assert (same.epoch, same.rows_in_epoch) == (0, 96)  # same world size: exact position
    state["rng"] = state["rng"] * 2  # written by a 2-worker group, loaded by 1
    parts = make_parts(cfg)
    resized = restore(parts, state)
    assert (resized.step, resized.epoch, resized.rows_in_epoch) == (3, 1, 0)
    # The LR schedule is indexed by optimizer steps at a fixed global batch: the next step runs at step 3's LR and
    # leaves step 4's, as in the run that was not resized.
    train_step(parts, batches(x, y, 32)[:1])
    assert parts.optimizer.param_groups[0]["lr"] == pytest.approx(cfg.optim.lr * lr_factor(4, cfg.optim, 8))


def test_a_drain_notice_checkpoints_every_report_until_its_deadline() -> None:
    """The notice holds from the second report to the fourth (its deadline passed, the node still there): each of
    those reports saves, so a node lost at any moment loses at most one report interval; the first is marked as
    the drain's, and after the deadline the cadence is the configured one again."""
    cfg = config("train.max_steps=12", "train.log_every=2", "checkpoint.every=12")
    calls: list[int] = []

    def preempted() -> bool:
        calls.append(1)
        return 2 <= len(calls) <= 4

    report = Recorder()
    x, y = dataset(384)
    run(cfg, make_parts(cfg), Data(lambda epoch: batches(x, y, 32)), report, notices=Notices(preempted))
    saved = [(m["step"], m.get("drain_checkpoint")) for m, ckpt in report.reports if ckpt is not None]
    assert saved == [(4, 1), (6, None), (8, None), (12, None)]
    assert len(calls) == 6  # asked at every report step


@pytest.mark.parametrize(("workers", "micro", "accum"), [("[1,2]", 64, 1), ("[2,3]", 20, 2), ("[1,4]", 10, 3)])
def test_elastic_groups_keep_the_global_batch_at_every_size(workers: str, micro: int, accum: int) -> None:
    global_batch = {"[1,2]": 128, "[2,3]": 120, "[1,4]": 120}[workers]
    cfg = load_config(None, [f"scaling.num_workers={workers}", f"train.global_batch_size={global_batch}"])
    assert (cfg.train.micro_batch_size, cfg.train.grad_accum_steps) == (micro, accum)
    for world in cfg.scaling.world_sizes:
        assert global_batch % (micro * world) == 0


@pytest.mark.parametrize(("overrides", "message"), [
    (["scaling.num_workers=[2,3]", "train.global_batch_size=128"], "not divisible by scaling.num_workers=3"),
    (["scaling.num_workers=[3,2]"], "1 <= min <= max"),
    (["scaling.num_workers=[0,2]"], "1 <= min <= max"),
    (["scaling.num_workers=[1,2,3]"], "give a count or \\[min, max\\]"),
    (["scaling.resize_check_s=5"], "no effect with a fixed num_workers"),
    (["scaling.num_workers=[1,2]", "train.global_batch_size=96", "train.micro_batch_size=64"],
     "not a multiple of micro_batch_size=64"),
    (["scaling.num_workers=[1,2]", "train.global_batch_size=128", "train.grad_accum_steps=4"],
     "derived for each world size"),
])
def test_elastic_config_errors_name_the_key_and_the_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)



def test_a_time_cadence_adds_checkpoints_at_report_steps_only() -> None:
    x, y = dataset(256)

    def saved_steps(*overrides: str) -> list[int]:
        cfg = config("train.max_steps=8", "train.log_every=2", "checkpoint.every=8", *overrides)
        report = Recorder()
        run(cfg, make_parts(cfg), Data(lambda epoch: batches(x, y, 32)), report)
        return [m["step"] for m, ckpt in report.reports if ckpt is not None]

    assert saved_steps() == [8]
    assert saved_steps("checkpoint.every_minutes=1e-9") == [2, 4, 6, 8]  # always due: every report saves
    assert saved_steps("checkpoint.every_minutes=60") == [8]


def test_a_drain_notice_holds_until_its_deadline_in_milliseconds() -> None:
    from ray.train import PreemptionInfo

    from orchestrator.training.worker import notice_holds

    now = 1_700_000_000.0
    node = {"node-a": [1]}
    assert not notice_holds(None, now)
    assert notice_holds(PreemptionInfo(deadline_ms=int(now * 1000) + 500, preempted_node_to_ranks=node), now)
    assert not notice_holds(PreemptionInfo(deadline_ms=int(now * 1000) - 1, preempted_node_to_ranks=node), now)
    assert notice_holds(PreemptionInfo(deadline_ms=None, preempted_node_to_ranks=node), now)  # no deadline given
