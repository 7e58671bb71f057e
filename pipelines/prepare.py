"""Writers for the bundled datasets: real digits images and a learnable synthetic set of any size."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.errors import DataError


def _table(x: np.ndarray, y: np.ndarray, feature_column: str) -> pa.Table:
    # One fixed-size-list column for all features: about 2x faster to decode than one column per feature.
    flat = pa.array(np.ascontiguousarray(x, dtype=np.float32).ravel())
    return pa.table({
        feature_column: pa.FixedSizeListArray.from_arrays(flat, x.shape[1]),
        "label": pa.array(y.astype(np.int64)),
    })


def write_shard(table: pa.Table, path: Path) -> None:
    """Write one shard atomically: readers see the old file or the complete new one, never half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    # Random floats barely compress and dictionary encoding inflates them, so it is off.
    pq.write_table(table, tmp, use_dictionary=False, row_group_size=max(1, min(len(table), 65536)))
    os.replace(tmp, path)


def _write_split(out: Path, split: str, x: np.ndarray, y: np.ndarray, shards: int) -> None:
    directory = out / split
    directory.mkdir(parents=True, exist_ok=True)
    for i, idx in enumerate(np.array_split(np.arange(len(y)), shards)):
        write_shard(_table(x[idx], y[idx], "pixels"), directory / f"part-{i:05d}.parquet")


def _check_out(out: str, shards: int) -> Path:
    if "://" in out:
        raise DataError(f"--out {out}: only local directories are supported as an output")
    if shards < 1:
        raise DataError(f"--shards must be at least 1, got {shards}")
    return Path(out)


def prepare_digits(out: str, shards: int = 4, val_fraction: float = 0.2, seed: int = 0) -> dict[str, int]:
    """scikit-learn's bundled 8x8 digits (1,797 real images, no download), scaled to [0, 1], split train/val."""
    from sklearn.datasets import load_digits

    root = _check_out(out, shards)
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_val = int(round(len(y) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    _write_split(root, "train", x[train], y[train], shards)
    _write_split(root, "val", x[val], y[val], max(1, shards // 2))
    return {"train": len(train), "val": len(val)}


def _synthetic_split(
    directory: Path, rows: int, shards: int, centres: np.ndarray, seed: int, stream: int
) -> None:
    """Gaussian clusters around fixed class centres, written one shard at a time so memory stays bounded."""
    directory.mkdir(parents=True, exist_ok=True)
    classes, features = centres.shape
    for i, size in enumerate(len(part) for part in np.array_split(np.arange(rows), shards)):
        rng = np.random.default_rng([seed, stream, i])
        y = rng.integers(0, classes, size=size)
        x = centres[y] + rng.normal(0.0, 1.0, size=(size, features)).astype(np.float32)
        write_shard(_table(x, y, "features"), directory / f"part-{i:05d}.parquet")


def prepare_synthetic(
    out: str, rows: int, shards: int, features: int = 64, classes: int = 10, val_rows: int = 0, seed: int = 0
) -> dict[str, int]:
    """A learnable classification set of any size (for benchmarks and streaming tests)."""
    root = _check_out(out, shards)
    if rows < shards:
        raise DataError(f"--rows ({rows}) must be at least --shards ({shards})")
    # Train and val share the class centres (same task) but draw their rows from different streams.
    centres = np.random.default_rng(seed).normal(0.0, 1.0, size=(classes, features)).astype(np.float32)
    _synthetic_split(root / "train", rows, shards, centres, seed, stream=0)
    if val_rows:
        _synthetic_split(root / "val", val_rows, 1, centres, seed, stream=1)
    return {"train": rows, "val": val_rows}
