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


EPOCH_MICROS = 10  # micro-batches an epoch: 2.5 steps, so steps straddle epochs


def _epoch(epoch: int) -> Iterator[dict[str, torch.Tensor]]:
    """The same sequence on every replica: each row numbered (`row`, epoch * rows + its index), its values drawn
    from that number."""
    for i in range(EPOCH_MICROS):
        ids = torch.arange(MICRO) + (epoch * EPOCH_MICROS + i) * MICRO
        x = torch.stack([torch.randn(16, generator=torch.Generator().manual_seed(int(n))) for n in ids])
        yield {"x": x, "labels": x[:, :4].argmax(dim=1), "row": ids}


VOCAB, SEQ, LR = 12, 5, 0.5


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights in every replica and in the reference
        self.embed, self.head = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def _tokens(epoch: int) -> Iterator[dict[str, torch.Tensor]]:
    """Next-token rows whose micro-batch i has i + 1 real targets a row (the rest padding): the two replicas' shares
    of a step hold very different token counts."""
    from pipelines.tensors import IGNORE_INDEX

    for i in range(EPOCH_MICROS):
        g = torch.Generator().manual_seed(epoch * EPOCH_MICROS + i)
        x, y = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g), torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        y[:, i % SEQ + 1:] = IGNORE_INDEX
        ids = torch.arange(MICRO) + (epoch * EPOCH_MICROS + i) * MICRO
        yield {"x": x, "labels": y, "row": ids}


def _lm_parts() -> Any:
    from orchestrator.models.tasks import CausalLM
    from orchestrator.training.parts import Parts
    from orchestrator.training.precision import Precision

    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)  # plain SGD: a wrongly scaled gradient shows in the step
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return Parts(model, optimizer, schedule, Precision("fp32", torch.device("cpu")), torch.device("cpu"), None,
                 task=CausalLM())


def _replica(rank: int, lighthouse: str, out: str, die_at: int | None, steps: int = STEPS, lm: bool = False) -> None:
    """One replica in its own process and its own gloo group of one; `die_at`: os._exit after that many steps.
    Logs each report, the rows of each step it ran with the quorum's verdict, and when its loop ended."""
    import torch.distributed as dist

    from orchestrator.training.checkpoint import Progress
    from orchestrator.training.loop import Data, run
    from orchestrator.training.micro_batch import for_world_size
    from orchestrator.training.parts import build_parts
    from orchestrator.training.replicas import ReplicaReporter, StepRows, join_replicas

    os.dup2(os.open(f"{out}/replica{rank}-{os.getpid()}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    torch.set_num_threads(1)
    port = _free_port()
    os.environ.update(TORCHFT_LIGHTHOUSE=lighthouse, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    cfg = for_world_size(replica_config(f"train.max_steps={steps}", f"optim.warmup_steps={min(2, steps - 1)}"), 2)
    parts = _lm_parts() if lm else build_parts(cfg, 16, torch.device("cpu"))
    source = _tokens if lm else _epoch
    progress = Progress()
    log = open(f"{out}/reports.jsonl", "a")  # noqa: SIM115 - kept open for the process's life

    def write(event: dict[str, Any]) -> None:
        log.write(json.dumps(event | {"t": time.time(), "pid": os.getpid()}) + "\n")
        log.flush()

    def stream(epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        for batch in source(epoch):
            if die_at is not None and progress.step >= die_at:
                write({"died": rank, "step": progress.step})
                os._exit(1)  # no cleanup, as after a SIGKILL
            time.sleep(0.01)  # slow enough steps that the survivor is still training when the newcomer comes
            yield batch

    rows = StepRows(stream, GLOBAL // MICRO, MICRO, EPOCH_MICROS, torch.device("cpu"))
    replicas = join_replicas(parts, progress, rank, 2, rows)
    share, done, taken = rows.share, replicas.step_done, {}

    def share_seen(step: int, at: int, participants: int) -> list[dict[str, torch.Tensor]]:
        batches = share(step, at, participants)
        taken.update(step=step, rows=[int(n) for batch in batches for n in batch["row"]])
        return batches

    def done_seen(result: Any, global_batch: int) -> bool:
        committed = done(result, global_batch)
        write({"trained": rank, "step": taken["step"], "rows": taken["rows"], "committed": committed})
        return committed

    rows.share, replicas.step_done = share_seen, done_seen  # type: ignore[method-assign]

    class Recorder:
        def publish(self, metrics: dict[str, Any]) -> None:
            rows = round(metrics["samples_per_s"] * metrics["interval_s"])
            write({"rank": rank, "step": metrics["step"], "rows": rows, "loss": metrics["train_loss"],
                   "participants": metrics["replicas/live"], "dropped": metrics["replicas/dropped_steps"]})

        def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
            pass

    run(cfg, parts, Data(stream), ReplicaReporter(Recorder(), replicas), progress, replicas=replicas)
    write({"finished": rank, "step": progress.step})
    replicas.finish()
    torch.save({k: v.clone() for k, v in parts.model.module.state_dict().items()}, f"{out}/final{rank}.pt")
    write({"saved": rank})
    replicas.shutdown()
    os._exit(0)


def _events(out: Path) -> list[dict[str, Any]]:
    lines = (out / "reports.jsonl").read_text().splitlines() if (out / "reports.jsonl").exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]  # a line being written is left for later


def _assert_every_row_trained_once(events: list[dict[str, Any]], steps: int) -> None:
    """Each step's committed rows (over the replicas that ran it) are exactly its rows: micro-batches s*G to
    (s+1)*G - 1 of the one sequence. So every row of every epoch the run went through is trained exactly once."""
    per_step = GLOBAL // MICRO
    trained: dict[int, list[int]] = {}
    for event in events:
        if event.get("committed"):
            trained.setdefault(event["step"], []).extend(event["rows"])
    assert sorted(trained) == list(range(steps))
    for step, found in trained.items():
        assert sorted(found) == list(range(step * per_step * MICRO, (step + 1) * per_step * MICRO)), step
    everything = sorted(n for found in trained.values() for n in found)
    assert everything == list(range(steps * GLOBAL))  # whole epochs included: each row once, none left out


def _alone_steps(out: Path) -> list[int]:
    """Steps the survivor (rank 0) committed alone so far."""
    return [e["step"] for e in _events(out) if e.get("rank") == 0 and e.get("participants") == 1]


def _ended(processes: list[Any], lighthouse: Any, out: Path) -> str:
    for p in processes:
        if p.is_alive():
            p.kill()
    lighthouse.shutdown()
    return "\n".join(p.read_text()[-2000:] for p in out.glob("*.err"))


def _final_weights_equal(out: Path) -> bool:
    final = [torch.load(out / f"final{r}.pt") for r in (0, 1)]
    return all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def test_a_replica_killed_mid_run_is_replaced_while_the_survivor_keeps_stepping(tmp_path: Path) -> None:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    spawn = mp.get_context("spawn")
    survivor = spawn.Process(target=_replica, args=(0, lighthouse.address(), str(tmp_path), None))
    doomed = spawn.Process(target=_replica, args=(1, lighthouse.address(), str(tmp_path), 30))
    newcomer = spawn.Process(target=_replica, args=(1, lighthouse.address(), str(tmp_path), None))
    survivor.start()
    doomed.start()
    try:
        doomed.join(120)
        assert doomed.exitcode == 1
        # The newcomer starts a while after the death, as Ray's replacement does: here once the survivor has
        # stepped alone 3 times (or 60 s passed), however long its detection of the death takes on a loaded machine.
        deadline = time.time() + 60
        while time.time() < deadline and len(_alone_steps(tmp_path)) < 3:
            time.sleep(0.1)
        newcomer.start()
        survivor.join(180)
        newcomer.join(60)
    finally:
        errors = _ended([survivor, doomed, newcomer], lighthouse, tmp_path)
    assert survivor.exitcode == 0 and newcomer.exitcode == 0, errors
    events = _events(tmp_path)
    died = next(e for e in events if "died" in e)
    back = min(e["t"] for e in events if e.get("rank") == 1 and e["t"] > died["t"])
    mine = [e for e in events if e.get("rank") == 0]
    # Both started together (a fresh run's first quorum waits for every replica), the survivor's step counter never
    # goes back, and it kept stepping while replica 1 was gone.
    assert [e["step"] for e in mine] == list(range(1, STEPS + 1)) and mine[0]["participants"] == 2
    # (The step in flight at the death still had 2 in its quorum: its all-reduce failed and it did not commit.)
    alone = [e for e in mine if died["t"] < e["t"] < back and e["participants"] == 1]
    assert len(alone) >= 3, (died, back, [(e["step"], e["t"]) for e in mine])
    # The death cost the survivor at most the step in flight (not committed, then redone), and no step after it.
    assert mine[-1]["dropped"] <= 1
    # Each report counts the global batch of every step, whichever replicas ran it.
    assert {e["rows"] for e in mine} == {GLOBAL}
    # Every row trained exactly once: by the survivor alone, by both, in the redone step, after the newcomer came.
    trained = [e for e in events if "trained" in e]
    assert {len(e["rows"]) for e in trained
            if e["trained"] == 0 and e["committed"] and e["step"] in {a["step"] - 1 for a in alone}} == {GLOBAL}
    _assert_every_row_trained_once(events, STEPS)
    # The newcomer started at the survivor's step (its state came from the peer) and both end alike.
    first_back = min((e for e in events if e.get("rank") == 1 and e["t"] > died["t"]), key=lambda e: e["t"])
    assert first_back["step"] > died["step"]
    assert _final_weights_equal(tmp_path)


def test_a_replica_back_after_its_peer_finished_takes_the_final_state(tmp_path: Path) -> None:
    from torchft.coordination import LighthouseServer

    steps = 40
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    spawn = mp.get_context("spawn")
    survivor = spawn.Process(target=_replica, args=(0, lighthouse.address(), str(tmp_path), None, steps))
    doomed = spawn.Process(target=_replica, args=(1, lighthouse.address(), str(tmp_path), 30, steps))
    newcomer = spawn.Process(target=_replica, args=(1, lighthouse.address(), str(tmp_path), None, steps))
    survivor.start()
    doomed.start()
    try:
        doomed.join(120)
        # The replacement comes only after the survivor ended the run: it waits for it at the end.
        deadline = time.time() + 120
        while time.time() < deadline and not [e for e in _events(tmp_path) if e.get("finished") == 0]:
            time.sleep(0.1)
        newcomer.start()
        survivor.join(120)
        newcomer.join(60)
    finally:
        errors = _ended([survivor, doomed, newcomer], lighthouse, tmp_path)
    assert doomed.exitcode == 1 and survivor.exitcode == 0 and newcomer.exitcode == 0, errors
    events = _events(tmp_path)
    came = min(e["t"] for e in events if e.get("finished") == 0)
    # The newcomer trained nothing (not the run again, alone, from step 0): it took the final state, and its one
    # report is the survivor's last, at the last step.
    assert not [e for e in events if e.get("trained") == 1 and e["t"] > came]
    assert [e["step"] for e in events if e.get("rank") == 1 and e["t"] > came] == [steps]
    assert [e["step"] for e in events if e.get("finished") == 1] == [steps]
    _assert_every_row_trained_once(events, steps)
    assert _final_weights_equal(tmp_path)


def test_the_token_loss_is_normalised_over_every_live_replicas_tokens(tmp_path: Path) -> None:
    """One step of two replicas whose shares hold 3 and 7 targets a row: the update is plain torch's one SGD step
    on the mean over all the step's tokens (a mean of each replica's own token mean would step elsewhere)."""
    from torchft.coordination import LighthouseServer

    from orchestrator.models.tasks import CausalLM

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    spawn = mp.get_context("spawn")
    group = [spawn.Process(target=_replica, args=(r, lighthouse.address(), str(tmp_path), None, 1, True))
             for r in (0, 1)]
    for p in group:
        p.start()
    try:
        for p in group:
            p.join(120)
    finally:
        errors = _ended(group, lighthouse, tmp_path)
    assert [p.exitcode for p in group] == [0, 0], errors
    reference = TinyLM()
    step = list(_tokens(0))[:GLOBAL // MICRO]
    task = CausalLM()
    loss = sum(task.loss_sum(reference(b["x"]), b) for b in step) / sum(task.count(b) for b in step)
    loss.backward()
    torch.optim.SGD(reference.parameters(), lr=LR).step()
    final = torch.load(tmp_path / "final0.pt")
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6)
    assert _final_weights_equal(tmp_path)


class _Quorum:
    """A torchft manager's answers for a quorum of `live` replicas that commits every step (no lighthouse): enough
    for the real `Replicas` to give the loop its share of each step and count the step's global batch."""

    def __init__(self, live: int, progress: Any) -> None:
        self.live, self.progress = live, progress

    def start_quorum(self) -> None:
        pass

    def num_participants(self) -> int:
        return self.live

    def participating_rank(self) -> int:
        return 0

    def current_step(self) -> int:
        return self.progress.step


@pytest.mark.parametrize("live", [1, 2])
def test_mfu_under_replicas_is_over_the_devices_that_trained_the_counted_rows(live: int) -> None:
    """A replica counts the whole global batch of each step (every live replica's rows), so its MFU divides by the
    peak of every live replica's device: it equals this one device's own figure, counted here from the rows it
    trained itself (a division by one device's peak reports `live` times that)."""
    from types import SimpleNamespace

    from orchestrator.training.checkpoint import Progress
    from orchestrator.training.loop import Data, run
    from orchestrator.training.micro_batch import for_world_size
    from orchestrator.training.parts import build_parts
    from orchestrator.training.replicas import Replicas, StepRows

    steps, log_every, peak_tflops = 8, 4, 0.001
    cfg = for_world_size(replica_config(f"train.max_steps={steps}", f"train.log_every={log_every}",
                                        f"train.peak_tflops={peak_tflops}"), 2)
    parts = build_parts(cfg, 16, torch.device("cpu"))
    progress = Progress()
    rows = StepRows(_epoch, GLOBAL // MICRO, MICRO, EPOCH_MICROS, torch.device("cpu"))
    trained: list[int] = []  # rows this replica trained, step by step
    share = rows.share

    def share_counted(step: int, rank: int, participants: int) -> list[dict[str, torch.Tensor]]:
        batches = share(step, rank, participants)
        trained.append(sum(len(b["row"]) for b in batches))
        return batches

    rows.share = share_counted  # type: ignore[method-assign]
    replicas = Replicas(_Quorum(live, progress), SimpleNamespace(committed=True, dropped=0),  # type: ignore[arg-type]
                        live, rows, progress)

    class Recorder:
        def __init__(self) -> None:
            self.reports: list[dict[str, Any]] = []

        def publish(self, metrics: dict[str, Any]) -> None:
            self.reports.append(metrics)

        def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
            pass

    recorder = Recorder()
    run(cfg, parts, Data(_epoch), recorder, progress, replicas=replicas)
    assert len(recorder.reports) == steps // log_every and trained == [GLOBAL // live] * steps
    for index, report in enumerate(recorder.reports):
        assert report["samples_per_s"] * report["interval_s"] == pytest.approx(GLOBAL * log_every)  # all replicas'
        own = sum(trained[index * log_every:(index + 1) * log_every])  # this device's rows in the interval
        one_device = report["flops_per_sample"] * own / report["interval_s"] / (peak_tflops * 1e12)
        assert report["mfu"] == pytest.approx(one_device, rel=1e-6), (live, report["mfu"] / one_device)
