"""The loop's reports under Ray Train: metrics go from rank 0 straight to the run's report channel
(the driver's, or the Tune trial's: training/channel.py) without any barrier; `ray.train.report`
carries only checkpoints.

Why not report every interval through Ray Train: its report is a barrier, and Ray 2.60 blocks every
report after the second until the controller's next poll of the workers. Metrics every few steps
would then set the pace of training. A checkpoint must still go through it: that is what registers
it for restarts and retention.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from typing import Any

import ray.train
import torch.distributed as dist

from orchestrator.training.channel import ChannelSender
from orchestrator.training.checkpoint import PendingCheckpoint, Progress, ShardedSaver
from orchestrator.training.parts import Parts
from orchestrator.training.resume import checkpoint_dir_name


class Outbox:
    """Rank 0's metrics to the driver, sent by a background thread in order: the loop hands an item
    over and goes on, whatever the driver is doing."""

    def __init__(self, destination: ChannelSender) -> None:
        self.destination = destination
        self.items: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self.failed = False
        self.thread = threading.Thread(target=self._send, name="orchestrator-outbox", daemon=True)
        self.thread.start()

    def put(self, item: dict[str, Any]) -> None:
        self.items.put(item)

    def close(self, timeout_s: float = 60.0) -> None:
        """Send what is queued, then stop: called before the worker function returns, so the driver
        has every metric by the time `fit()` does."""
        self.items.put(None)
        self.thread.join(timeout_s)

    def _send(self) -> None:
        try:
            self._send_all()
        finally:
            self.destination.close()  # the driver's reader of this connection ends with it

    def _send_all(self) -> None:
        while (item := self.items.get()) is not None:
            try:
                self.destination.put(item)
            # the driver went away: training and its checkpoints go on without it
            except Exception as exc:
                if not self.failed:
                    host, port = self.destination.address
                    print(f"warning: metrics no longer reach the driver at {host}:{port} "
                          f"({type(exc).__name__}: {exc}); training and checkpoints go on "
                          "(the workers' nodes must reach the driver's node on its "
                          "ephemeral ports: docs/ray-notes.md)", file=sys.stderr, flush=True)
                self.failed = True


class RayReporter:
    """The loop's `Reporter` in a Ray Train worker."""

    def __init__(self, destination: ChannelSender | None, upload: str) -> None:
        self.upload = upload
        rank = ray.train.get_context().get_world_rank()
        self.outbox = Outbox(destination) if rank == 0 and destination is not None else None
        self.sharded = ShardedSaver(asynchronous=upload == "async")

    def publish(self, metrics: dict[str, Any]) -> None:
        if self.outbox is not None:
            self.outbox.put(metrics)

    def close(self) -> None:
        if self.outbox is not None:
            self.outbox.close()

    def save_sharded(self, parts: Parts, progress: Progress, micro_batch_size: int | str | None
                     ) -> PendingCheckpoint:
        """train.parallel=fsdp, every rank: start writing its shards straight into the next
        checkpoint directory in run storage (local or S3), named by rank 0."""
        storage = ray.train.get_context().get_storage()
        name = [checkpoint_dir_name(progress.step)]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(name, src=0)
        return self.sharded.save(storage.storage_filesystem,
                                 storage.build_checkpoint_path_from_name(name[0]), parts, progress,
                                 micro_batch_size)

    def checkpoint(self, metrics: dict[str, Any],
                   checkpoint_dir: str | PendingCheckpoint | None) -> None:
        if isinstance(checkpoint_dir, PendingCheckpoint):
            self._register_sharded(metrics, checkpoint_dir)
            return
        # Ranks other than 0 join the barrier with metrics only. Under failure.mode=replicas each
        # worker is rank 0 of its own process group and builds a checkpoint: Ray's rank 0 alone
        # hands one over.
        if checkpoint_dir is None or ray.train.get_context().get_world_rank() != 0:
            ray.train.report(metrics)
            return
        mode = ray.train.CheckpointUploadMode.SYNC
        if self.upload == "async":
            # Ray copies in a background thread and deletes the directory when done, while the loop
            # deletes the directory it handed over as soon as report returns: hand Ray a renamed one
            # (a rename, not a copy).
            handed, checkpoint_dir = checkpoint_dir, f"{checkpoint_dir}-upload"
            os.rename(handed, checkpoint_dir)
            mode = ray.train.CheckpointUploadMode.ASYNC
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(checkpoint_dir),
                         checkpoint_dir_name=checkpoint_dir_name(metrics["step"]),
                         checkpoint_upload_mode=mode)

    def _register_sharded(self, metrics: dict[str, Any], pending: PendingCheckpoint) -> None:
        """Every rank reports the checkpoint directory its shards go to. Ray's "upload" is the
        commit: wait for this rank's shards (rank 0: for all of them, then write the manifest). Ray
        registers the checkpoint once every rank's commit returned, in a background thread under
        upload=async (training goes on), before report returns under sync. Nothing is copied: the
        shards are already in storage."""
        in_storage = ray.train.Checkpoint(pending.path, filesystem=pending.filesystem)

        def commit(_: ray.train.Checkpoint, __: str) -> ray.train.Checkpoint:
            pending.commit()
            return in_storage

        mode = (ray.train.CheckpointUploadMode.ASYNC if self.upload == "async"
                else ray.train.CheckpointUploadMode.SYNC)
        name = pending.path.rstrip("/").rsplit("/", 1)[-1]
        ray.train.report(metrics, checkpoint=in_storage, checkpoint_dir_name=name,
                         checkpoint_upload_mode=mode,
                         # the one in storage
                         checkpoint_upload_fn=commit, delete_local_checkpoint_after_upload=False)


