"""failure.mode=replicas without Ray: two torchft replicas (each its own one-process gloo group, as Ray's
TorchftConfig makes them) run the real loop against a real lighthouse; one dies hard mid-run and a new one takes its
place. The survivor keeps stepping alone on the whole global batch, the newcomer copies its state from the survivor,
and both end with the same weights. Plus the batch-share arithmetic and the config refusals."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from orchestrator.config import load_config
from orchestrator.config.batching import replica_micro_batches
from orchestrator.errors import ConfigError

torchft = pytest.importorskip("torchft")  # the `replicas` extra

GLOBAL, MICRO, STEPS = 32, 8, 240


def replica_config(*extra: str) -> Any:
    return load_config(None, ["scaling.num_workers=2", "failure.mode=replicas", f"train.global_batch_size={GLOBAL}",
                              f"train.micro_batch_size={MICRO}", "model.hidden=[32]", "model.num_classes=4",
                              "optim.warmup_steps=2", f"train.max_steps={STEPS}", "train.log_every=1",
                              "train.precision=fp32", *extra])


def test_the_live_replicas_split_the_global_batch() -> None:
    assert [replica_micro_batches(32, 8, p) for p in (1, 2, 4)] == [4, 2, 1]
    with pytest.raises(ValueError, match="over 3 live replica"):
        replica_micro_batches(32, 8, 3)


@pytest.mark.parametrize(("extra", "message"), [
    (["scaling.num_workers=1"], "num_workers >= 2"),
    (["scaling.num_workers=[2, 4]", "train.global_batch_size=96"], "fixed scaling.num_workers"),
    (["train.parallel=fsdp"], "train.parallel=ddp"),
    (["train.sync=local_sgd"], "train.sync=ddp"),
    (["train.micro_batch_size=auto"], "fixed train.micro_batch_size"),
    (["checkpoint.every_minutes=5"], "saves only the last step"),
    (["autopilot.enabled=true"], "autopilot"),
    (["scaling.num_workers=4"], "over 3 live replica"),
])
def test_what_replicas_cannot_run_with_is_refused_naming_the_key(extra: list[str], message: str) -> None:
    base = ["failure.mode=replicas", "train.global_batch_size=64", "train.micro_batch_size=8"]
    with pytest.raises(ConfigError, match="failure.mode") as caught:
        load_config(None, [*base, *extra])
    assert message in str(caught.value)


def test_restart_stays_the_default() -> None:
    assert load_config(None, []).failure.mode == "restart"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica(rank: int, lighthouse: str, out: str, die_at: int | None) -> None:
    """One replica in its own process and its own gloo group of one; `die_at`: os._exit after that many steps."""
    import torch.distributed as dist

    from orchestrator.training.checkpoint import Progress
    from orchestrator.training.loop import run
    from orchestrator.training.micro_batch import for_world_size
    from orchestrator.training.parts import build_parts
    from orchestrator.training.replicas import join_replicas

    os.dup2(os.open(f"{out}/replica{rank}-{os.getpid()}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    torch.set_num_threads(1)
    port = _free_port()
    os.environ.update(TORCHFT_LIGHTHOUSE=lighthouse, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    cfg = for_world_size(replica_config(), 2)
    parts = build_parts(cfg, 16, torch.device("cpu"))
    progress = Progress()
    replicas = join_replicas(parts, progress, rank, 2, GLOBAL, MICRO)
    log = open(f"{out}/reports.jsonl", "a")  # noqa: SIM115 - kept open for the process's life

    def stream(epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(1000 * rank + epoch)
        for _ in range(1000):
            if die_at is not None and progress.step >= die_at:
                log.write(json.dumps({"died": rank, "t": time.time(), "step": progress.step}) + "\n")
                log.flush()
                os._exit(1)  # no cleanup, as after a SIGKILL
            time.sleep(0.02)  # slow enough steps that the survivor is still training when the newcomer comes
            x = torch.randn(MICRO, 16, generator=g)
            yield {"x": x, "labels": x[:, :4].argmax(dim=1)}

    class Recorder:
        def publish(self, metrics: dict[str, Any]) -> None:
            rows = round(metrics["samples_per_s"] * metrics["interval_s"])
            log.write(json.dumps({"rank": rank, "pid": os.getpid(), "t": time.time(), "step": metrics["step"],
                                  "rows": rows, "loss": metrics["train_loss"],
                                  "participants": metrics["replicas/live"],
                                  "dropped": metrics["replicas/dropped_steps"]}) + "\n")
            log.flush()

        def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
            pass

    run(cfg, parts, stream, None, Recorder(), progress, replicas=replicas)  # type: ignore[arg-type]
    torch.save({k: v.clone() for k, v in parts.model.module.state_dict().items()}, f"{out}/final{rank}.pt")
    replicas.shutdown()
    os._exit(0)


def _alone_steps(reports: Path) -> list[int]:
    """Steps the survivor (rank 0) committed alone so far."""
    lines = reports.read_text().splitlines() if reports.exists() else []
    events = [json.loads(line) for line in lines if line.endswith("}")]  # a line being written is left for later
    return [e["step"] for e in events if e.get("rank") == 0 and e.get("participants") == 1]


def test_a_replica_killed_mid_run_is_replaced_while_the_survivor_keeps_stepping(tmp_path: Path) -> None:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    spawn = mp.get_context("spawn")
    survivor = spawn.Process(target=_replica, args=(0, lighthouse.address(), str(tmp_path), None))
    doomed = spawn.Process(target=_replica, args=(1, lighthouse.address(), str(tmp_path), 30))
    survivor.start()
    doomed.start()
    try:
        doomed.join(120)
        assert doomed.exitcode == 1
        # The newcomer starts a while after the death, as Ray's replacement does: here once the survivor has
        # stepped alone 3 times (or 60 s passed), however long its detection of the death takes on a loaded machine.
        deadline = time.time() + 60
        while time.time() < deadline and len(_alone_steps(tmp_path / "reports.jsonl")) < 3:
            time.sleep(0.1)
        newcomer = spawn.Process(target=_replica, args=(1, lighthouse.address(), str(tmp_path), None))
        newcomer.start()
        survivor.join(180)
        newcomer.join(60)
    finally:
        for p in (survivor, doomed):
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    errors = "\n".join(p.read_text()[-2000:] for p in tmp_path.glob("*.err"))
    assert survivor.exitcode == 0 and newcomer.exitcode == 0, errors
    events = [json.loads(line) for line in (tmp_path / "reports.jsonl").read_text().splitlines()]
    died = next(e for e in events if "died" in e)
    back = min(e["t"] for e in events if e.get("rank") == 1 and e["t"] > died["t"])
    mine = [e for e in events if e.get("rank") == 0]
    # Both started together (a fresh run's first quorum waits for every replica), the survivor's step counter never
    # goes back, and it kept stepping while replica 1 was gone.
    assert [e["step"] for e in mine] == list(range(1, STEPS + 1)) and mine[0]["participants"] == 2
    # (The step in flight at the death still had 2 in its quorum: its all-reduce failed and it did not commit.)
    alone = [e for e in mine if died["t"] < e["t"] < back and e["participants"] == 1]
    assert len(alone) >= 3, (died, back, [(e["step"], e["t"]) for e in mine])
    # The death cost the survivor at most the step in flight (not committed), and no step after it.
    assert mine[-1]["dropped"] <= 1
    # Alone it ran the whole global batch, with the other replica its half.
    assert {e["rows"] for e in alone} == {GLOBAL}
    assert {e["rows"] for e in mine if e["participants"] == 2} == {GLOBAL // 2}
    # The newcomer started at the survivor's step (its state came from the peer) and both end alike.
    first_back = min((e for e in events if e.get("rank") == 1 and e["t"] > died["t"]), key=lambda e: e["t"])
    assert first_back["step"] > died["step"]
    final = [torch.load(tmp_path / f"final{r}.pt") for r in (0, 1)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
