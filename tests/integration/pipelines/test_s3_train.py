"""End to end from s3:// (moto_server over HTTP): 2 epochs of DDP through the node-local disk cache; the second
epoch reads every shard from the cache and makes no GET for them."""

from __future__ import annotations

from pathlib import Path

import pytest
from s3_server import MotoServer

from orchestrator.config import load_config
from orchestrator.run.launch import train
from pipelines.cache import cache_stats
from pipelines.config import S3Config
from pipelines.prepare import prepare_digits
from pipelines.sources import inspect_parquet

pytestmark = pytest.mark.slow


def test_two_epochs_from_s3_with_disk_cache(ray_cluster: None, moto: MotoServer, bucket: str,
                                            tmp_path: Path) -> None:
    s3 = S3Config(endpoint=moto.url)
    prepare_digits(f"s3://{bucket}/digits", shards=4, s3=s3)
    train_gets = f"/{bucket}/digits/train/"
    before = len(moto.requests("GET", train_gets))
    inspect_parquet(f"s3://{bucket}/digits/train", ["pixels"], "label", s3)
    footer_gets = len(moto.requests("GET", train_gets)) - before

    cache = tmp_path / "cache"
    # 1438 train rows, 2 workers x 64: 11 steps per epoch; 22 steps = exactly 2 epochs; eval once at the end.
    result = train(load_config(None, [
        f"data.train=s3://{bucket}/digits/train", f"data.val=s3://{bucket}/digits/val", f"data.s3.endpoint={moto.url}",
        f"data.cache={cache}", "data.transforms=[{normalize: {mean: 0.5, std: 0.5}}]", "scaling.num_workers=2",
        "train.global_batch_size=128", "train.max_steps=22", "train.log_every=11", "train.eval_every=22",
        "checkpoint.every=22", "optim.lr=0.01", f"storage.path={tmp_path}/runs", "tracking.enabled=false",
    ]), verbose=False)
    assert result.metrics["step"] == 22 and result.metrics["epoch"] == 1  # epochs 0 and 1, both complete
    assert result.metrics["val_accuracy"] > 0.5  # it learned from the S3 data

    stats = cache_stats(str(cache))
    # 4 train + 2 val shards downloaded once; epoch 2 served all 4 train shards from local disk, and the second rank's
    # read of the 2 val shards too (each rank reads the validation data whole; the ranks read it at once: one
    # downloads each shard, the other waits for that copy).
    assert (stats.misses, stats.hits) == (6, 6)
    train_gets_during_run = len(moto.requests("GET", train_gets)) - before - footer_gets
    # The driver's footer check again, then exactly one download per train shard: none in epoch 2.
    assert train_gets_during_run == footer_gets + 4
