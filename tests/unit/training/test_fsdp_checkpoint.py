"""Sharded checkpoints of train.parallel=fsdp (training/checkpoint.py) in real gloo groups: every rank writes its own
DCP shards into the run's checkpoint directory, rank 0 commits it with the manifest once all are written. A resume
at the same world size continues bitwise (weights, optimizer, LR schedule, RNG, data position); at 1 and 3 ranks
the 2-rank checkpoint reshards and the run continues close to the uninterrupted one; a checkpoint whose write was
killed is never loaded (the previous one is)."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import ray.train
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gloo_world import run_ranks
from torch import nn

from orchestrator.config import OptimConfig
from orchestrator.training import fsdp
from orchestrator.training.checkpoint import (
    MANIFEST,
    Progress,
    ShardedSaver,
    check_complete,
    manifest_cache_decision,
    manifest_step,
    restore,
)
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision
from orchestrator.training.resume import checkpoint_dir_name, loadable_checkpoint, read_checkpoint

ROWS, FEATURES, CLASSES, SAVED_AT, STEPS = 12, 6, 5, 3, 6  # 12 rows: an even split over 1, 2 and 3 ranks
DECISION = "memory"
LOCAL = pafs.LocalFileSystem()


def parts(seed: int) -> Parts:
    """An MLP sharded per Linear (the 5-row head splits unevenly), AdamW with a warmup schedule: everything a resume
    must bring back differs from a fresh start."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, CLASSES))
    model = fsdp.shard_model(model, mesh=fsdp.mesh_of_all_ranks(torch.device("cpu")), blocks=["Linear"])
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=3e-2, warmup_steps=4), STEPS)
    torch.manual_seed(1000 * seed + dist.get_rank())  # each rank its own RNG stream (as dropout would draw)
    return Parts(model, optimizer, scheduler, Precision("fp32", torch.device("cpu")), torch.device("cpu"))


def step(p: Parts, progress: Progress) -> float:
    """One step on this rank's rows of the global batch for `progress.step`, with noise from the global torch RNG
    (as dropout or augmentation would draw), so a resume that lost the RNG streams would differ. Returns the global
    mean loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1000 + progress.step)
    x, y = torch.randn(ROWS, FEATURES, generator=g), torch.randint(0, CLASSES, (ROWS,), generator=g)
    share = ROWS // world
    x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    x = x + 1e-3 * torch.randn(x.shape)  # this rank's RNG stream
    loss = nn.functional.cross_entropy(p.model(x), y, reduction="sum")
    (loss * world / ROWS).backward()  # FSDP averages over ranks: a per-rank sum over the global count, times world
    fsdp.clip_grad_norm(p.model, 1.0)
    p.optimizer.step()
    p.scheduler.step()
    p.optimizer.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    dist.all_reduce(total)
    progress.step += 1
    progress.samples_seen += ROWS
    progress.rows_in_epoch += share
    progress.seen.add(torch.arange(rank * share, (rank + 1) * share) + ROWS * (progress.step - 1))  # the rows' ids
    return float(total) / ROWS


def train_to(p: Parts, progress: Progress, last: int) -> list[float]:
    losses = []
    while progress.step < last:
        losses.append(step(p, progress))
    return losses


def run_dir(shared: Path) -> Path:
    return shared.parent.parent / "run"  # the one run directory all groups share


def _uninterrupted(rank: int, shared: Path) -> dict[str, Any]:
    """Train to SAVED_AT, checkpoint (asynchronously: the next steps change the weights while it writes), go on to
    STEPS."""
    p, progress = parts(seed=0), Progress(cache_decision=DECISION)
    losses = train_to(p, progress, SAVED_AT)
    name = [checkpoint_dir_name(SAVED_AT) if rank == 0 else None]
    dist.broadcast_object_list(name)
    saver = ShardedSaver(asynchronous=True)
    pending = saver.save(LOCAL, str(run_dir(shared) / name[0]), p, progress, micro_batch_size=ROWS // 2)
    saved = {"weights": fsdp.full_state_dict(p.model), "progress": progress.saved(),
             "lr": p.optimizer.param_groups[0]["lr"]}
    losses += train_to(p, progress, STEPS)
    pending.commit()
    # checkpoint.upload=sync: written before save returns, into another run's directory.
    synced_path = shared.parent.parent / "sync" / f"checkpoint_{STEPS:08d}_000000"
    synced = ShardedSaver(asynchronous=False).save(LOCAL, str(synced_path), p, progress, micro_batch_size=ROWS // 2)
    assert synced.written is None
    synced.commit()
    saver.close()
    return {"losses": losses, "saved": saved, "final": fsdp.full_state_dict(p.model),
            "final_optimizer": fsdp.full_optimizer_state_dict(p.model, p.optimizer), "path": pending.path,
            "synced": synced.path}


def _killed_mid_write(rank: int, shared: Path) -> None:
    """Resume from the committed checkpoint, train on, and die (SIGKILL, every rank) while the next checkpoint is
    being written: after this rank's shard reached storage, before the checkpoint was committed."""
    p = parts(seed=5)
    first = next(run_dir(shared).glob("checkpoint_*"))
    progress = restore(p, read_checkpoint(ray.train.Checkpoint(str(first), filesystem=LOCAL)), DECISION)
    train_to(p, progress, STEPS)
    name = [checkpoint_dir_name(STEPS) if rank == 0 else None]
    dist.broadcast_object_list(name)
    path = run_dir(shared) / name[0]
    ShardedSaver(asynchronous=True).save(LOCAL, str(path), p, progress, micro_batch_size=ROWS // 2)
    deadline = time.monotonic() + 30
    while not (path / f"__{rank}_0.distcp").exists() and time.monotonic() < deadline:
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGKILL)


def _resumed(rank: int, shared: Path) -> dict[str, Any]:
    """A fresh group (other initial weights) resumes as a restarted worker does: from the newest complete
    checkpoint the registered one falls back to, its shared state read first (no collective), then restored; then
    trains to STEPS."""
    p = parts(seed=7)
    newest = sorted(run_dir(shared).glob("checkpoint_*"))[-1]
    chosen = loadable_checkpoint(ray.train.Checkpoint(str(newest), filesystem=LOCAL))
    assert chosen is not None
    state = read_checkpoint(chosen)
    read = {"micro_batch_size": state["micro_batch_size"], "ranks": len(state["rng"])}
    progress = restore(p, state, DECISION)
    restored = {"progress": progress.saved(), "weights": fsdp.full_state_dict(p.model), "read": read,
                "lr": p.optimizer.param_groups[0]["lr"], "seen": progress.seen.ids().tolist()}
    losses = train_to(p, progress, STEPS)
    return {"chosen": chosen.path, "restored": restored, "losses": losses, "final": fsdp.full_state_dict(p.model),
            "final_optimizer": fsdp.full_optimizer_state_dict(p.model, p.optimizer)}


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fsdp_ckpt")
    out: dict[str, Any] = {"run": root / "run", "uninterrupted": run_ranks(_uninterrupted, root / "a", 2)}
    with pytest.raises(AssertionError, match="signal SIGKILL"):
        run_ranks(_killed_mid_write, root / "killed", 2)
    out["killed"] = sorted((root / "run").glob("checkpoint_*"))[-1]
    for world in (2, 1, 3):
        out[world] = run_ranks(_resumed, root / f"resumed{world}", world)
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_rank_writes_its_shards_and_rank_0_commits_them_with_the_manifest(groups: dict[str, Any]) -> None:
    path = groups["uninterrupted"][0]["path"]
    names = sorted(p.name for p in Path(path).iterdir())
    assert names == sorted([".metadata", "__0_0.distcp", "__1_0.distcp", MANIFEST])
    assert check_complete(LOCAL, path) is None
    listed = json.loads((Path(path) / MANIFEST).read_text())["files"]  # DCP's metadata and every rank's shard
    assert listed == {name: (Path(path) / name).stat().st_size for name in names if name != MANIFEST}
    assert manifest_step(LOCAL, path) == SAVED_AT
    assert manifest_cache_decision(LOCAL, path) == DECISION
    # Each rank's file holds its own shard of every parameter (about half), not the whole model: DCP's metadata
    # says which file holds which chunk.
    metadata = dcp.FileSystemReader(path).read_metadata()
    elements = {"__0_0.distcp": 0, "__1_0.distcp": 0}
    for index, where in metadata.storage_data.items():
        if index.fqn.startswith("model."):
            chunk = metadata.state_dict_metadata[index.fqn].chunks[index.index]
            elements[where.relative_path] += math.prod(chunk.sizes)
    weights = groups["uninterrupted"][0]["final"]
    full, rows = sum(v.numel() for v in weights.values()), sum(v[0].numel() for v in weights.values())
    assert sum(elements.values()) == full
    assert all(full / 2 - rows <= n <= full / 2 + rows for n in elements.values()), (elements, full)


def test_a_checkpoint_killed_mid_write_is_never_loaded(groups: dict[str, Any]) -> None:
    killed, committed = str(groups["killed"]), groups["uninterrupted"][0]["path"]
    assert killed != committed and manifest_step(LOCAL, killed) is None  # its write began, never committed
    assert check_complete(LOCAL, killed) is not None
    for world in (2, 1, 3):
        assert [r["chosen"] for r in groups[world]] == [committed] * world


def test_resume_at_the_same_world_size_is_bitwise(groups: dict[str, Any]) -> None:
    ahead, resumed = groups["uninterrupted"], groups[2]
    saved = ahead[0]["saved"]
    for rank in (0, 1):
        assert resumed[rank]["restored"]["progress"] == saved["progress"]  # data position: rows of this epoch
        assert resumed[rank]["restored"]["lr"] == saved["lr"]
        assert resumed[rank]["restored"]["read"] == {"micro_batch_size": ROWS // 2, "ranks": 2}
        assert resumed[rank]["losses"] == ahead[rank]["losses"][SAVED_AT:]  # RNG streams: the same noise
    assert _equal(resumed[0]["restored"]["weights"], saved["weights"])
    assert _equal(resumed[0]["final"], ahead[0]["final"])
    a, b = resumed[0]["final_optimizer"], ahead[0]["final_optimizer"]
    assert a["state"].keys() == b["state"].keys() and a["state"]
    assert all(_equal(a["state"][k], b["state"][k]) for k in a["state"])
    # The comparison could fail: the checkpoint's weights are not the final ones.
    assert not _equal(saved["weights"], ahead[0]["final"])


@pytest.mark.parametrize("world", [1, 3])
def test_resume_at_another_world_size_reshards_and_continues(groups: dict[str, Any], world: int) -> None:
    ahead, resumed = groups["uninterrupted"][0], groups[world]
    saved = ahead["saved"]
    assert _equal(resumed[0]["restored"]["weights"], saved["weights"])  # every shard cut anew, nothing lost
    progress = resumed[0]["restored"]["progress"]
    # The old ranks' data positions describe another split: the interrupted epoch is finished as a rest pass, from
    # the ids of the rows every rank trained on, which the sharded checkpoint's shared state keeps.
    assert progress == saved["progress"] | {"epoch": 0, "rows_in_epoch": 0, "rest": True}
    assert sorted(resumed[0]["restored"]["seen"]) == list(range(ROWS * SAVED_AT))
    assert resumed[0]["restored"]["lr"] == saved["lr"]
    # New RNG streams (the noise differs) and another reduction order: close, not bitwise.
    assert resumed[0]["losses"] == pytest.approx(ahead["losses"][SAVED_AT:], rel=1e-3)
    assert resumed[0]["losses"] != ahead["losses"][SAVED_AT:]
    for key, value in ahead["final"].items():
        assert torch.allclose(resumed[0]["final"][key], value, atol=1e-3), key
    assert all(r["losses"] == resumed[0]["losses"] for r in resumed)


def test_a_damaged_shard_falls_back_to_the_previous_checkpoint(groups: dict[str, Any], tmp_path: Path) -> None:
    """A committed checkpoint whose shard storage lost bytes afterwards (or a write killed after the manifest):
    the manifest's sizes no longer match, and a resume picks the one before."""
    import shutil

    committed = Path(groups["uninterrupted"][0]["path"])
    older = tmp_path / committed.name
    newer = tmp_path / checkpoint_dir_name(SAVED_AT + 3)
    shutil.copytree(committed, older)
    shutil.copytree(committed, newer)
    shard = newer / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert check_complete(LOCAL, str(newer)) == f"__1_0.distcp has {shard.stat().st_size} of " \
                                                f"{shard.stat().st_size + 100} bytes"
    with pytest.warns(UserWarning, match="incomplete"):
        chosen = loadable_checkpoint(ray.train.Checkpoint(str(newer), filesystem=LOCAL))
    assert chosen is not None and chosen.path == str(older)


def test_a_synchronous_save_holds_the_model_of_its_step(groups: dict[str, Any], tmp_path: Path) -> None:
    """checkpoint.upload=sync: the same layout, committed before training goes on; torch's own converter (not the
    product's reader) finds the weights of that step in it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ahead = groups["uninterrupted"][0]
    path = ahead["synced"]
    assert check_complete(LOCAL, path) is None and manifest_step(LOCAL, path) == STEPS
    dcp_to_torch_save(path, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert _equal(whole["model"], ahead["final"])


def test_a_sharded_checkpoint_resumed_under_ddp_is_refused_naming_the_key(groups: dict[str, Any]) -> None:
    """The shards load only into a sharded model: a resume under train.parallel=ddp stops with one line."""
    from orchestrator.errors import ConfigError

    path = groups["uninterrupted"][0]["path"]
    state = read_checkpoint(ray.train.Checkpoint(path, filesystem=LOCAL))
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, CLASSES))
    optimizer, scheduler = build_optimizer(model, OptimConfig(), STEPS)
    plain = Parts(model, optimizer, scheduler, Precision("fp32", torch.device("cpu")), torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"'train.parallel'.*--set train.parallel=fsdp"):
        restore(plain, state, DECISION)
    assert state["micro_batch_size"] == ROWS // 2 and len(state["rng"]) == 2  # read here, with no process group
