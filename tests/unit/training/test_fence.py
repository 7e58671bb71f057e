"""One writer per run (training/fence.py): attempts' claims in real local storage, their order (ties broken alike
by every attempt), and the loop of an attempt whose run a newer attempt claimed: it saves and reports nothing more.
The loop runs in-process (no Ray); a claim is made by the product's own function, as a launch makes it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from test_loop import Recorder, batches, config, dataset, make_parts

from orchestrator.training.cadence import Notices
from orchestrator.training.fence import CLAIMS_DIR, Claim, Fence, claim_attempt, read_claims
from orchestrator.training.loop import Data, run
from pipelines.storage import open_storage


def test_each_claim_takes_the_next_number_and_the_newest_fences_the_others(tmp_path: Path) -> None:
    storage, run_path = open_storage(str(tmp_path)), f"{tmp_path}/run"
    first, second, third = (claim_attempt(storage, run_path) for _ in range(3))
    assert [c.number for c in (first, second, third)] == [1, 2, 3]
    assert read_claims(storage, run_path) == [first, second, third]
    assert first.at > 0 and first.at <= third.at <= time.time() + 1  # storage's time of each claim
    assert Fence(storage, run_path, first).check() == third
    assert Fence(storage, run_path, second)(now=True)
    assert Fence(storage, run_path, third).check() is None


def test_two_attempts_claiming_the_same_number_agree_which_is_newer(tmp_path: Path) -> None:
    """Object stores have no create-if-absent: two launches that listed the claims at once both take number 2. The
    token orders them, and each attempt's look finds the same newest one; the next launch takes number 3."""
    storage, run_path = open_storage(str(tmp_path)), f"{tmp_path}/run"
    claim_attempt(storage, run_path)
    mine = claim_attempt(storage, run_path)
    token = "f" * 12 if mine.token != "f" * 12 else "0" * 12
    (tmp_path / "run" / CLAIMS_DIR / f"00000002-{token}").write_text("{}")  # the other launch's, written alike
    other = next(c for c in read_claims(storage, run_path) if c.token == token)
    newer, older = max(mine, other), min(mine, other)
    assert Fence(storage, run_path, older).check() == newer
    assert Fence(storage, run_path, newer).check() is None
    assert claim_attempt(storage, run_path).number == 3
    # Anything else in the folder is no claim.
    (tmp_path / "run" / CLAIMS_DIR / "notes.txt").write_text("")
    assert Claim.parse("notes.txt") is None and len(read_claims(storage, run_path)) == 4


def test_the_watch_sees_a_newer_claim_and_the_line_names_both_attempts(tmp_path: Path) -> None:
    storage, run_path = open_storage(str(tmp_path)), f"{tmp_path}/run"
    fence = Fence(storage, run_path, claim_attempt(storage, run_path)).watch(every_s=0.05)
    assert not fence()
    newer = claim_attempt(storage, run_path)
    deadline = time.monotonic() + 10
    while not fence() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fence() and fence.newer == newer
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(newer.at))
    assert fence.line("exp-20261206-051238") == (
        f"attempt 1 of run exp-20261206-051238 stopped: attempt 2 of the same run started at {when}; this attempt "
        "commits no checkpoint and writes nothing more to the run or its MLflow run")


def test_a_superseded_loop_saves_and_reports_nothing_more(tmp_path: Path) -> None:
    """A newer attempt claims the run right after this one's step-2 report. Its watch has not looked since (a flag
    read at report steps), but step 4 saves, and a save looks in storage first: no checkpoint, no report, the loop
    ends there."""
    storage, run_path = open_storage(str(tmp_path)), f"{tmp_path}/run"
    fence = Fence(storage, run_path, claim_attempt(storage, run_path))
    asked: list[bool] = []

    def superseded(now: bool = False) -> bool:
        asked.append(now)
        return fence(now=now)

    class NewerAfterFirstReport(Recorder):
        def publish(self, metrics: dict[str, Any]) -> None:
            super().publish(metrics)
            if metrics["step"] == 2:
                claim_attempt(storage, run_path)  # the newer attempt's launch

    cfg = config("train.max_steps=8", "train.log_every=2", "checkpoint.every=4", "data.val=null")
    x, y = dataset(256)
    report = NewerAfterFirstReport()
    final = run(cfg, make_parts(cfg), Data(lambda epoch: batches(x, y, cfg.train.micro_batch_size)), report,
                notices=Notices(superseded=superseded))
    assert [m["step"] for m, _ in report.reports] == [2] and report.saved is None
    assert final["step"] == 2
    assert asked == [False, True]  # step 2: the flag; step 4, about to save: storage


def test_a_checkpoint_committed_after_a_newer_claim_is_never_resumed_from(tmp_path: Path) -> None:
    """The window the workers' look cannot close: attempt 1 began writing and copying a checkpoint before attempt 2
    claimed the run and committed it after (its manifest, written last, is newer than the claim), and Ray Train's
    record names it as the latest. A resume passes it over for the newest one before it; attempt 2's own later
    checkpoints, and attempt 1's from before the claim, load. Times are the storage's (files' modification times)."""
    import os

    import pyarrow.fs as pafs
    import ray.train
    import torch

    from orchestrator.training.checkpoint import save_state
    from orchestrator.training.resume import checkpointed_cache_decision, loadable_checkpoint

    storage, run_path = open_storage(str(tmp_path)), f"{tmp_path}/run"
    first = claim_attempt(storage, run_path)
    second = claim_attempt(storage, run_path)
    claimed = second.at

    def checkpoint(step: int, attempt: Claim, committed: float) -> str:
        path = tmp_path / "run" / f"checkpoint_{step:08d}_{step:06x}"
        path.mkdir()
        save_state(path, {"progress": {"step": step, "cache_decision": f"from-{step}", "attempt": attempt.name},
                          "weights": torch.zeros(1)})
        os.utime(path / "manifest.json", (committed, committed))
        return str(path)

    before = checkpoint(20, first, claimed - 5)
    late = checkpoint(25, first, claimed + 5)  # attempt 1's commit, after attempt 2's claim
    fs = pafs.LocalFileSystem()
    with pytest.warns(UserWarning, match="was committed by attempt 1 after attempt 2 of the run had claimed it; "
                                         "resuming from step 20"):
        chosen = loadable_checkpoint(ray.train.Checkpoint(late, filesystem=fs))
    assert chosen is not None and chosen.path == before
    assert checkpointed_cache_decision(fs, run_path) == "from-20"
    own = checkpoint(30, second, claimed + 10)  # the newer attempt's own, later still: loaded as it is
    assert loadable_checkpoint(ray.train.Checkpoint(own, filesystem=fs)).path == own  # type: ignore[union-attr]
    assert checkpointed_cache_decision(fs, run_path) == "from-30"
