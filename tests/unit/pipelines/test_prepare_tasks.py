"""`prepare diabetes` and `prepare sequences`: exact columns and types, splits that add up, determinism."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.errors import DataError
from pipelines.prepare import prepare_diabetes, prepare_sequences
from pipelines.sources import inspect_parquet

ROOT = Path(__file__).resolve().parents[3]

DIABETES_SCHEMA = pa.schema([
    ("features", pa.list_(pa.float32(), 10)),
    ("sex", pa.int64()),
    ("age_bucket", pa.int64()),
    ("dense", pa.list_(pa.float32(), 8)),
    ("target", pa.float32()),
])
SEQUENCES_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int64())), ("label", pa.int64())])


def read_split(directory: Path) -> pa.Table:
    """Every shard of a split, in file order, each checked to be a whole Parquet file (no temporaries left)."""
    files = sorted(directory.iterdir())
    assert files and all(f.name.startswith("part-") and f.suffix == ".parquet" for f in files)
    return pa.concat_tables([pq.read_table(f) for f in files])


def rows_of(table: pa.Table, column: str) -> list[tuple[float, ...]]:
    return [tuple(row) for row in table.column(column).to_pylist()]


def test_diabetes_columns_split_and_standardised_target(tmp_path: Path) -> None:
    from sklearn.datasets import load_diabetes

    assert prepare_diabetes(str(tmp_path)) == {"train": 354, "val": 88}
    train, val = read_split(tmp_path / "train"), read_split(tmp_path / "val")
    assert len(list((tmp_path / "train").iterdir())) == 2 and len(list((tmp_path / "val").iterdir())) == 1
    for table in (train, val):
        assert table.schema.remove_metadata().equals(DIABETES_SCHEMA)
    both = pa.concat_tables([train, val])
    assert len(both) == 442
    assert set(rows_of(train, "features")).isdisjoint(rows_of(val, "features"))
    assert len(set(rows_of(both, "features"))) == 442  # every patient exactly once

    x = np.stack(both.column("features").to_numpy(zero_copy_only=False))
    assert np.allclose(np.stack(both.column("dense").to_numpy(zero_copy_only=False)), x[:, 2:])
    sex = both.column("sex").to_numpy()
    assert set(sex.tolist()) == {0, 1} and np.array_equal(sex, (x[:, 1] > 0).astype(np.int64))
    buckets = np.bincount(both.column("age_bucket").to_numpy(), minlength=10)
    assert len(buckets) == 10 and buckets.min() >= 30  # ten near-equal buckets (ties in age keep them uneven)
    age, bucket = x[:, 0], both.column("age_bucket").to_numpy()
    assert all(age[bucket == b].max() <= age[bucket == b + 1].min() for b in range(9))  # ordered by age

    target = both.column("target").to_numpy()
    assert abs(target.mean()) < 1e-5 and abs(target.std() - 1) < 1e-5
    meta = train.schema.metadata
    restored = target * float(meta[b"target_std"]) + float(meta[b"target_mean"])
    assert np.allclose(np.sort(restored), np.sort(load_diabetes().target), atol=1e-3)

    info = inspect_parquet(str(tmp_path / "train"), ["features"], "target")
    assert (info.num_rows, info.feature_dim) == (354, 10)
    assert inspect_parquet(str(tmp_path / "train"), ["sex", "age_bucket", "dense"], "target",
                           named=True).feature_dim == 10


def test_diabetes_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        prepare_diabetes(str(tmp_path / name), seed=seed)
    a, b, c = (read_split(tmp_path / name / "val") for name in "abc")
    assert a.equals(b) and not a.equals(c)


def test_sequences_columns_lengths_and_balanced_learnable_labels(tmp_path: Path) -> None:
    assert prepare_sequences(str(tmp_path)) == {"train": 1600, "val": 400}
    train, val = read_split(tmp_path / "train"), read_split(tmp_path / "val")
    for table in (train, val):
        assert table.schema.remove_metadata().equals(SEQUENCES_SCHEMA)
        assert table.schema.metadata == {b"vocab_size": b"64"}
    rows = train.column("input_ids").to_pylist() + val.column("input_ids").to_pylist()
    labels = np.concatenate([train.column("label").to_numpy(), val.column("label").to_numpy()])
    assert len(rows) == 2000
    assert {len(r) for r in rows} == set(range(4, 25))
    assert all(r[0] == 1 and 2 <= min(r[1:]) and max(r[1:]) < 64 for r in rows)
    # The label is a linear rule on token counts, so a bag-of-tokens model can learn it exactly.
    assert np.array_equal(labels, np.array([r.count(2) > r.count(3) for r in rows], dtype=np.int64))
    for split in (train, val):
        assert 0.35 <= split.column("label").to_numpy().mean() <= 0.65
    # Val rows are fresh draws, not train rows; a short row can repeat by chance, so allow a rare coincidence.
    assert len(set(rows_of(val, "input_ids")) & set(rows_of(train, "input_ids"))) <= 4

    info = inspect_parquet(str(tmp_path / "train"), ["input_ids"], "label", named=True)
    assert (info.num_rows, info.feature_dim, info.num_classes) == (1600, 0, 2)
    assert info.sample is not None and info.sample.column("input_ids").type == pa.list_(pa.int64())


def test_sequences_options_and_determinism(tmp_path: Path) -> None:
    args = {"rows": 300, "vocab": 10, "lengths": (2, 5), "shards": 3, "val_fraction": 0.1}
    assert prepare_sequences(str(tmp_path / "a"), seed=1, **args) == {"train": 270, "val": 30}
    prepare_sequences(str(tmp_path / "b"), seed=1, **args)
    prepare_sequences(str(tmp_path / "c"), seed=2, **args)
    a, b, c = (read_split(tmp_path / name / "train") for name in "abc")
    assert len(list((tmp_path / "a" / "train").iterdir())) == 3
    assert a.equals(b) and not a.equals(c)
    lengths = {len(r) for r in a.column("input_ids").to_pylist()}
    assert lengths <= set(range(2, 6)) and a.schema.metadata == {b"vocab_size": b"10"}


@pytest.mark.parametrize("call, message", [
    (lambda out: prepare_diabetes(out, val_fraction=1.0), "--val-fraction must be between 0 and 1"),
    (lambda out: prepare_diabetes(out, shards=0), "--shards must be at least 1"),
    (lambda out: prepare_sequences(out, vocab=3), "--vocab must be at least 4"),
    (lambda out: prepare_sequences(out, lengths=(8, 4)), "need 2 <= --min-len <= --max-len"),
    (lambda out: prepare_sequences(out, rows=2, val_fraction=0.1), "leaves an empty train or val split"),
])
def test_bad_options_are_data_errors(tmp_path: Path, call: Callable[[str], object], message: str) -> None:
    with pytest.raises(DataError, match=message):
        call(str(tmp_path))
    assert not (tmp_path / "train").exists()  # checked before anything is written


def test_cli_prepares_diabetes(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "orchestrator", "prepare", "diabetes", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"wrote 354 train rows, 88 val rows to {tmp_path}"
    assert len(read_split(tmp_path / "train")) == 354
